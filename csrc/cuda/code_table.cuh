#pragma once
// The nearest-code search of the CUDA kernels (csrc/cuda/quantize.cu, the engine's step kernel
// csrc/cuda/eight_bit_step_kernel.cuh): a fast, exact replacement for `nearest_code` of
// pagedopt/codebook.h. One 32-bit table entry per bucket of floats gives the code with an add and a
// byte select (see "Fast exact nearest-code search" below). It returns the same code as
// nearest_code(code, x) for every float x (NaN, infinities, subnormals, -0 included) whenever the
// codebook fits the table (the dynamic codebooks do); for any other codebook the kernels fall back
// to nearest_code itself.
//
// The first half (up to the `__CUDACC__` section) is plain host/device C++ so that a host test
// can compile it with g++ and check it against nearest_code (tests/test_code_table_host.py, which
// CI runs; with PAGEDOPT_BIG_TESTS=1 it tries all 2^32 float bit patterns for both dynamic
// codebooks). The second half holds the CUDA-only pieces: the shared-memory copy of a codebook and
// its table (SmemCode), and the table-building kernel body.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pagedopt/codebook.h"
#include "pagedopt/common.h"

namespace pagedopt {
namespace cuda_detail {

// ---------------------------------------------------------------------------------------------
// Bit casts.
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


// ---------------------------------------------------------------------------------------------
// Fast exact nearest-code search.
//
// key(x) maps float bit patterns to uint32 so that key order is value order (-0 sits just below
// +0; the two compare equal and get the same code). For a finite, non-decreasing codebook the
// result r(x) = nearest_code(code, x) is non-decreasing in x (the binary search index is monotone;
// inside [code[i], code[i+1]) the rounded distance to code[i] grows and the one to code[i+1]
// shrinks).
//
// A bucket holds the floats of one sign whose |x| share the top 16 bits (8 exponent bits and
// kSubBits = 7 mantissa bits), for the kBinades binades below 1.0; everything smaller is bucket 0
// and everything >= 1.0 (with inf) is the top bucket. The keys of a middle bucket are 2^16
// consecutive keys that share their top 16 bits, so one 32-bit entry describes the bucket when r
// takes at most two values on it, lo and lo + 1 from the threshold key t (1 <= t <= 0xffff, low 16
// bits) on, or just lo (t = 0x10000):
//     entry = (lo << 24) + (2^24 - t),   r(x) = (entry + (key(x) & 0xffff)) >> 24
// (the sum carries into the top byte exactly when key & 0xffff >= t). So a lookup is a clamp, a
// shared load, an add and a byte select; no branch. NaN clamps into bucket 0, whose code is that
// of 0.0, as nearest_code quantizes NaN. The two dynamic codebooks satisfy the conditions (bucket 0
// and the top bucket constant, at most one threshold per middle bucket); a codebook that does not
// gets kBadEntry entries and the kernels use nearest_code itself.
// ---------------------------------------------------------------------------------------------
constexpr int kSubBits = 7;
constexpr int kBinades = 24;
constexpr uint32_t kBucketTop = static_cast<uint32_t>(kBinades) << kSubBits;  // local index of |x| >= 1
constexpr uint32_t kHalfBuckets = kBucketTop + 1;                             // per sign
constexpr uint32_t kNegOffset = 4096;  // negative x: entry kNegOffset + local index
constexpr uint32_t kBucketEntries = 2 * kNegOffset;
constexpr uint32_t kBucketBase = (0x3f800000u >> (23 - kSubBits)) - kBucketTop;
constexpr uint32_t kNoThreshold = 0x10000u;
constexpr uint32_t kBadEntry = 0xffffffffu;  // the codebook does not fit the table
constexpr float kSmallestBucketed = 0x1p-24f;  // bits (kBucketBase << 16): bucket 0
static_assert(23 - kSubBits == 16, "a middle bucket spans the low 16 bits of the key");
static_assert(kHalfBuckets <= kNegOffset, "the two signs' entries do not overlap");

// Global-memory image of one codebook's table (copied to shared memory by the kernels).
struct alignas(16) CodeTable {
  uint32_t entry[kBucketEntries];
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

// Finite and non-decreasing: the condition under which the table can be exact.
PAGEDOPT_HOST_DEVICE bool codebook_entry_ok(const float* code, int i) {
  const bool finite = fabsf(code[i]) <= 3.40282347e38f;
  return finite && (i + 1 >= kCodebookSize || code[i] <= code[i + 1]);
}

// Local index b (0..kBucketTop) and sign of entry e; false for the padding entries.
PAGEDOPT_HOST_DEVICE bool entry_bucket(uint32_t e, uint32_t& b, bool& neg) {
  neg = e >= kNegOffset;
  b = neg ? e - kNegOffset : e;
  return b <= kBucketTop;
}

// The first and last key of bucket (b, neg).
PAGEDOPT_HOST_DEVICE void bucket_keys(uint32_t b, bool neg, uint32_t& first, uint32_t& last) {
  const uint32_t a0 = b == 0 ? 0u : (kBucketBase + b) << (23 - kSubBits);
  const uint32_t a1 = b == kBucketTop ? 0x7f800000u : ((kBucketBase + b + 1) << (23 - kSubBits)) - 1u;
  if (neg) {
    first = float_key(bits_f32(a1 | 0x80000000u));
    last = float_key(bits_f32(a0 | 0x80000000u));
  } else {
    first = float_key(bits_f32(a0));
    last = float_key(bits_f32(a1));
  }
}

// Entry e of the table of a finite, non-decreasing codebook (kBadEntry if it does not fit; 0 for
// the padding between the two signs, which no float reaches).
PAGEDOPT_HOST_DEVICE uint32_t bucket_entry(const float* code, uint32_t e) {
  uint32_t b;
  bool neg;
  if (!entry_bucket(e, b, neg)) return 0;
  uint32_t first;
  uint32_t last;
  bucket_keys(b, neg, first, last);
  const uint32_t lo = code_rank(code, first);
  const uint32_t hi = code_rank(code, last);
  uint32_t threshold = kNoThreshold;
  if (hi != lo) {
    const bool middle = (first >> 16) == (last >> 16);
    if (hi != lo + 1 || !middle) return kBadEntry;
    uint32_t below = first;  // code_rank(below) == lo
    uint32_t at = last;      // code_rank(at) == hi
    while (at - below > 1) {
      const uint32_t mid = below + (at - below) / 2;
      if (code_rank(code, mid) >= hi) {
        at = mid;
      } else {
        below = mid;
      }
    }
    threshold = at & 0xffffu;  // >= 1: the bucket's first key has code lo
  }
  return (lo << 24) + (0x1000000u - threshold);
}

// All ones for a negative x (sign bit set), else zero.
PAGEDOPT_HOST_DEVICE uint32_t sign_mask(float x) {
  return static_cast<uint32_t>(static_cast<int32_t>(f32_bits(x)) >> 31);
}

// The table index of x (any float; NaN lands in bucket 0) and the low 16 bits of its key.
PAGEDOPT_HOST_DEVICE uint32_t table_index(float x) {
  const float a = fabsf(x);
  const float at_least = a > kSmallestBucketed ? a : kSmallestBucketed;  // NaN -> kSmallestBucketed
  const float clamped = at_least < 1.0f ? at_least : 1.0f;
  const uint32_t local = (f32_bits(clamped) >> (23 - kSubBits)) - kBucketBase;
  return local | (sign_mask(x) & kNegOffset);
}

PAGEDOPT_HOST_DEVICE uint32_t key_low16(float x) { return (f32_bits(x) ^ sign_mask(x)) & 0xffffu; }

// The code from x's entry: its top byte after adding x's low key bits.
PAGEDOPT_HOST_DEVICE uint32_t entry_sum(uint32_t entry, float x) { return entry + key_low16(x); }

// nearest_code(code, x) from a table whose entries are all valid, for every float x.
PAGEDOPT_HOST_DEVICE uint32_t fast_nearest_code(const uint32_t* table, float x) {
  return entry_sum(table[table_index(x)], x) >> 24;
}

}  // namespace cuda_detail
}  // namespace pagedopt

#if defined(__CUDACC__)
namespace pagedopt {
namespace cuda_detail {

__device__ __forceinline__ uint2 pack8(const uint32_t (&c)[8]) {
  return make_uint2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24), c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
}

// ---------------------------------------------------------------------------------------------
// Shared-memory copy of a codebook and its table, read through 32-bit shared addresses (so that an
// element's address is one LEA from its index).
// ---------------------------------------------------------------------------------------------
constexpr size_t kSmemTableOffset = kCodebookSize * sizeof(float);
constexpr size_t kSmemCodeBytes = kSmemTableOffset + kBucketEntries * sizeof(uint32_t);

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

// The top bytes of four 32-bit words, packed into one word (byte k from w[k]).
__device__ __forceinline__ uint32_t top_bytes(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  return __byte_perm(__byte_perm(w0, w1, 0x0073u), __byte_perm(w2, w3, 0x0073u), 0x5410u);
}

struct SmemCode {
  const float* code;
  uint32_t table;  // shared address of the table

  __device__ __forceinline__ uint32_t entry_sum(float x) const {
    return cuda_detail::entry_sum(lds_u32(table + 4 * table_index(x)), x);
  }
  __device__ __forceinline__ uint32_t nearest_fast(float x) const { return entry_sum(x) >> 24; }
  // The reference search: for codebooks that do not fit the table.
  __device__ __forceinline__ uint32_t nearest_ref(float x) const { return nearest_code(code, x); }
  template <bool kFast>
  __device__ __forceinline__ uint32_t nearest(float x) const {
    return kFast ? nearest_fast(x) : nearest_ref(x);
  }
  // Codes of 8 values, packed as 8 bytes.
  template <bool kFast>
  __device__ __forceinline__ uint2 nearest8(const float (&x)[8], float scale) const {
    if (kFast) {
      uint32_t s[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) s[k] = entry_sum(x[k] * scale);
      return make_uint2(top_bytes(s[0], s[1], s[2], s[3]), top_bytes(s[4], s[5], s[6], s[7]));
    }
    uint32_t c[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) c[k] = nearest_ref(x[k] * scale);
    return pack8(c);
  }
};

// Fills the shared copy of one codebook (+ its table when `table` is non-null) at `smem`.
// Returns whether the table search may be used. Ends with a barrier; all threads must call it.
__device__ __forceinline__ bool load_smem_code(unsigned char* smem, const float* __restrict__ code,
                                               const CodeTable* __restrict__ table) {
  float* s_code = reinterpret_cast<float*>(smem);
  uint32_t* s_table = reinterpret_cast<uint32_t*>(smem + kSmemTableOffset);
  for (int i = threadIdx.x; i < kCodebookSize; i += blockDim.x) s_code[i] = code[i];
  bool ok = table != nullptr;
  if (ok) {
    for (int i = threadIdx.x; i < static_cast<int>(kBucketEntries); i += blockDim.x) {
      const uint32_t e = table->entry[i];
      ok = ok && e != kBadEntry;
      s_table[i] = e;
    }
  }
  return __syncthreads_and(table != nullptr && ok) != 0;
}

__device__ __forceinline__ SmemCode smem_code_view(const unsigned char* smem) {
  return SmemCode{reinterpret_cast<const float*>(smem), smem_addr(smem + kSmemTableOffset)};
}

// ---------------------------------------------------------------------------------------------
// Building a table: one thread per entry, kTableBlocks blocks of kTableThreads threads per codebook.
// ---------------------------------------------------------------------------------------------
constexpr int kTableThreads = 256;
constexpr int kTableBlocks = static_cast<int>((kBucketEntries + kTableThreads - 1) / kTableThreads);

// Block `block` of the build of a search table of entries `entries` for the kCodes-entry codebook
// `code`: entry e of `out` is entry(code, e), or kBadEntry everywhere when entry_ok(code, i) fails for
// any i (the codebook does not fit the table). Serves the 8-bit table (build_code_table_block) and
// the 4-bit one (code_table4.cuh's build_code_table4_block).
template <int kCodes, uint32_t kEntries, typename EntryOk, typename Entry>
__device__ __forceinline__ void build_table_block(const float* __restrict__ code, uint32_t* __restrict__ out,
                                                  int block, EntryOk entry_ok, Entry entry) {
  __shared__ float s_code[kCodes];
  for (int i = threadIdx.x; i < kCodes; i += blockDim.x) s_code[i] = code[i];
  __syncthreads();
  bool ok = true;
  for (int i = threadIdx.x; i < kCodes; i += blockDim.x) ok = ok && entry_ok(s_code, i);
  ok = __syncthreads_and(ok) != 0;
  const uint32_t e = static_cast<uint32_t>(block * kTableThreads + threadIdx.x);
  if (e < kEntries) out[e] = ok ? entry(s_code, e) : kBadEntry;
}

// Block `block` (0 <= block < kTableBlocks) of the table build for `code`.
__device__ __forceinline__ void build_code_table_block(const float* __restrict__ code, CodeTable* __restrict__ out,
                                                       int block) {
  build_table_block<kCodebookSize, kBucketEntries>(
      code, out->entry, block, [](const float* c, int i) { return codebook_entry_ok(c, i); },
      [](const float* c, uint32_t e) { return bucket_entry(c, e); });
}

}  // namespace cuda_detail
}  // namespace pagedopt
#endif  // __CUDACC__

