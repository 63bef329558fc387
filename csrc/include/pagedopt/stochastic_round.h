#pragma once
// Stochastic rounding of the optimizers' fp32 parameter updates to bfloat16
// (bf16_stochastic_round=True), shared by the CPU and CUDA kernels, which therefore store the same
// bits for the same fp32 value.
//
// Rounding (round_bf16_stochastic). A float's bit pattern u is [sign | exponent | 7 high mantissa
// bits | 16 low bits f]; its two bf16 neighbours are u >> 16 (toward zero) and (u >> 16) + 1 (away
// from zero, the next magnitude: bit patterns of one sign order like magnitudes, across binades and
// subnormals). Adding 16 uniform random bits r in [0, 2^16) to u and dropping the low 16 bits
// carries into bit 16 exactly when r >= 2^16 - f: the value rounds away from zero with probability
// f / 2^16, its distance from the lower neighbour over the gap, so E[rounded] = x (unbiased). An
// exact bf16 value (f = 0) never moves.
// Special values, so that rounding never makes a parameter non-finite nor a NaN finite:
//  * +-inf stay +-inf; NaN stays NaN, its sign and high payload kept, the quiet bit set (a NaN
//    whose payload is only in the low 16 bits would otherwise truncate to inf);
//  * a finite |x| above the largest finite bf16 (0x7F7F0000, 3.3895e38) becomes that largest
//    bf16, with its sign (round to nearest would give inf from 3.3961e38 on): saturation, the one
//    place where the rounding is biased, and only beyond bf16's range.
//
// Random bits (sr_bits). A counter-based hash, so that any element's bits are a function of
// (seed, id, step, index) alone, whichever chunk, piece, thread or device computes them:
//  * key    = sr_key(seed, id): one per parameter (id: its position among the optimizer's
//             parameters, pagedopt/optim/plan.py), computed on the host;
//  * stream = sr_stream(key, step): one per parameter and step count (the already incremented
//             float32 step counter of the parameter's state, read where the kernel runs);
//  * bits   = 16 bits of mix64(stream + (index / 4 + 1) * golden): one 64-bit hash serves four
//             consecutive elements (index: the element's position in the whole parameter, its
//             piece's offset plus its position in the piece).
// mix64 is SplitMix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", 2014), a bijection of 64-bit integers; stream + k * golden for k = 1, 2, ... is
// SplitMix64's own output sequence from state `stream`, so the 16-bit fields are uniform and
// independent as far as BigCrush can tell. Only integer operations: CPU and CUDA agree bit for bit.
#include <cstdint>
#include <cstring>

#include "pagedopt/common.h"

namespace pagedopt {

constexpr uint64_t kSrGolden = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd

PAGEDOPT_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One parameter's key: its optimizer's seed and its id.
PAGEDOPT_HOST_DEVICE uint64_t sr_key(uint64_t seed, uint64_t id) { return mix64(mix64(seed + kSrGolden) + id); }

// The parameter's stream at step count `step` (a float32 counter holding an integer >= 0).
PAGEDOPT_HOST_DEVICE uint64_t sr_stream(uint64_t key, float step) {
  const uint64_t t = step > 0.0f ? static_cast<uint64_t>(step) : 0;
  return mix64(key + t * kSrGolden);
}

// The 64 random bits of elements 4 q .. 4 q + 3: element 4 q + k takes bits [16 k, 16 k + 16).
PAGEDOPT_HOST_DEVICE uint64_t sr_bits4(uint64_t stream, uint64_t q) { return mix64(stream + (q + 1) * kSrGolden); }

// The 16 random bits of element `index` of the parameter.
PAGEDOPT_HOST_DEVICE uint32_t sr_bits(uint64_t stream, uint64_t index) {
  return static_cast<uint32_t>(sr_bits4(stream, index >> 2) >> ((index & 3) * 16)) & 0xffffu;
}

PAGEDOPT_HOST_DEVICE uint32_t sr_float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// x rounded to bfloat16 with the random bits r (< 2^16): the bf16 bit pattern (see the top).
PAGEDOPT_HOST_DEVICE uint16_t round_bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = sr_float_bits(x);
  const uint32_t mag = u & 0x7fffffffu;
  const uint32_t sign = u & 0x80000000u;
  if (mag > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);                // NaN
  if (mag == 0x7f800000u) return static_cast<uint16_t>(u >> 16);                           // +-inf
  if (mag > 0x7f7f0000u) return static_cast<uint16_t>((sign | 0x7f7f0000u) >> 16);         // beyond bf16: saturate
  return static_cast<uint16_t>((u + r) >> 16);  // mag + r <= 0x7f7fffff: the carry stays below the exponent's top
}

}  // namespace pagedopt
