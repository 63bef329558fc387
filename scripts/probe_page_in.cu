// Probe for the next step of copy-engine paging: how fast can discarded managed pages come back?
// Measures, on 2 GiB of managed memory in 32 slabs of 64 MiB (the optimizers' slab size), after a
// D2H copy into a pinned host copy plus cudaMemDiscardBatchAsync of every slab:
//   A  per slab on one stream: discard-and-prefetch to the GPU, then H2D copy (what PageManager does)
//   B  all slabs' discard-and-prefetch in one batch call first, then the H2D copies
//   C  two streams: populate slab i+1 on stream 2 while slab i is copied on stream 1
//   D  no populate: H2D copy straight into the discarded pages
//   E  plain cudaMemPrefetchAsync of the discarded slabs to the GPU, then H2D copies
// Every variant checks the contents afterwards. Build and run (device): nvcc -O2 -arch=sm_90 -o
// /tmp/probe_in scripts/probe_page_in.cu && /tmp/probe_in
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); } } while (0)

__global__ void fill(unsigned* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (unsigned)(i * 2654435761u) ^ seed;
}
__global__ void check(const unsigned* p, size_t n, unsigned seed, unsigned long long* bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if (p[i] != ((unsigned)(i * 2654435761u) ^ seed)) atomicAdd(bad, 1ull);
}

int main() {
  const size_t slab = 64ull << 20; const int n = 32; const size_t total = slab * n;
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  cudaStream_t s1, s2; CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<cudaEvent_t> ev(n); for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  std::vector<void*> m(n); std::vector<size_t> sz(n, slab);
  for (auto& p : m) CK(cudaMallocManaged(&p, slab));
  char* host; CK(cudaHostAlloc((void**)&host, total, cudaHostAllocDefault));
  unsigned long long* bad; CK(cudaMalloc(&bad, 8));
  cudaMemLocation dev{}; dev.type = cudaMemLocationTypeDevice; dev.id = 0;
  size_t first = 0;
  const char* names[] = {"A per slab: populate + copy, one stream", "B one batch populate, then copies",
                         "C populate i+1 (stream 2) while copying i (stream 1)", "D copies into discarded pages, no populate",
                         "E cudaMemPrefetchAsync of discarded pages, then copies"};
  for (int variant = 0; variant < 5; ++variant) {
    for (int rep = 0; rep < 3; ++rep) {
      unsigned seed = 100 * variant + rep;
      for (int i = 0; i < n; ++i) fill<<<1024, 256, 0, s1>>>((unsigned*)m[i], slab / 4, seed + i);
      for (int i = 0; i < n; ++i) CK(cudaMemcpyAsync(host + i * slab, m[i], slab, cudaMemcpyDeviceToHost, s1));
      CK(cudaMemDiscardBatchAsync(m.data(), sz.data(), n, 0, s1));
      CK(cudaStreamSynchronize(s1));
      CK(cudaEventRecord(a, s1));
      if (variant == 0) {
        for (int i = 0; i < n; ++i) {
          CK(cudaMemDiscardAndPrefetchBatchAsync(&m[i], &sz[i], 1, &dev, &first, 1, 0, s1));
          CK(cudaMemcpyAsync(m[i], host + i * slab, slab, cudaMemcpyHostToDevice, s1));
        }
      } else if (variant == 1) {
        CK(cudaMemDiscardAndPrefetchBatchAsync(m.data(), sz.data(), n, &dev, &first, 1, 0, s1));
        for (int i = 0; i < n; ++i) CK(cudaMemcpyAsync(m[i], host + i * slab, slab, cudaMemcpyHostToDevice, s1));
      } else if (variant == 2) {
        CK(cudaStreamWaitEvent(s2, a, 0));
        for (int i = 0; i < n; ++i) {
          CK(cudaMemDiscardAndPrefetchBatchAsync(&m[i], &sz[i], 1, &dev, &first, 1, 0, s2));
          CK(cudaEventRecord(ev[i], s2));
        }
        for (int i = 0; i < n; ++i) {
          CK(cudaStreamWaitEvent(s1, ev[i], 0));
          CK(cudaMemcpyAsync(m[i], host + i * slab, slab, cudaMemcpyHostToDevice, s1));
        }
      } else if (variant == 3) {
        for (int i = 0; i < n; ++i) CK(cudaMemcpyAsync(m[i], host + i * slab, slab, cudaMemcpyHostToDevice, s1));
      } else {
        for (int i = 0; i < n; ++i) {
          CK(cudaMemPrefetchAsync(m[i], slab, dev, 0, s1));
          CK(cudaMemcpyAsync(m[i], host + i * slab, slab, cudaMemcpyHostToDevice, s1));
        }
      }
      CK(cudaEventRecord(b, s1)); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b);
      CK(cudaMemsetAsync(bad, 0, 8, s1));
      for (int i = 0; i < n; ++i) check<<<1024, 256, 0, s1>>>((const unsigned*)m[i], slab / 4, seed + i, bad);
      unsigned long long nb = 0; CK(cudaMemcpyAsync(&nb, bad, 8, cudaMemcpyDeviceToHost, s1)); CK(cudaStreamSynchronize(s1));
      printf("%-55s rep %d: %7.1f ms %6.1f GB/s, mismatches %llu\n", names[variant], rep, ms, total / ms / 1e6, nb);
    }
  }
  return 0;
}
