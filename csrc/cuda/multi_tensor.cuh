#pragma once
// Helpers shared by csrc/cuda/quantize.cu and csrc/cuda/adam8bit.cu.
//
// The first half (up to the `__CUDACC__` section) is plain host/device C++ so that a host test
// can compile it with g++ and check it against the reference functions of pagedopt/codebook.h
// (tests/test_cuda_kernels.py::test_host_build_of_search_tables_and_pow_step; with
// PAGEDOPT_BIG_TESTS=1 it tries all 2^32 float bit patterns for both dynamic codebooks):
//
//  * A fast, exact replacement for `nearest_code`: a per-codebook table maps every float to the
//    small range of codes it can round to, and "threshold keys" settle the rest. It returns the
//    same code as nearest_code(code, x) for every float x (NaN, infinities, subnormals, -0
//    included) whenever the codebook is finite and sorted ascending (ties allowed); for any
//    other codebook the kernels fall back to nearest_code itself.
//  * `pow_step`: beta^t for the bias corrections, correctly rounded for integer t.
//
// The second half holds the CUDA-only pieces: vector loads/stores, exact division by a shared
// divisor, the shared-memory codebook view and the table-building kernel body.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pagedopt/codebook.h"
#include "pagedopt/common.h"

namespace pagedopt {
namespace cuda_detail {

// ---------------------------------------------------------------------------------------------
// Bit casts and IEEE double ops that the compiler may not contract or reassociate.
// ---------------------------------------------------------------------------------------------
PAGEDOPT_HOST_DEVICE uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

PAGEDOPT_HOST_DEVICE float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

#if defined(__CUDA_ARCH__)
#define PAGEDOPT_DMUL(a, b) __dmul_rn((a), (b))
#define PAGEDOPT_DADD(a, b) __dadd_rn((a), (b))
#define PAGEDOPT_DSUB(a, b) __dsub_rn((a), (b))
#define PAGEDOPT_DFMA(a, b, c) __fma_rn((a), (b), (c))
#else
// Host builds of this header (tests) must be compiled with -ffp-contract=off.
#define PAGEDOPT_DMUL(a, b) ((a) * (b))
#define PAGEDOPT_DADD(a, b) ((a) + (b))
#define PAGEDOPT_DSUB(a, b) ((a) - (b))
#define PAGEDOPT_DFMA(a, b, c) std::fma((a), (b), (c))
#endif

// ---------------------------------------------------------------------------------------------
// beta^t for the bias corrections.
//
// The CPU kernels compute the bias corrections as 1 - pow(beta, t) in double (glibc pow) and round
// the quotients to float. glibc's pow is within 0.52 ulp, almost always correctly rounded; CUDA's
// pow is within 2 ulp. To make the float constants agree with the CPU's, integer steps use an
// exponentiation by squaring in double-double arithmetic (relative error < 2^-96), so that the
// double result is the correctly rounded one; the float constants derived from it can then only
// differ from the CPU's if glibc misrounds (about 1 in 2500 calls) AND the double quotient lies
// within a few double ulps of a float rounding boundary (at most ~2^-18 even for beta2 = 0.9999,
// t = 1): below 1e-8 per tensor and step. Non-integer, negative or huge t, and |beta| >= 1, use
// the platform pow.
// ---------------------------------------------------------------------------------------------
struct DoubleDouble {
  double hi;
  double lo;
};

PAGEDOPT_HOST_DEVICE DoubleDouble dd_mul(DoubleDouble a, DoubleDouble b) {
  const double p = PAGEDOPT_DMUL(a.hi, b.hi);
  double e = PAGEDOPT_DFMA(a.hi, b.hi, -p);
  e = PAGEDOPT_DFMA(a.hi, b.lo, e);
  e = PAGEDOPT_DFMA(a.lo, b.hi, e);
  const double hi = PAGEDOPT_DADD(p, e);
  const double lo = PAGEDOPT_DSUB(e, PAGEDOPT_DSUB(hi, p));
  return {hi, lo};
}

PAGEDOPT_HOST_DEVICE double pow_step(double x, double t) {
  if (fabs(x) < 1.0 && t >= 0.0 && t <= 2147483647.0 && floor(t) == t) {
    uint32_t n = static_cast<uint32_t>(t);
    DoubleDouble result{1.0, 0.0};
    DoubleDouble base{x, 0.0};
    while (n != 0) {
      if (n & 1u) result = dd_mul(result, base);
      n >>= 1;
      if (n != 0) base = dd_mul(base, base);
    }
    return PAGEDOPT_DADD(result.hi, result.lo);
  }
  return pow(x, t);
}

// ---------------------------------------------------------------------------------------------
// Fast exact nearest-code search.
//
// key(x) maps float bit patterns to uint32 so that key order is value order (-0 sits just below
// +0; the two compare equal and get the same code). For a finite, non-decreasing codebook the
// result r(x) = nearest_code(code, x) is non-decreasing in x (binary search index is monotone;
// inside [code[i], code[i+1]) the rounded distance to code[i] grows and the one to code[i+1]
// shrinks), so r(x) >= j  <=>  key(x) >= thr[j], where thr[j] is the smallest key whose code is
// >= j. A bucket table on the top bits of |x| (sign, 8 exponent bits, 7 mantissa bits; the
// kBinades binades below 1.0 at full resolution, everything smaller in bucket 0 and everything
// >= 1.0 in the top bucket) gives for each bucket the code range [lo, lo + n]; n is 0 or 1 for
// almost every bucket of the dynamic codebooks, so a lookup costs one or two shared loads.
// NaN maps to code 0, as nearest_code does (all its comparisons are false).
// ---------------------------------------------------------------------------------------------
constexpr int kSubBits = 7;
constexpr int kBinades = 16;
constexpr uint32_t kBucketTop = static_cast<uint32_t>(kBinades) << kSubBits;  // local index of |x| >= 1
constexpr uint32_t kHalfBuckets = kBucketTop + 1;                             // per sign
constexpr uint32_t kBucketEntries = 2 * kHalfBuckets;
constexpr uint32_t kBucketBase = (0x3f800000u >> (23 - kSubBits)) - kBucketTop;
constexpr uint32_t kKeyNegInf = 0x007fffffu;  // key(-inf)
constexpr uint32_t kKeyPosInf = 0xff800000u;  // key(+inf)
// thr[1..255] are the thresholds; thr[256..512] are never-reached sentinels (~0u), so that a
// bucket without a threshold can still do its one (always false) comparison.
constexpr int kThrEntries = 2 * kCodebookSize + 1;
constexpr uint32_t kThrSentinel = 0xffffffffu;
// Bucket entry: bits 0-7 the lowest code of the bucket; bit 8 set when the bucket holds no
// threshold (its one comparison goes to a sentinel); bit 9 set when it holds more than one (the
// lookup then scans the thresholds; 1 and 2 buckets of the two dynamic codebooks).
constexpr uint32_t kBucketNoThreshold = 0x100u;
constexpr uint32_t kBucketMulti = 0x200u;

// Global-memory image of one codebook's tables (copied to shared memory by the kernels).
struct alignas(16) CodeTable {
  uint32_t thr[kThrEntries];
  uint16_t bucket[kBucketEntries];
  int32_t fast_ok;  // 0 when the codebook is not finite and sorted: use nearest_code
};

PAGEDOPT_HOST_DEVICE uint32_t float_key(float x) {
  const uint32_t u = f32_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

PAGEDOPT_HOST_DEVICE float key_float(uint32_t key) {
  return bits_f32((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

PAGEDOPT_HOST_DEVICE uint32_t code_rank(const float* code, uint32_t key) {
  return nearest_code(code, key_float(key));
}

// Finite and non-decreasing: the condition under which the fast search is exact.
PAGEDOPT_HOST_DEVICE bool codebook_entry_ok(const float* code, int i) {
  const bool finite = fabsf(code[i]) <= 3.40282347e38f;
  return finite && (i + 1 >= kCodebookSize || code[i] <= code[i + 1]);
}

PAGEDOPT_HOST_DEVICE uint16_t bucket_entry(const float* code, uint32_t e) {
  const uint32_t neg = e >= kHalfBuckets ? 1u : 0u;
  const uint32_t b = e - neg * kHalfBuckets;
  const uint32_t a0 = b == 0 ? 0u : (kBucketBase + b) << (23 - kSubBits);
  const uint32_t a1 = b == kBucketTop ? 0x7f800000u : ((kBucketBase + b + 1) << (23 - kSubBits)) - 1u;
  uint32_t lo;
  uint32_t hi;
  if (neg) {
    lo = nearest_code(code, bits_f32(a1 | 0x80000000u));
    hi = nearest_code(code, bits_f32(a0 | 0x80000000u));
  } else {
    lo = nearest_code(code, bits_f32(a0));
    hi = nearest_code(code, bits_f32(a1));
  }
  const uint32_t n = hi - lo;
  return static_cast<uint16_t>(lo | (n == 0 ? kBucketNoThreshold : n == 1 ? 0u : kBucketMulti));
}

// One round of the 32-way search for thr[j]: the candidate key of `lane` strictly inside (lo, hi)
// whenever hi - lo >= 2 (lane 31's is), non-decreasing in lane.
PAGEDOPT_HOST_DEVICE uint32_t kary_candidate(uint32_t lo, uint32_t hi, int lane) {
  return lo + static_cast<uint32_t>((static_cast<uint64_t>(hi - lo) * static_cast<uint64_t>(lane + 1)) / 33u);
}

// Serial (reference) computation of thr[j], 1 <= j <= 255.
PAGEDOPT_HOST_DEVICE uint32_t threshold_serial(const float* code, uint32_t j) {
  uint32_t lo = kKeyNegInf;  // code_rank(lo) = 0 < j
  uint32_t hi = kKeyPosInf;  // code_rank(hi) = 255 >= j
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (code_rank(code, mid) >= j) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

// Pieces of the lookup for callers that defer the rare cases: the bucket entry of x, its key, and
// the answer when the entry is not kBucketMulti and x is not NaN.
PAGEDOPT_HOST_DEVICE uint32_t bucket_index(uint32_t u) {
  uint32_t local = (u & 0x7fffffffu) >> (23 - kSubBits);
  local = local > kBucketBase ? local - kBucketBase : 0u;
  local = local < kBucketTop ? local : kBucketTop;
  return local + ((u & 0x80000000u) ? kHalfBuckets : 0u);
}

PAGEDOPT_HOST_DEVICE uint32_t key_of_bits(uint32_t u) {
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}

// True when the single-comparison answer may be wrong (kBucketMulti) or x is NaN.
PAGEDOPT_HOST_DEVICE bool lookup_is_rare(uint32_t u, uint32_t e) {
  return (e & kBucketMulti) != 0 || (u & 0x7fffffffu) > 0x7f800000u;
}

PAGEDOPT_HOST_DEVICE uint32_t lookup_single(const uint32_t* thr, uint32_t e, uint32_t key) {
  return (e & 0xffu) + (key >= thr[(e & 0x1ffu) + 1] ? 1u : 0u);
}

// The table lookup. For a bucket with several thresholds it counts them one by one from the
// bucket's lowest code (r(x) <= the bucket's highest code, so the scan stops in the bucket).
PAGEDOPT_HOST_DEVICE uint32_t fast_nearest_code(const uint32_t* thr, const uint16_t* bucket, float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0;  // NaN: nearest_code gives 0
  const uint32_t key = key_of_bits(u);
  const uint32_t e = bucket[bucket_index(u)];
  if (!(e & kBucketMulti)) return lookup_single(thr, e, key);
  uint32_t r = e & 0xffu;
  while (r < kCodebookSize - 1 && key >= thr[r + 1]) ++r;
  return r;
}

}  // namespace cuda_detail
}  // namespace pagedopt

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "pagedopt/adam.h"

namespace pagedopt {
namespace cuda_detail {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Element conversions. Loads are exact; stores round to nearest even (as c10's conversions do).
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float x) { *p = x; }
  // 8 consecutive elements, 32-byte aligned.
  static __device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
  static __device__ __forceinline__ void store8(float* p, const float (&x)[8]) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(x[4], x[5], x[6], x[7]);
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
    const uint4 r = *reinterpret_cast<const uint4*>(p);
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
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Elem<c10::BFloat16> : Elem16<c10::BFloat16, bf16_bits_to_float, float_to_bf16_bits> {};
template <>
struct Elem<c10::Half> : Elem16<c10::Half, half_bits_to_float, float_to_half_bits> {};

__device__ __forceinline__ uint32_t byte_of(uint2 w, int k) {
  return ((k < 4 ? w.x : w.y) >> (8 * (k & 3))) & 0xffu;
}

__device__ __forceinline__ uint2 pack8(const uint32_t (&c)[8]) {
  return make_uint2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24), c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// std::max(acc, x) as the CPU kernels use it: a NaN x leaves acc unchanged.
__device__ __forceinline__ float max_like_cpu(float acc, float x) { return acc < x ? x : acc; }

// ---------------------------------------------------------------------------------------------
// x / b, correctly rounded, for a divisor b shared by many x (a block's absmax, a tensor's bias
// correction, the grad scale): with y = RN(1/b),
//   q0 = RN(x y); r0 = RN(x - b q0); q1 = RN(q0 + r0 y); r1 = x - b q1 (exact); q2 = RN(q1 + r1 y).
// q0 is within 1.5 ulp of x/b, so q1 is within 1 ulp (faithful), and by Markstein's theorem
// (y within half an ulp of 1/b, q1 within one ulp of x/b, no underflow or overflow) r1 is exact
// and q2 = RN(x/b). The guard keeps every intermediate normal: b in [2^-100, 2^100],
// |x| in [max(2^-90, b 2^-100), min(2^120, b 2^100)], so x/b in [2^-100, 2^100]; anything else
// (0, subnormals, inf, NaN) takes __fdiv_rn. Five FP32 ops instead of a MUFU.RCP, seven FP32
// ops, an FCHK and a call-guarded branch per division.
// ---------------------------------------------------------------------------------------------
struct Divisor {
  float b;
  float y;
  float lo;  // +inf when b is out of range (then only 0, inf and NaN may take the fast path)
  float hi;  // NaN when b is out of range
};

__device__ __forceinline__ Divisor make_divisor(float b) {
  Divisor d;
  d.b = b;
  const bool ok = b >= 0x1p-100f && b <= 0x1p100f;
  d.y = ok ? __frcp_rn(b) : 1.0f;
  d.lo = ok ? fmaxf(0x1p-90f, __fmul_rn(b, 0x1p-100f)) : __int_as_float(0x7f800000);
  d.hi = ok ? fminf(0x1p120f, __fmul_rn(b, 0x1p100f)) : __int_as_float(0x7fffffff);
  return d;
}

__device__ __forceinline__ float div_fast(float x, const Divisor& d) {
  const float q0 = __fmul_rn(x, d.y);
  const float r0 = __fmaf_rn(-d.b, q0, x);
  const float q1 = __fmaf_rn(r0, d.y, q0);
  const float r1 = __fmaf_rn(-d.b, q1, x);
  return __fmaf_rn(r1, d.y, q1);
}

// Whether div_fast(x, d) may differ from RN(x / b) for an x with |x| <= b: x nonzero and below
// the guard (or d out of range, lo = NaN). x = +-0 gives +-0 (perhaps with the other sign, which no
// caller can observe: it only feeds nearest_code and additions); NaN gives NaN, as x / b does.
__device__ __forceinline__ bool div_absmax_needs_fixup(float x, const Divisor& d) {
  return fabsf(x) < d.lo && x != 0.0f;
}

// x / b, correctly rounded, through double: with yd = RN53(1/b) (b a float),
// RN24(RN53(x * yd)) == RN24(x / b) whenever x / b is zero, normal or overflows. Proof: x / b is
// never within 2^-49 (relative) of the midpoint of two adjacent normal floats without being a
// float itself (writing x = X 2^ex, b = B 2^eb, m = M' 2^(e-24) with 24-bit X, B and odd 25-bit M',
// x - m b is a nonzero multiple of 2^(e+eb-47), so |x/b - m| > 2^(e-48) while |x/b| < 2^(e+1)),
// and RN53(x * yd) is within (1 + 2^-53)^2 - 1 < 2^-51 of x / b. Only a result in the subnormal
// range (where exact midpoints can occur) needs a true division; callers exclude it.
__device__ __forceinline__ float div_by_rcp_d(float x, double yd) {
  return __double2float_rn(__dmul_rn(static_cast<double>(x), yd));
}

// Any x.
__device__ __forceinline__ float div_by(float x, const Divisor& d) {
  return (fabsf(x) >= d.lo && fabsf(x) <= d.hi) ? div_fast(x, d) : __fdiv_rn(x, d.b);
}

// x with |x| <= b (a value divided by its block's absmax): only the lower bound needs checking,
// and a NaN x fails it.
__device__ __forceinline__ float div_by_absmax(float x, const Divisor& d) {
  return fabsf(x) >= d.lo ? div_fast(x, d) : __fdiv_rn(x, d.b);
}

// ---------------------------------------------------------------------------------------------
// Shared-memory copy of a codebook and its tables.
// ---------------------------------------------------------------------------------------------
constexpr size_t kSmemThrOffset = kCodebookSize * sizeof(float);
constexpr size_t kSmemBucketOffset = kSmemThrOffset + (kThrEntries * sizeof(uint32_t) + 15) / 16 * 16;
constexpr size_t kSmemCodeBytes = kSmemBucketOffset + (kBucketEntries * sizeof(uint16_t) + 15) / 16 * 16;

struct SmemCode {
  const float* code;
  const uint32_t* thr;
  const uint16_t* bucket;

  __device__ __forceinline__ uint32_t nearest_fast(float x) const { return fast_nearest_code(thr, bucket, x); }
  // The common case of nearest_fast; sets `rare` when the answer must come from nearest_fast.
  __device__ __forceinline__ uint32_t nearest_fast_deferred(float x, bool& rare) const {
    const uint32_t u = __float_as_uint(x);
    const uint32_t e = bucket[bucket_index(u)];
    rare = rare || lookup_is_rare(u, e);
    return lookup_single(thr, e, key_of_bits(u));
  }
  // The reference search: for codebooks that are not finite and sorted.
  __device__ __forceinline__ uint32_t nearest_ref(float x) const { return nearest_code(code, x); }
  template <bool kFast>
  __device__ __forceinline__ uint32_t nearest(float x) const {
    return kFast ? nearest_fast(x) : nearest_ref(x);
  }
};

// Fills the shared copy of one codebook (+ its tables when `table` is non-null) at `smem`.
// Returns whether the fast search may be used. Ends with __syncthreads(); all threads must call it.
__device__ __forceinline__ bool load_smem_code(unsigned char* smem, const float* __restrict__ code,
                                               const CodeTable* __restrict__ table) {
  float* s_code = reinterpret_cast<float*>(smem);
  uint32_t* s_thr = reinterpret_cast<uint32_t*>(smem + kSmemThrOffset);
  uint32_t* s_bucket = reinterpret_cast<uint32_t*>(smem + kSmemBucketOffset);
  for (int i = threadIdx.x; i < kCodebookSize; i += blockDim.x) s_code[i] = code[i];
  const bool fast = table != nullptr && table->fast_ok != 0;
  if (fast) {
    for (int i = threadIdx.x; i < kThrEntries; i += blockDim.x) s_thr[i] = table->thr[i];
    const uint32_t* src = reinterpret_cast<const uint32_t*>(table->bucket);
    for (int i = threadIdx.x; i < static_cast<int>(kBucketEntries / 2); i += blockDim.x) s_bucket[i] = src[i];
  }
  __syncthreads();
  return fast;
}

__device__ __forceinline__ SmemCode smem_code_view(const unsigned char* smem) {
  return SmemCode{reinterpret_cast<const float*>(smem), reinterpret_cast<const uint32_t*>(smem + kSmemThrOffset),
                  reinterpret_cast<const uint16_t*>(smem + kSmemBucketOffset)};
}

// ---------------------------------------------------------------------------------------------
// Building the tables: one warp per threshold (32-way search, 7 rounds), one thread per bucket.
// kTableBlocks blocks of kTableThreads threads per codebook.
// ---------------------------------------------------------------------------------------------
constexpr int kTableThreads = 256;
constexpr int kTableBlocks = (kCodebookSize * kWarp) / kTableThreads;  // 256 warps: thresholds 0..255
static_assert(kTableBlocks * kTableThreads >= static_cast<int>(kBucketEntries), "bucket coverage");
static_assert(kBucketEntries % 2 == 0, "buckets are copied as 32-bit words");

__device__ __forceinline__ uint32_t threshold_warp(const float* code, uint32_t j, int lane) {
  uint32_t lo = kKeyNegInf;
  uint32_t hi = kKeyPosInf;
  while (hi - lo > 1) {  // warp-uniform
    const uint32_t c = kary_candidate(lo, hi, lane);
    const bool p = c != lo && code_rank(code, c) >= j;
    const unsigned ball = __ballot_sync(kFullMask, p);
    const int first = ball ? __ffs(ball) - 1 : kWarp;  // lanes below `first` are false
    const uint32_t c_before = __shfl_sync(kFullMask, c, first == 0 ? 0 : first - 1);
    const uint32_t c_first = __shfl_sync(kFullMask, c, first == kWarp ? 0 : first);
    const uint32_t new_lo = first == 0 ? lo : c_before;
    const uint32_t new_hi = first == kWarp ? hi : c_first;
    lo = new_lo;
    hi = new_hi;
  }
  return hi;
}

// Block `block` (0 <= block < kTableBlocks) of the table build for `code`.
__device__ __forceinline__ void build_code_table_block(const float* __restrict__ code, CodeTable* __restrict__ out,
                                                       int block) {
  __shared__ float s_code[kCodebookSize];
  for (int i = threadIdx.x; i < kCodebookSize; i += blockDim.x) s_code[i] = code[i];
  __syncthreads();
  bool ok = true;
  for (int i = threadIdx.x; i < kCodebookSize; i += blockDim.x) ok = ok && codebook_entry_ok(s_code, i);
  ok = __syncthreads_and(ok) != 0;
  if (block == 0 && threadIdx.x == 0) out->fast_ok = ok ? 1 : 0;
  if (!ok) return;
  const int lane = threadIdx.x % kWarp;
  const int warp = block * (kTableThreads / kWarp) + threadIdx.x / kWarp;  // 0..255
  if (warp == 0) {
    for (int i = lane; i < kThrEntries; i += kWarp) {
      if (i == 0 || i >= kCodebookSize) out->thr[i] = i == 0 ? 0u : kThrSentinel;
    }
  } else if (warp < kCodebookSize) {
    const uint32_t t = threshold_warp(s_code, static_cast<uint32_t>(warp), lane);
    if (lane == 0) out->thr[warp] = t;
  }
  const uint32_t e = static_cast<uint32_t>(block * kTableThreads + threadIdx.x);
  if (e < kBucketEntries) out->bucket[e] = bucket_entry(s_code, e);
}

}  // namespace cuda_detail
}  // namespace pagedopt
#endif  // __CUDACC__
