// Feasibility probe for copy-engine paging of managed memory: rates of D2H/H2D copies between
// managed ranges and a pinned mirror, cudaMemDiscard(+Prefetch)BatchAsync, and the driver's
// migration, with the GPU's free memory after each stage. nvcc -O2 -o probe probe_discard.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstring>
#include <chrono>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e)); } } while (0)

static size_t freemem() { size_t f, t; cudaMemGetInfo(&f, &t); return f; }
__global__ void fill(unsigned* p, size_t n, unsigned seed) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = (unsigned)(i * 2654435761u) ^ seed; }
__global__ void check(const unsigned* p, size_t n, unsigned seed, unsigned long long* bad) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; for (; i < n; i += (size_t)gridDim.x * blockDim.x) if (p[i] != ((unsigned)(i * 2654435761u) ^ seed)) atomicAdd(bad, 1ull); }

__global__ void bump(unsigned* p, size_t n) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] += 1; }

int main(int argc, char** argv) {
  const size_t slab = 64ull << 20; const int nslab = argc > 1 ? atoi(argv[1]) : 32; const size_t total = slab * nslab;
  cudaSetDevice(0); cudaFree(0);
  cudaStream_t s, s2; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto ms = [&](){ float m; cudaEventElapsedTime(&m, a, b); return m; };
  std::vector<void*> m(nslab); std::vector<size_t> sz(nslab, slab);
  for (int i = 0; i < nslab; ++i) CK(cudaMallocManaged(&m[i], slab));
  void* host; CK(cudaHostAlloc(&host, total, cudaHostAllocDefault));
  void* dev; CK(cudaMalloc(&dev, total));
  unsigned long long* bad; CK(cudaMalloc(&bad, 8));
  size_t f0 = freemem();
  printf("total %.2f GiB in %d slabs; free before %.2f GiB\n", total / 1073741824.0, nslab, f0 / 1073741824.0);
  // pinned copy bandwidth of plain device memory
  for (int rep = 0; rep < 3; ++rep) {
    cudaEventRecord(a, s); CK(cudaMemcpyAsync(host, dev, total, cudaMemcpyDeviceToHost, s)); cudaEventRecord(b, s); cudaEventSynchronize(b);
    printf("plain D2H %.1f ms %.1f GB/s\n", ms(), total / ms() / 1e6);
    cudaEventRecord(a, s); CK(cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, s)); cudaEventRecord(b, s); cudaEventSynchronize(b);
    printf("plain H2D %.1f ms %.1f GB/s\n", ms(), total / ms() / 1e6);
  }
  cudaMemLocation devloc{}; devloc.type = cudaMemLocationTypeDevice; devloc.id = 0;
  cudaMemLocation hostloc{}; hostloc.type = cudaMemLocationTypeHost; hostloc.id = 0;
  size_t idx0 = 0;
  for (int round = 0; round < 3; ++round) {
    unsigned seed = 1234 + round;
    for (int i = 0; i < nslab; ++i) fill<<<1024, 256, 0, s>>>((unsigned*)m[i], slab / 4, seed + i);
    CK(cudaStreamSynchronize(s));
    size_t f1 = freemem();
    printf("[round %d] resident: free %.2f GiB (managed on GPU %.2f GiB)\n", round, f1 / 1073741824.0, (f0 - f1) / 1073741824.0);
    // page-out: D2H into the mirror, then discard+prefetch to host
    auto t0 = std::chrono::steady_clock::now();
    cudaEventRecord(a, s);
    for (int i = 0; i < nslab; ++i) CK(cudaMemcpyAsync((char*)host + i * slab, m[i], slab, cudaMemcpyDeviceToHost, s));
    cudaEvent_t c; cudaEventCreate(&c); cudaEventRecord(c, s);
    if (round == 0) CK(cudaMemDiscardBatchAsync(m.data(), sz.data(), nslab, 0, s));
    else CK(cudaMemDiscardAndPrefetchBatchAsync(m.data(), sz.data(), nslab, &hostloc, &idx0, 1, 0, s));
    cudaEventRecord(b, s); cudaEventSynchronize(b);
    double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    float cm; cudaEventElapsedTime(&cm, a, c);
    size_t f2 = freemem();
    printf("[round %d] page-out (%s): copy %.1f ms (%.1f GB/s), total %.1f ms (%.1f GB/s), host wall %.1f ms; free %.2f GiB (freed %.2f GiB)\n",
           round, round == 0 ? "discard" : "discard+prefetch host", cm, total / cm / 1e6, ms(), total / ms() / 1e6, host_ms, f2 / 1073741824.0, (f2 - f1) / 1073741824.0);
    if (round == 0) {  // does a later prefetch to host of a discarded range free it?
      cudaEventRecord(a, s);
      for (int i = 0; i < nslab; ++i) CK(cudaMemPrefetchAsync(m[i], slab, hostloc, 0, s));
      cudaEventRecord(b, s); cudaEventSynchronize(b);
      printf("[round 0] prefetch-to-host of discarded: %.1f ms; free %.2f GiB\n", ms(), freemem() / 1073741824.0);
    }
    // page-in: discard+prefetch to device, then H2D from the mirror
    t0 = std::chrono::steady_clock::now();
    cudaEventRecord(a, s);
    CK(cudaMemDiscardAndPrefetchBatchAsync(m.data(), sz.data(), nslab, &devloc, &idx0, 1, 0, s));
    cudaEventRecord(c, s);
    for (int i = 0; i < nslab; ++i) CK(cudaMemcpyAsync(m[i], (char*)host + i * slab, slab, cudaMemcpyHostToDevice, s));
    cudaEventRecord(b, s); cudaEventSynchronize(b);
    host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    cudaEventElapsedTime(&cm, a, c);
    printf("[round %d] page-in: discard+prefetch dev %.1f ms, total %.1f ms (%.1f GB/s), host wall %.1f ms; free %.2f GiB\n",
           round, cm, ms(), total / ms() / 1e6, host_ms, freemem() / 1073741824.0);
    CK(cudaMemsetAsync(bad, 0, 8, s));
    for (int i = 0; i < nslab; ++i) check<<<1024, 256, 0, s>>>((const unsigned*)m[i], slab / 4, seed + i, bad);
    unsigned long long nb = 0; CK(cudaMemcpyAsync(&nb, bad, 8, cudaMemcpyDeviceToHost, s)); CK(cudaStreamSynchronize(s));
    printf("[round %d] mismatches after page-in: %llu\n", round, nb);
  }
  // the driver's path, for reference
  for (int i = 0; i < nslab; ++i) fill<<<1024, 256, 0, s>>>((unsigned*)m[i], slab / 4, 7 + i);
  CK(cudaStreamSynchronize(s));
  cudaEventRecord(a, s);
  for (int i = 0; i < nslab; ++i) CK(cudaMemPrefetchAsync(m[i], slab, hostloc, 0, s));
  cudaEventRecord(b, s); cudaEventSynchronize(b);
  printf("driver prefetch to host: %.1f ms (%.1f GB/s); free %.2f GiB\n", ms(), total / ms() / 1e6, freemem() / 1073741824.0);
  cudaEventRecord(a, s);
  for (int i = 0; i < nslab; ++i) CK(cudaMemPrefetchAsync(m[i], slab, devloc, 0, s));
  cudaEventRecord(b, s); cudaEventSynchronize(b);
  printf("driver prefetch to device: %.1f ms (%.1f GB/s)\n", ms(), total / ms() / 1e6);
  // duplex: D2H of half on s overlapping H2D of the other half on s2
  cudaEventRecord(a, s); cudaStreamWaitEvent(s2, a, 0);
  CK(cudaMemcpyAsync(host, dev, total / 2, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync((char*)dev + total / 2, (char*)host + total / 2, total / 2, cudaMemcpyHostToDevice, s2));
  cudaEvent_t d; cudaEventCreate(&d); cudaEventRecord(d, s2); cudaStreamWaitEvent(s, d, 0); cudaEventRecord(b, s); cudaEventSynchronize(b);
  printf("duplex: %.2f GiB each way in %.1f ms (%.1f GB/s each way)\n", total / 2 / 1073741824.0, ms(), total / 2 / ms() / 1e6);
  // zero-copy: a kernel reading and writing mapped pinned memory in place
  __attribute__((unused)) int dummy = 0;
  for (int rep = 0; rep < 2; ++rep) {
    cudaEventRecord(a, s);
    bump<<<2048, 256, 0, s>>>((unsigned*)host, total / 4 / 2);
    cudaEventRecord(b, s); cudaEventSynchronize(b); CK(cudaGetLastError());
    printf("zero-copy kernel read+write of %.2f GiB pinned: %.1f ms (%.1f GB/s each way)\n", total / 2 / 1073741824.0, ms(), total / 2 / ms() / 1e6);
  }
  printf("free at end %.2f GiB\n", freemem() / 1073741824.0);
  return 0;
}
