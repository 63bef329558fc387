#pragma once
// Nearest-code search in a sorted 256-entry (8-bit) or 16-entry (4-bit) codebook, and dequantization.
// One definition for CPU and CUDA so both backends produce identical codes.
#include <cmath>

#include "pagedopt/common.h"

namespace pagedopt {

// Index of the codebook entry nearest to `x` in value, ties going to the lower index
// (the same answer as argmin(|code - x|)); NaN is quantized as 0.0. `code` must be sorted
// ascending. Infinities saturate: +inf gets the last (largest) code, -inf the first (smallest):
// -0.993 (the code nearest -1.0) for the signed dynamic map, 0.0 for the unsigned one.
// kSize (a power of two): the codebook's number of entries.
template <int kSize>
PAGEDOPT_HOST_DEVICE uint8_t nearest_code_of(const float* code, float x) {
  static_assert(kSize >= 2 && (kSize & (kSize - 1)) == 0, "a power-of-two codebook");
  if (x != x) x = 0.0f;
  int idx = 0;
PAGEDOPT_UNROLL
  for (int step = kSize / 2; step > 0; step >>= 1) {
    if (code[idx + step] <= x) idx += step;
  }
  // code[idx] <= x < code[idx + 1], except at the two ends of the codebook.
  const int upper = idx + 1 < kSize ? idx + 1 : idx;
  const float d_lower = fabsf(x - code[idx]);
  const float d_upper = fabsf(code[upper] - x);
  return static_cast<uint8_t>(d_upper < d_lower ? upper : idx);
}

PAGEDOPT_HOST_DEVICE uint8_t nearest_code(const float* code, float x) { return nearest_code_of<kCodebookSize>(code, x); }

// The 4-bit search (16 entries): the one function of the CPU and CUDA 4-bit kernels.
PAGEDOPT_HOST_DEVICE uint8_t nearest_code4(const float* code, float x) {
  return nearest_code_of<kCodebookSize4>(code, x);
}

// A block's absmax is the largest finite_abs of its values: NaN and +-inf do not count, so one
// non-finite value cannot make every other value of its block dequantize to NaN or inf (it is
// stored saturated instead: x * (1 / absmax) stays +-inf, which nearest_code maps to an end of the
// codebook, and NaN goes to the code of 0.0). One compare and select per value.
PAGEDOPT_HOST_DEVICE float finite_abs(float x) {
  const float a = fabsf(x);
  return a <= 3.40282347e38f ? a : 0.0f;  // false for NaN and inf
}

// A block's values are normalized as x * absmax_reciprocal(absmax): one correctly rounded reciprocal
// per block, then a multiplication per value (within one ulp of x / absmax). A block whose absmax
// is zero, or below the smallest normal float (every finite value under 1.2e-38), normalizes to
// zero (and its infinities to NaN, so every value of such a block gets the code of 0.0).
PAGEDOPT_HOST_DEVICE float absmax_reciprocal(float absmax) {
  return absmax >= 1.17549435e-38f ? 1.0f / absmax : 0.0f;
}

PAGEDOPT_HOST_DEVICE uint8_t quantize_value(const float* code, float x, float inv_absmax) {
  return nearest_code(code, x * inv_absmax);
}

PAGEDOPT_HOST_DEVICE uint8_t quantize_value4(const float* code, float x, float inv_absmax) {
  return nearest_code4(code, x * inv_absmax);
}

PAGEDOPT_HOST_DEVICE float dequantize_value(const float* code, uint8_t q, float absmax) {
  return code[q] * absmax;
}

}  // namespace pagedopt
