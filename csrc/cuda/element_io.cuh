#pragma once
// What the lanes of the CUDA kernels read and write (csrc/cuda/quantize.cu, the engine's kernels
// csrc/cuda/quantized_step.cu and csrc/cuda/eight_bit_step_kernel.cuh): float32, bfloat16 and
// float16 elements one at a time or 8 at once (Elem<T>), the bytes of 8 packed codes and L2
// prefetch hints. CUDA only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "pagedopt/stochastic_round.h"

namespace pagedopt {
namespace cuda_detail {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Element conversions. Loads are exact; stores round to nearest even (as c10's conversions do).
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Elem;

// Vector accesses go through __ldcs / __stcs: global-space, streaming (each byte is touched once).
template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float x) { *p = x; }
  // 8 consecutive elements, 32-byte aligned.
  static __device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
    const float4 b = __ldcs(reinterpret_cast<const float4*>(p + 4));
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
  static __device__ __forceinline__ void store8(float* p, const float (&x)[8]) {
    __stcs(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
    __stcs(reinterpret_cast<float4*>(p + 4), make_float4(x[4], x[5], x[6], x[7]));
  }
};

__device__ __forceinline__ float bf16_bits_to_float(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ uint32_t float_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float half_bits_to_float(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}
__device__ __forceinline__ uint32_t float_to_half_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

template <typename T, float (*ToFloat)(uint32_t), uint32_t (*FromFloat)(float)>
struct Elem16 {
  static __device__ __forceinline__ float load(const T* p) {
    return ToFloat(*reinterpret_cast<const uint16_t*>(p));
  }
  static __device__ __forceinline__ void store(T* p, float x) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(FromFloat(x));
  }
  // 8 consecutive elements, 16-byte aligned.
  static __device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
    const uint4 r = __ldcs(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = ToFloat(w[k] & 0xffffu);
      x[2 * k + 1] = ToFloat(w[k] >> 16);
    }
  }
  static __device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = FromFloat(x[2 * k]) | (FromFloat(x[2 * k + 1]) << 16);
    __stcs(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  }
};

template <>
struct Elem<c10::BFloat16> : Elem16<c10::BFloat16, bf16_bits_to_float, float_to_bf16_bits> {};
template <>
struct Elem<c10::Half> : Elem16<c10::Half, half_bits_to_float, float_to_half_bits> {};

// ---------------------------------------------------------------------------------------------
// Parameter stores of the optimizer kernels: a bf16 parameter of a tensor with a stream
// (bf16_stochastic_round) is rounded stochastically (pagedopt/stochastic_round.h) with the random
// bits of its index in the whole parameter; every other store rounds to nearest (Elem<T>).
// ---------------------------------------------------------------------------------------------
struct ParamRounding {
  const uint64_t* stream;  // the tensor's stream at this step, or nullptr: round to nearest
  int64_t offset;          // the index of the tensor's first element in its parameter
};

// Element i of the tensor.
template <typename T>
__device__ __forceinline__ void store_param(T* p, float x, const ParamRounding& r, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (r.stream != nullptr) {
      *reinterpret_cast<uint16_t*>(p) =
          round_bf16_stochastic(x, sr_bits(*r.stream, static_cast<uint64_t>(r.offset + i)));
      return;
    }
  }
  Elem<T>::store(p, x);
}

// Elements i .. i + 7 of the tensor, as Elem<T>::store8: two hashes of four elements each when
// the first one's index in the parameter is a multiple of 4 (always, but for a DTensor shard
// starting elsewhere), else one per element.
template <typename T>
__device__ __forceinline__ void store8_param(T* p, const float (&x)[8], const ParamRounding& r, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (r.stream != nullptr) {
      const uint64_t stream = *r.stream;
      const uint64_t first = static_cast<uint64_t>(r.offset + i);
      uint32_t w[4];
      if ((first & 3) == 0) {
        const uint64_t h[2] = {sr_bits4(stream, first >> 2), sr_bits4(stream, (first >> 2) + 1)};
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // elements 2k, 2k + 1: fields 2 (k % 2), 2 (k % 2) + 1 of hash k / 2
          const uint64_t bits = h[k / 2] >> (32 * (k % 2));
          w[k] = static_cast<uint32_t>(round_bf16_stochastic(x[2 * k], static_cast<uint32_t>(bits) & 0xffffu)) |
                 (static_cast<uint32_t>(round_bf16_stochastic(x[2 * k + 1], static_cast<uint32_t>(bits >> 16) & 0xffffu))
                  << 16);
        }
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          w[k] = static_cast<uint32_t>(round_bf16_stochastic(x[2 * k], sr_bits(stream, first + 2 * k))) |
                 (static_cast<uint32_t>(round_bf16_stochastic(x[2 * k + 1], sr_bits(stream, first + 2 * k + 1))) << 16);
        }
      }
      __stcs(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
      return;
    }
  }
  Elem<T>::store8(p, x);
}

__device__ __forceinline__ uint32_t byte_of(uint2 w, int k) {
  return __byte_perm(k < 4 ? w.x : w.y, 0u, 0x4440u | static_cast<uint32_t>(k & 3));
}

// Asks for the cache line holding p to be brought into L2 (a hint: no registers, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

}  // namespace cuda_detail
}  // namespace pagedopt
