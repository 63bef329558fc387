#pragma once
// Shared by the CPU (.cpp) and CUDA (.cu) kernels: everything here must compile for both.
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PAGEDOPT_HOST_DEVICE __host__ __device__ __forceinline__
#define PAGEDOPT_UNROLL _Pragma("unroll")
#else
#define PAGEDOPT_HOST_DEVICE inline
#define PAGEDOPT_UNROLL
#endif

namespace pagedopt {

// The optimizer kernels quantize their states in blocks of this many elements,
// with one fp32 absmax per block (the bitsandbytes blockwise layout).
constexpr int64_t kStateBlockSize = 256;
constexpr int kCodebookSize = 256;

// 4-bit states (pagedopt/four_bit.h): two codes per byte, one fp32 absmax per 128 elements, a
// 16-entry codebook.
constexpr int64_t kStateBlockSize4 = 128;
constexpr int kCodebookSize4 = 16;

PAGEDOPT_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace pagedopt
