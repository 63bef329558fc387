#pragma once
// The nearest-code search of the 4-bit step kernel (four_bit_step_kernel.cuh): a fast, exact
// replacement for nearest_code4(code, s * inv) of pagedopt/codebook.h, with one 32-bit table entry
// per bucket of floats, as code_table.cuh does it for the 8-bit codebooks (its "Fast exact
// nearest-code search" explains the entry: entry = (lo << 24) + (2^24 - t), the code is the top
// byte of entry + the value's low key bits). Two differences:
//  * the value is taken as y = min(|s * inv|, 1), NaN -> 0 (one saturating multiply on the GPU:
//    mul.sat of |s| and inv >= 0) and its sign, the sign of s. The buckets cover every y in
//    [0, 1] (a bucket: the floats whose 8 exponent bits and top kSubBits4 mantissa bits agree,
//    y's bits >> kLowBits4), so no clamp from below is needed; y = 1 is the top bucket,
//    which must hold one code from 1 to infinity;
//  * 16 codes: kSubBits4 = 5 (a bucket is 1/32 of a binade) leaves room for a threshold per
//    bucket in any codebook whose thresholds are more than about 3% apart, relatively.
// It returns nearest_code4(code, x) for x = s * inv and every float s and every inv >= +0 (NaN, infinities,
// subnormals, -0 included), whenever the codebook fits the table (the 4-bit maps do: the signed and
// unsigned dynamic maps and the linear map without zero); for any other codebook the kernel uses
// nearest_code4 itself. NaN x: y = 0, its bucket 0 of either sign is the code of +-0, as
// nearest_code4 quantizes NaN.
//
// A codebook without negative codes whose code[1] > 0 (codebook4_unsigned: the maps of second
// moments) has code 0 for every x <= 0, the code of +0 (the search stays at index 0). Its search may then
// skip the sign: y = min(s * inv, 1) saturated as it comes (every x <= 0, NaN too, to +-0), whose
// -0 (bits 0x80000000) finds entry kMinusZero4, a copy of bucket 0's entry: two instructions less
// per value (table4_sum with neg = 0).
//
// The first half is plain host/device C++, so that tests/test_code_table4_host.py can compile it
// with g++ and check it against nearest_code4 over float bit patterns. The second half is CUDA only.
#include <cmath>
#include <cstdint>

#include "code_table.cuh"
#include "pagedopt/codebook.h"
#include "pagedopt/common.h"

namespace pagedopt {
namespace cuda_detail {

constexpr int kSubBits4 = 5;
constexpr int kLowBits4 = 23 - kSubBits4;                       // a bucket's low key bits
constexpr uint32_t kLowMask4 = (1u << kLowBits4) - 1u;
constexpr uint32_t kBucketTop4 = 0x3f800000u >> kLowBits4;      // the bucket of 1.0 (the top one)
constexpr uint32_t kNegOffset4 = 4096;                          // y of a negative x: entry kNegOffset4 + bucket
constexpr uint32_t kMinusZero4 = 2 * kNegOffset4;               // -0 of the search without sign: bits >> kLowBits4
constexpr uint32_t kBucketEntries4 = kMinusZero4 + 4;           // (padded to 16 bytes)
constexpr uint32_t kNoThreshold4 = 1u << kLowBits4;
static_assert(kBucketTop4 < kNegOffset4, "the two signs' entries do not overlap");
static_assert((0x80000000u >> kLowBits4) == kMinusZero4, "the bits of -0 find entry kMinusZero4");

// Global-memory image of one 16-entry codebook's table (the setup kernel builds it, the step kernel
// copies it into shared memory).
struct alignas(16) CodeTable4 {
  uint32_t entry[kBucketEntries4];
};

PAGEDOPT_HOST_DEVICE uint32_t code_rank4(const float* code, uint32_t key) {
  return nearest_code4(code, key_float(key));
}

// Finite and non-decreasing: the condition under which the table can be exact.
PAGEDOPT_HOST_DEVICE bool codebook4_entry_ok(const float* code, int i) {
  const bool finite = fabsf(code[i]) <= 3.40282347e38f;
  return finite && (i + 1 >= kCodebookSize4 || code[i] <= code[i + 1]);
}

// The first and last key of entry e's bucket; false for the padding entries past the top bucket
// (kMinusZero4 included).
PAGEDOPT_HOST_DEVICE bool bucket4_keys(uint32_t e, uint32_t& first, uint32_t& last) {
  if (e >= kMinusZero4) return false;
  const bool neg = e >= kNegOffset4;
  const uint32_t b = neg ? e - kNegOffset4 : e;
  if (b > kBucketTop4) return false;
  const uint32_t a0 = b << kLowBits4;
  const uint32_t a1 = b == kBucketTop4 ? 0x7f800000u : ((b + 1) << kLowBits4) - 1u;  // the top one: up to inf
  if (neg) {
    first = float_key(bits_f32(a1 | 0x80000000u));
    last = float_key(bits_f32(a0 | 0x80000000u));
  } else {
    first = float_key(bits_f32(a0));
    last = float_key(bits_f32(a1));
  }
  return true;
}

// Entry e of the table of a finite, non-decreasing 16-entry codebook (kBadEntry if it does not
// fit; 0 for the padding entries, which no value reaches; kMinusZero4: bucket 0's entry).
PAGEDOPT_HOST_DEVICE uint32_t bucket4_entry(const float* code, uint32_t e) {
  if (e == kMinusZero4) e = 0;
  uint32_t first;
  uint32_t last;
  if (!bucket4_keys(e, first, last)) return 0;
  const uint32_t lo = code_rank4(code, first);
  const uint32_t hi = code_rank4(code, last);
  uint32_t threshold = kNoThreshold4;
  if (hi != lo) {
    const bool middle = (first >> kLowBits4) == (last >> kLowBits4);
    if (hi != lo + 1 || !middle) return kBadEntry;
    uint32_t below = first;  // code_rank4(below) == lo
    uint32_t at = last;      // code_rank4(at) == hi
    while (at - below > 1) {
      const uint32_t mid = below + (at - below) / 2;
      if (code_rank4(code, mid) >= hi) {
        at = mid;
      } else {
        below = mid;
      }
    }
    threshold = at & kLowMask4;  // >= 1: the bucket's first key has code lo
  }
  return (lo << 24) + (0x1000000u - threshold);
}

// min(|x|, 1), NaN -> +0: what the GPU's saturating multiply gives for |s| * inv (inv >= +0).
PAGEDOPT_HOST_DEVICE float saturate_abs(float x) {
  const float a = fabsf(x);
  return a < 1.0f ? a : (a >= 1.0f ? 1.0f : 0.0f);  // NaN fails both comparisons
}

// The code of y = saturate_abs(x), x of sign `neg` (all ones when negative, else 0), in the top
// byte of the sum (the kernel packs the top bytes of eight): table entry + y's low key bits.
// `entry(i)` reads entry i of the table (host memory here, shared memory in the kernel).
template <typename Entry>
PAGEDOPT_HOST_DEVICE uint32_t table4_sum(Entry&& entry, float y, uint32_t neg) {
  const uint32_t u = f32_bits(y);
  return entry((u >> kLowBits4) | (neg & kNegOffset4)) + ((u ^ neg) & kLowMask4);
}

// nearest_code4(code, s * inv) (inv >= +0) from a table whose entries are all valid: the host form
// of what the kernel does (the product rounded once, as the kernel's saturating multiply does it).
PAGEDOPT_HOST_DEVICE uint32_t fast_nearest_code4(const uint32_t* table, float s, float inv) {
  const float x = s * inv;
  return table4_sum([table](uint32_t i) { return table[i]; }, saturate_abs(x), sign_mask(s)) >> 24;
}

// Whether a (sorted) codebook may take the search without sign: no negative code, and +0's code is
// 0 (not so when code[1] is 0 too: the search takes the last of equal codes, x < 0 the first).
PAGEDOPT_HOST_DEVICE bool codebook4_unsigned(const float* code) { return code[0] >= 0.0f && code[1] > 0.0f; }

// min(x, 1), NaN and every x <= 0 to a zero: -0 when `minus_zero`, else +0 (the GPU's saturating
// multiply gives one of the two; the search takes both).
PAGEDOPT_HOST_DEVICE float saturate(float x, bool minus_zero) {
  const float zero = minus_zero ? -0.0f : 0.0f;
  return x > 0.0f ? (x < 1.0f ? x : 1.0f) : zero;  // NaN fails x > 0
}

// The search without sign, for a codebook4_unsigned codebook: the host form of the kernel's.
PAGEDOPT_HOST_DEVICE uint32_t fast_nearest_code4_unsigned(const uint32_t* table, float s, float inv,
                                                          bool minus_zero) {
  return table4_sum([table](uint32_t i) { return table[i]; }, saturate(s * inv, minus_zero), 0u) >> 24;
}

}  // namespace cuda_detail
}  // namespace pagedopt

#if defined(__CUDACC__)
namespace pagedopt {
namespace cuda_detail {

// min(|s| * inv, 1) rounded once, NaN -> +0 (inv >= +0): saturate_abs(s * inv) in one instruction.
__device__ __forceinline__ float mul_sat_abs(float s, float inv) {
  float y;
  asm("mul.rn.sat.f32 %0, %1, %2;" : "=f"(y) : "f"(fabsf(s)), "f"(inv));
  return y;
}

// min(s * inv, 1) rounded once, NaN and every product <= 0 to +0 or -0: saturate(s * inv, either).
__device__ __forceinline__ float mul_sat(float s, float inv) {
  float y;
  asm("mul.rn.sat.f32 %0, %1, %2;" : "=f"(y) : "f"(s), "f"(inv));
  return y;
}

// Building a table: one thread per entry, kTable4Blocks blocks of kTableThreads threads per codebook
// (the setup kernel of csrc/cuda/quantized_step.cu runs them, beside the 8-bit tables' blocks).
constexpr int kTable4Blocks = static_cast<int>((kBucketEntries4 + kTableThreads - 1) / kTableThreads);

__device__ __forceinline__ void build_code_table4_block(const float* __restrict__ code, CodeTable4* __restrict__ out,
                                                        int block) {
  build_table_block<kCodebookSize4, kBucketEntries4>(
      code, out->entry, block, [](const float* c, int i) { return codebook4_entry_ok(c, i); },
      [](const float* c, uint32_t e) { return bucket4_entry(c, e); });
}

}  // namespace cuda_detail
}  // namespace pagedopt
#endif  // __CUDACC__
