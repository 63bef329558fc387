#pragma once
// The engine's 8-bit step kernel (csrc/cuda/quantized_step.cu launches it), generic over the
// algorithm (pagedopt/algorithms.h: its update(), its moments and state keys) and the parameter
// dtype, with the metadata the engine's kernels share.
//
// The block loop is warp_block.cuh's (one warp per 256-element block, its two lane layouts, the
// block's absmax and codes); what is this kernel's own is below.
//
// One block of 1024 (or 768) threads per SM. Warp w of the grid owns the contiguous run of global 256-element
// blocks [w * chunk, (w + 1) * chunk) over the concatenated tensors: it finds its first tensor by
// a warp-wide search of the block-count prefix sums, then walks on, asking L2 for its next block's
// lines while it works on the current one.
//  * A full block whose pointers allow vector access: lane l owns elements [8 l, 8 l + 8): vector
//    loads of params, grads and each moment's 8 codes, the moments dequantized from this lane's
//    copy of the replicated codebook, update(), the block's new absmax of each moment by one warp
//    reduction, then 8 codes per moment from the codebook's search table in one 8-byte store.
//  * A tail block, or a tensor not aligned for vector access: element lo + k * 32 + lane, in two
//    passes over the inputs (the first finds the new absmaxes, the second recomputes the
//    deterministic update and writes everything), so nothing is written before it is read.
// An element counts toward its block's absmaxes only if all its new moments are finite
// (counts_for_absmax, as on the CPU).
#include <cstdint>
#include <type_traits>

#include "code_table.cuh"
#include "element_io.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/codebook.h"
#include "pagedopt/optimizer_hyper.h"
#include "warp_block.cuh"

namespace pagedopt {
namespace cuda_detail {

constexpr int kMaxKeys = 2;  // state tensors per parameter (a key may hold two stacked moments)

struct CodeTable4;  // the 4-bit step's search tables (code_table4.cuh)

// One entry per non-empty tensor, filled on the host.
struct TensorMeta {
  void* p;
  const void* g;
  void* state[kMaxKeys];
  float* absmax[kMaxKeys];
  const float* step;
  const float* scale;  // the tensor's update scale (lars, lamb), or nullptr
  double* norm;        // the norm pass's output for the tensor, or nullptr
  int64_t numel;
  int64_t vec_ok;     // p, g 16-byte aligned and every moment's codes 8-byte (4-bit: 4-byte) aligned
  uint64_t sr_key;    // stochastic rounding: sr_key(seed, id) (pagedopt/stochastic_round.h)
  int64_t sr_offset;  // and the index of the tensor's first element in its parameter
};

template <typename Algo>
struct StepArgs {
  const TensorMeta* meta;                  // this dtype group's tensors (all of them in the setup kernel)
  const typename Algo::Constants* consts;  // parallel to meta
  const int64_t* starts;                   // ntensors + 1 prefix sums of block counts
  int ntensors;
  int64_t total_blocks;
  const float* qmap[kMaxKeys];
  CodeTable* tables;        // [kKeys], 8-bit steps (written by the setup kernel)
  CodeTable4* tables4;      // [kKeys], 4-bit steps (likewise)
  const float* grad_scale;  // nullptr when absent
  const float* found_inf;   // nullptr when absent
  OptimizerHyper hyper;
  const float* lr_f32;      // the learning rate in place of hyper.v[0] (capturable steps), or nullptr
  const double* lr_f64;     // likewise, a float64 lr tensor
  const uint64_t* sr_streams;  // parallel to meta: each tensor's stream (setup kernel), or nullptr: no
                               // stochastic rounding in this call
};

// Tensor t's parameter rounding: stochastic for bf16 parameters of a call with streams.
template <typename T, typename Algo>
__device__ __forceinline__ ParamRounding param_rounding(const StepArgs<Algo>& args, const TensorMeta& m, int t) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (args.sr_streams != nullptr) return ParamRounding{args.sr_streams + t, m.sr_offset};
  }
  return ParamRounding{nullptr, 0};
}

// 1024 threads of 64 registers; an algorithm with three moments holds 24 of them per lane and
// gets 768 threads of 85 registers instead (with 64 it spills about 100 bytes a thread).
template <typename Algo>
constexpr int engine_threads() {
  return Algo::kMoments > 2 ? 768 : 1024;
}

// Shared memory: [K replicated codebooks: rep[q * 32 + lane] == code[q]][K codebooks + tables].
constexpr size_t kRepBytes = size_t{kCodebookSize} * kWarp * sizeof(float);
template <int K>
constexpr size_t eight_bit_smem_bytes() {
  return K * (kRepBytes + kSmemCodeBytes);
}

template <int K>
struct SmemView {
  uint32_t rep[K];  // shared address of this lane's column of each replicated codebook: + (q << 7)
  SmemCode code[K];
};

// The tensor owning global block `gb`: the last t with starts[t] <= gb (32-way search by a warp).
__device__ __forceinline__ int find_tensor(const int64_t* __restrict__ starts, int n, int64_t gb, int lane) {
  int lo = 0;
  int hi = n;  // starts[lo] <= gb < starts[hi]
  while (hi - lo > 1) {
    const int stride = (hi - lo + kWarp - 1) / kWarp;
    const int idx = lo + lane * stride;
    const bool le = idx < hi && starts[idx] <= gb;
    const unsigned ball = __ballot_sync(kFullMask, le);  // lane 0 is always set
    const int last = kWarp - 1 - __clz(ball);
    lo += last * stride;
    hi = min(hi, lo + stride);
  }
  return lo;
}

// The tensor owning global block gb: the last t with starts[t] <= gb (one thread's binary search;
// the plain kernels and the 4-bit ones).
__device__ __forceinline__ int owner_of(const int64_t* __restrict__ starts, int n, int64_t gb) {
  int lo = 0;
  int hi = n;  // starts[lo] <= gb < starts[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (starts[mid] <= gb) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Moment j's codes and absmax of tensor m (key_of(j), at stack index stack_of(j)).
template <typename Algo>
__device__ __forceinline__ uint8_t* moment_codes(const TensorMeta& m, int j) {
  return static_cast<uint8_t*>(m.state[Algo::key_of(j)]) + Algo::stack_of(j) * m.numel;
}
template <typename Algo>
__device__ __forceinline__ float* moment_absmax(const TensorMeta& m, int j) {
  return m.absmax[Algo::key_of(j)] + Algo::stack_of(j) * ceil_div(m.numel, kStateBlockSize);
}

// The lanes ask L2 for block lb's params, grads and codes, one 128-byte line each, so that the
// warp's loads of them (after it has finished the current block) hit L2 instead of waiting for HBM.
template <typename Algo, typename T>
__device__ __forceinline__ void prefetch_block(const TensorMeta& m, int64_t lb, int lane) {
  constexpr int kLine = 128;
  constexpr int kParamLines = kBlock * static_cast<int>(sizeof(T)) / kLine;
  constexpr int kCodeLines = kBlock / kLine;
  static_assert(2 * kParamLines + Algo::kMoments * kCodeLines <= kWarp, "one line per lane");
  const int64_t i0 = lb * kBlock;
  int line = lane;
  const char* base;
  if (line < kParamLines) {
    base = reinterpret_cast<const char*>(static_cast<const T*>(m.p) + i0);
  } else if ((line -= kParamLines) < kParamLines) {
    base = reinterpret_cast<const char*>(static_cast<const T*>(m.g) + i0);
  } else if ((line -= kParamLines) < Algo::kMoments * kCodeLines) {
    base = reinterpret_cast<const char*>(moment_codes<Algo>(m, line / kCodeLines) + i0);
    line %= kCodeLines;
  } else {
    return;
  }
  prefetch_l2(base + line * kLine);
}

// One element: its moments dequantized (this lane's copy of each codebook), then update().
template <typename Algo>
__device__ __forceinline__ float element_update(float p, float g, float (&s)[Algo::kMoments],
                                                const uint32_t (&q)[Algo::kMoments],
                                                const float (&absmax)[Algo::kMoments],
                                                const SmemView<Algo::kKeys>& sm, const typename Algo::Constants& c) {
#pragma unroll
  for (int j = 0; j < Algo::kMoments; ++j) s[j] = lds_f32(sm.rep[Algo::key_of(j)] + (q[j] << 7)) * absmax[j];
  return Algo::update(p, g, s, c);
}

// A full, aligned block: the vector layout, lane owns elements [8 lane, 8 lane + 8).
template <typename Algo, typename T, bool kFast>
__device__ __forceinline__ void full_block(const TensorMeta& m, const typename Algo::Constants& c, int64_t lb,
                                           int lane, const SmemView<Algo::kKeys>& sm, float inv_scale,
                                           const ParamRounding& rounding) {
  constexpr int M = Algo::kMoments;
  const int64_t i0 = lb * kBlock + lane * 8;
  T* p = static_cast<T*>(m.p) + i0;
  float pv[8];
  float gv[8];
  Elem<T>::load8(p, pv);
  Elem<T>::load8(static_cast<const T*>(m.g) + i0, gv);
  uint2 w[M];
  float old_absmax[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    w[j] = __ldcs(reinterpret_cast<const uint2*>(moment_codes<Algo>(m, j) + i0));
    old_absmax[j] = moment_absmax<Algo>(m, j)[lb];
  }
  float s[8][M];
  float mx[M];
#pragma unroll
  for (int j = 0; j < M; ++j) mx[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    uint32_t q[M];
#pragma unroll
    for (int j = 0; j < M; ++j) q[j] = byte_of(w[j], k);
    pv[k] = element_update<Algo>(pv[k], gv[k] * inv_scale, s[k], q, old_absmax, sm, c);
    const bool counts = element_counts_for_absmax<Algo>(s[k]);
#pragma unroll
    for (int j = 0; j < M; ++j) mx[j] = fmaxf(mx[j], counts ? fabsf(s[k][j]) : 0.0f);
  }
  store8_param<T>(p, pv, rounding, i0);
#pragma unroll
  for (int j = 0; j < M; ++j) {
    // block_scale's two steps apart: the reciprocal taken where the codes are (taken before the
    // gather of col, it moves code enough for LAMB's half-precision kernels to spill)
    mx[j] = warp_max_nonneg(mx[j]);  // every lane has read old_absmax before this
    float col[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) col[k] = s[k][j];
    store_codes8<kFast>(moment_codes<Algo>(m, j) + i0, sm.code[Algo::key_of(j)], col, absmax_reciprocal(mx[j]));
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < M; ++j) moment_absmax<Algo>(m, j)[lb] = mx[j];
  }
}

// A tail block, or any block of a tensor not aligned for vector access: the strided layout, in two
// passes (see the top).
template <typename Algo, typename T, bool kFast>
__device__ __forceinline__ void partial_block(const TensorMeta& m, const typename Algo::Constants& c, int64_t lb,
                                              int lane, const SmemView<Algo::kKeys>& sm, float inv_scale,
                                              const ParamRounding& rounding) {
  constexpr int M = Algo::kMoments;
  const int64_t lo = lb * kBlock;
  T* p = static_cast<T*>(m.p);
  const T* g = static_cast<const T*>(m.g);
  float old_absmax[M];
  float mx[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    old_absmax[j] = moment_absmax<Algo>(m, j)[lb];
    mx[j] = 0.0f;
  }
  for_each_strided_element<1>(lo, m.numel, lane, [&](int, int64_t i) {
    uint32_t q[M];
#pragma unroll
    for (int j = 0; j < M; ++j) q[j] = moment_codes<Algo>(m, j)[i];
    float s[M];
    element_update<Algo>(Elem<T>::load(p + i), Elem<T>::load(g + i) * inv_scale, s, q, old_absmax, sm, c);
    const bool counts = element_counts_for_absmax<Algo>(s);
#pragma unroll
    for (int j = 0; j < M; ++j) mx[j] = fmaxf(mx[j], counts ? fabsf(s[j]) : 0.0f);
  });
  float inv[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const BlockScale scale = block_scale(mx[j]);
    mx[j] = scale.absmax;
    inv[j] = scale.inv;
  }
  for_each_strided_element<1>(lo, m.numel, lane, [&](int, int64_t i) {
    uint32_t q[M];
#pragma unroll
    for (int j = 0; j < M; ++j) q[j] = moment_codes<Algo>(m, j)[i];
    float s[M];
    const float pn =
        element_update<Algo>(Elem<T>::load(p + i), Elem<T>::load(g + i) * inv_scale, s, q, old_absmax, sm, c);
    store_param<T>(p + i, pn, rounding, i);  // element i is read and written by this lane only
#pragma unroll
    for (int j = 0; j < M; ++j) moment_codes<Algo>(m, j)[i] = code_of<kFast>(sm.code[Algo::key_of(j)], s[j], inv[j]);
  });
  __syncwarp();
  if (lane == 0) {  // every lane has read old_absmax (first lines) before the reductions above
#pragma unroll
    for (int j = 0; j < M; ++j) moment_absmax<Algo>(m, j)[lb] = mx[j];
  }
}

template <typename Algo, typename T, bool kFast>
__device__ __forceinline__ void warp_loop(const StepArgs<Algo>& args, const SmemView<Algo::kKeys>& sm) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int warps = gridDim.x * (blockDim.x / kWarp);
  const int64_t chunk = ceil_div(args.total_blocks, static_cast<int64_t>(warps));
  const int64_t first = warp * chunk;
  if (first >= args.total_blocks) return;
  int b = static_cast<int>(first);  // < total_blocks < 2^31
  const int end = static_cast<int>(min(args.total_blocks, first + chunk));
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  int t = find_tensor(args.starts, args.ntensors, b, lane);
  int t_begin = static_cast<int>(args.starts[t]);
  int t_end = static_cast<int>(args.starts[t + 1]);
  for (; b < end; ++b) {
    if (b >= t_end) {  // tensors have at least one block, so one step suffices
      ++t;
      t_begin = t_end;
      t_end = static_cast<int>(args.starts[t + 1]);
    }
    const TensorMeta& m = args.meta[t];
    const int64_t lb = b - t_begin;
    if ((lb + 2) * kBlock <= m.numel && b + 1 < end) prefetch_block<Algo, T>(m, lb + 1, lane);  // the next block
    const ParamRounding rounding = param_rounding<T>(args, m, t);
    if (m.vec_ok != 0 && (lb + 1) * kBlock <= m.numel) {
      full_block<Algo, T, kFast>(m, args.consts[t], lb, lane, sm, inv_scale, rounding);
    } else {
      partial_block<Algo, T, kFast>(m, args.consts[t], lb, lane, sm, inv_scale, rounding);
    }
  }
}

template <typename Algo, typename T>
__global__ void __launch_bounds__(engine_threads<Algo>(), 1) eight_bit_step_kernel(const StepArgs<Algo> args) {
  constexpr int K = Algo::kKeys;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // grid-uniform
  extern __shared__ __align__(16) unsigned char smem[];
  float* rep = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < K * kCodebookSize * kWarp; i += blockDim.x) {
    const int key = i / (kCodebookSize * kWarp);
    rep[i] = args.qmap[key][(i % (kCodebookSize * kWarp)) / kWarp];
  }
  unsigned char* codes = smem + K * kRepBytes;
  bool fast = true;
  const int lane = threadIdx.x % kWarp;
  SmemView<K> sm;
#pragma unroll
  for (int key = 0; key < K; ++key) {
    fast = load_smem_code(codes + key * kSmemCodeBytes, args.qmap[key], args.tables + key) && fast;
    sm.rep[key] = smem_addr(rep + key * kCodebookSize * kWarp + lane);
    sm.code[key] = smem_code_view(codes + key * kSmemCodeBytes);
  }
  if (fast) {
    warp_loop<Algo, T, true>(args, sm);
  } else {
    warp_loop<Algo, T, false>(args, sm);
  }
}

}  // namespace cuda_detail
}  // namespace pagedopt
