#pragma once
// The engine's 4-bit step kernel and its norm pass (csrc/cuda/quantized_step.cu launches them),
// generic over the algorithm (pagedopt/algorithms.h) and the parameter dtype. The states' layout is
// pagedopt/four_bit.h's: two codes a byte (element i in byte i / 2, low nibble for an even i), one
// absmax per 128-element block, a 16-entry codebook per state key.
//
// One warp per 128-element block, in a grid-stride walk over the blocks of the concatenated
// tensors (warp_block.cuh's for_each_warp_block). Lane l owns the block's elements
// [4 l, 4 l + 4): 2 code bytes per moment, which no other lane reads or writes. A full block of a
// tensor aligned for it reads its params and grads with one vector load each and its codes with
// one 2-byte load per moment; a tail block (or an unaligned tensor) reads element by element,
// skipping the elements at or past the tensor's end. Every lane reads the block's old absmaxes
// before the warp's reductions, and lane 0 writes the new ones after them, so nothing is written
// before it is read. The codebooks (16 floats per key) are in shared memory.
//
// The moments are dequantized as code * absmax and requantized as nearest_code4(code, x * (1 /
// absmax)) (pagedopt/codebook.h), both products rounded on their own (__fmul_rn: never contracted
// into a fused multiply-add), so the codes and absmaxes are the CPU's bit for bit.
#include <cstdint>
#include <type_traits>

#include "eight_bit_step_kernel.cuh"
#include "element_io.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/codebook.h"
#include "pagedopt/four_bit.h"
#include "warp_block.cuh"

namespace pagedopt {
namespace cuda_detail {

constexpr int kBlock4 = static_cast<int>(kStateBlockSize4);
static_assert(kBlock4 == 4 * kWarp, "one warp per 128-element block, 4 elements per lane");
constexpr int kFourBitThreads = 256;
constexpr int kFourBitWarps = kFourBitThreads / kWarp;

// Moment j's packed codes and absmax of tensor m (key_of(j), at stack index stack_of(j)).
template <typename Algo>
__device__ __forceinline__ uint8_t* moment_codes4(const TensorMeta& m, int j) {
  return static_cast<uint8_t*>(m.state[Algo::key_of(j)]) + Algo::stack_of(j) * packed_bytes(m.numel);
}
template <typename Algo>
__device__ __forceinline__ float* moment_absmax4(const TensorMeta& m, int j) {
  return m.absmax[Algo::key_of(j)] + Algo::stack_of(j) * ceil_div(m.numel, kStateBlockSize4);
}

// 4 consecutive elements [i0, i0 + 4) as floats: one vector load (`vec`: all 4 in the tensor,
// p + i0 aligned to 4 elements), else one at a time, 0 past the end n.
template <typename T>
__device__ __forceinline__ void load4(const T* p, int64_t i0, int64_t n, bool vec, float (&x)[4]) {
  if (vec) {
    if constexpr (std::is_same_v<T, float>) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(p + i0));
      x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
    } else {
      const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p + i0));
      const uint16_t h[4] = {static_cast<uint16_t>(v.x & 0xffffu), static_cast<uint16_t>(v.x >> 16),
                             static_cast<uint16_t>(v.y & 0xffffu), static_cast<uint16_t>(v.y >> 16)};
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = Elem<T>::load(reinterpret_cast<const T*>(&h[k]));
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = i0 + k < n ? Elem<T>::load(p + i0 + k) : 0.0f;
}

// The lane's 4 codes of one moment, code k in bits [4 k, 4 k + 4): one 2-byte load (`vec`), else
// the bytes that exist (a tail lane past the end reads nothing).
__device__ __forceinline__ uint32_t load_codes4(const uint8_t* codes, int64_t i0, int64_t n, bool vec) {
  const int64_t byte = i0 >> 1;
  if (vec) return *reinterpret_cast<const uint16_t*>(codes + byte);
  uint32_t w = 0;
  if (i0 < n) w = codes[byte];
  if (i0 + 2 < n) w |= static_cast<uint32_t>(codes[byte + 1]) << 8;
  return w;
}

// The lane's 4 codes (as load_codes4 packs them) into its bytes: the same bytes load_codes4 read.
__device__ __forceinline__ void store_codes4(uint8_t* codes, int64_t i0, int64_t n, bool vec, uint32_t w) {
  const int64_t byte = i0 >> 1;
  if (vec) {
    *reinterpret_cast<uint16_t*>(codes + byte) = static_cast<uint16_t>(w);
    return;
  }
  if (i0 < n) codes[byte] = static_cast<uint8_t>(w & 0xffu);
  if (i0 + 2 < n) codes[byte + 1] = static_cast<uint8_t>(w >> 8);
}

// Element k of the lane's moments, dequantized: code[q] * absmax, rounded once.
template <typename Algo>
__device__ __forceinline__ void dequantize4(const float (*s_code)[kCodebookSize4], const uint32_t (&w)[Algo::kMoments],
                                            const float (&absmax)[Algo::kMoments], int k,
                                            float (&s)[Algo::kMoments]) {
#pragma unroll
  for (int j = 0; j < Algo::kMoments; ++j) {
    s[j] = __fmul_rn(s_code[Algo::key_of(j)][(w[j] >> (4 * k)) & 0xFu], absmax[j]);
  }
}

template <int K>
__device__ __forceinline__ void load_codebooks4(float (&s_code)[K][kCodebookSize4], const float* const (&qmap)[kMaxKeys]) {
  for (int i = threadIdx.x; i < K * kCodebookSize4; i += blockDim.x) {
    s_code[i / kCodebookSize4][i % kCodebookSize4] = qmap[i / kCodebookSize4][i % kCodebookSize4];
  }
  __syncthreads();
}

template <typename Algo, typename T>
__global__ void __launch_bounds__(kFourBitThreads) four_bit_step_kernel(const StepArgs<Algo> args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // grid-uniform
  __shared__ float s_code[K][kCodebookSize4];
  load_codebooks4<K>(s_code, args.qmap);
  const int lane = threadIdx.x % kWarp;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  for_each_warp_block<kFourBitWarps>(args.total_blocks, [&](int64_t b, int64_t) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const auto& c = args.consts[t];
    const int64_t lb = b - args.starts[t];
    const int64_t n = m.numel;
    const int64_t i0 = lb * kBlock4 + lane * 4;
    const bool vec = m.vec_ok != 0 && (lb + 1) * kBlock4 <= n;  // warp-uniform
    T* p = static_cast<T*>(m.p);
    float pv[4];
    float gv[4];
    load4<T>(p, i0, n, vec, pv);
    load4<T>(static_cast<const T*>(m.g), i0, n, vec, gv);
    uint32_t w[M];
    float old_absmax[M];
    float mx[M];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      w[j] = load_codes4(moment_codes4<Algo>(m, j), i0, n, vec);
      old_absmax[j] = moment_absmax4<Algo>(m, j)[lb];
      mx[j] = 0.0f;
    }
    float s[4][M];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int j = 0; j < M; ++j) s[k][j] = 0.0f;
      if (i0 + k < n) {
        dequantize4<Algo>(s_code, w, old_absmax, k, s[k]);
        pv[k] = Algo::update(pv[k], gv[k] * inv_scale, s[k], c);
        const bool counts = element_counts_for_absmax<Algo>(s[k]);
#pragma unroll
        for (int j = 0; j < M; ++j) mx[j] = fmaxf(mx[j], counts ? fabsf(s[k][j]) : 0.0f);
      }
    }
    const ParamRounding rounding = param_rounding<T>(args, m, t);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i0 + k < n) store_param<T>(p + i0 + k, pv[k], rounding, i0 + k);  // this lane's elements only
    }
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const BlockScale scale = block_scale(mx[j]);  // every lane has read old_absmax before this
      mx[j] = scale.absmax;
      uint32_t q = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (i0 + k < n) q |= static_cast<uint32_t>(nearest_code4(s_code[Algo::key_of(j)], __fmul_rn(s[k][j], scale.inv)))
                             << (4 * k);
      }
      store_codes4(moment_codes4<Algo>(m, j), i0, n, vec, q);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < M; ++j) moment_absmax4<Algo>(m, j)[lb] = mx[j];
    }
  });
}

// The norm pass (quantized_update_norm_) on 4-bit states: each warp adds the squares of its
// block's update directions, in double, to its tensor's norm (one atomicAdd per block: the sum's
// rounding depends on the order of the blocks, so it may differ from the CPU's in the last bits).
template <typename Algo, typename T>
__global__ void __launch_bounds__(kFourBitThreads) four_bit_update_norm_kernel(const StepArgs<Algo> args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  __shared__ float s_code[K][kCodebookSize4];
  load_codebooks4<K>(s_code, args.qmap);
  const int lane = threadIdx.x % kWarp;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;
  for_each_warp_block<kFourBitWarps>(args.total_blocks, [&](int64_t b, int64_t) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const auto& c = args.consts[t];
    const int64_t lb = b - args.starts[t];
    const int64_t n = m.numel;
    const int64_t i0 = lb * kBlock4 + lane * 4;
    const T* p = static_cast<const T*>(m.p);
    const T* g = static_cast<const T*>(m.g);
    uint32_t w[M];
    float absmax[M];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      w[j] = load_codes4(moment_codes4<Algo>(m, j), i0, n, false);
      absmax[j] = moment_absmax4<Algo>(m, j)[lb];
    }
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i0 + k < n) {
        float s[M];
        dequantize4<Algo>(s_code, w, absmax, k, s);
        const double u = Algo::direction(Elem<T>::load(p + i0 + k), Elem<T>::load(g + i0 + k) * inv_scale, s, c);
        sum += u * u;
      }
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (lane == 0) atomicAdd(m.norm, sum);
  });
}

}  // namespace cuda_detail
}  // namespace pagedopt
