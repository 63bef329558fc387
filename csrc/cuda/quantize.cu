// CUDA blockwise quantize / dequantize. Same results as csrc/cpu/quantize.cpp, bit for bit:
// the same absmax (an exact max of the finite |x|), x * absmax_reciprocal(absmax), and nearest_code (or the exact
// table search of code_table.cuh, which returns the same code for every float).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "code_table.cuh"
#include "element_io.cuh"
#include "launch.h"
#include "pagedopt/codebook.h"
#include "pagedopt/four_bit.h"
#include "warp_block.cuh"

namespace pagedopt {
namespace {

using namespace cuda_detail;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
// Below this many elements the table build (one extra small launch) does not pay for itself.
constexpr int64_t kFastTableMinNumel = int64_t{1} << 22;

__global__ void __launch_bounds__(kTableThreads) build_table_kernel(const float* __restrict__ code,
                                                                      CodeTable* __restrict__ table) {
  build_code_table_block(code, table, blockIdx.x);
}

// One warp per quantization block of 256 (warp_block.cuh): the vector layout for a full block of
// an aligned input (8 consecutive elements per lane, one 16- or 32-byte load, the codes as one
// 8-byte word per lane), the strided one for a tail block or an unaligned input.
template <typename T, bool kFast>
__device__ __forceinline__ void quantize_block256(const T* __restrict__ x, int64_t n, int64_t b, bool vec_ok,
                                                  const SmemCode& sc, uint8_t* __restrict__ codes,
                                                  float* __restrict__ absmax, int lane) {
  const int64_t lo = b * kBlock;
  const bool full = vec_ok && lo + kBlock <= n;
  float v[8];
  if (full) {
    Elem<T>::load8(x + lo + lane * 8, v);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = lo + k * kWarp + lane;
      v[k] = i < n ? Elem<T>::load(x + i) : 0.0f;  // zeros do not change the max
    }
  }
  float mx = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) mx = fmaxf(mx, finite_abs(v[k]));  // NaN, +-inf do not count (as on the CPU)
  const BlockScale scale = block_scale(mx);
  if (full) {
    store_codes8<kFast>(codes + lo + lane * 8, sc, v, scale.inv);
  } else {
    for_each_strided_element<kLaneElems>(lo, n, lane, [&](int k, int64_t i) {
      codes[i] = code_of<kFast>(sc, v[k], scale.inv);
    });
  }
  if (lane == 0) absmax[b] = scale.absmax;
}

// Any blocksize (a multiple of 32 up to 4096): one warp per block, two strided passes.
template <typename T, bool kFast>
__device__ __forceinline__ void quantize_block_generic(const T* __restrict__ x, int64_t n, int64_t b,
                                                       int64_t blocksize, const SmemCode& sc,
                                                       uint8_t* __restrict__ codes, float* __restrict__ absmax,
                                                       int lane) {
  const int64_t lo = b * blocksize;
  const int64_t len = std::min(blocksize, n - lo);
  float mx = 0.0f;
  for (int64_t i = lane; i < len; i += kWarp) mx = fmaxf(mx, finite_abs(Elem<T>::load(x + lo + i)));
  const BlockScale scale = block_scale(mx);
  for (int64_t i = lane; i < len; i += kWarp) codes[lo + i] = code_of<kFast>(sc, Elem<T>::load(x + lo + i), scale.inv);
  if (lane == 0) absmax[b] = scale.absmax;
}

template <typename T, bool kBlock256, bool kFast>
__device__ __forceinline__ void quantize_loop(const T* __restrict__ x, int64_t n, int64_t blocksize,
                                              int64_t nblocks, bool vec_ok, const SmemCode& sc,
                                              uint8_t* __restrict__ codes, float* __restrict__ absmax) {
  const int lane = threadIdx.x % kWarp;
  for_each_warp_block<kWarpsPerBlock>(nblocks, [&](int64_t b, int64_t warps) {
    if (kBlock256 && vec_ok && b + warps < nblocks && lane < static_cast<int>(2 * sizeof(T))) {
      // the warp's next block into L2 (256 * sizeof(T) bytes: 2 * sizeof(T) lines of 128 bytes)
      prefetch_l2(reinterpret_cast<const char*>(x + (b + warps) * kBlock) + lane * 128);
    }
    if (kBlock256) {
      quantize_block256<T, kFast>(x, n, b, vec_ok, sc, codes, absmax, lane);
    } else {
      quantize_block_generic<T, kFast>(x, n, b, blocksize, sc, codes, absmax, lane);
    }
  });
}

template <typename T, bool kBlock256>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, int64_t n, int64_t blocksize,
                                                              int64_t nblocks, bool vec_ok,
                                                              const float* __restrict__ code,
                                                              const CodeTable* __restrict__ table,
                                                              uint8_t* __restrict__ codes,
                                                              float* __restrict__ absmax) {
  extern __shared__ __align__(16) unsigned char smem[];
  const bool fast = load_smem_code(smem, code, table);
  const SmemCode sc = smem_code_view(smem);
  if (fast) {
    quantize_loop<T, kBlock256, true>(x, n, blocksize, nblocks, vec_ok, sc, codes, absmax);
  } else {
    quantize_loop<T, kBlock256, false>(x, n, blocksize, nblocks, vec_ok, sc, codes, absmax);
  }
}

// Each thread writes 8 consecutive outputs (blocksize is a multiple of 8, so they share a block).
template <typename T, bool kPow2>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ q,
                                                                const float* __restrict__ absmax,
                                                                const float* __restrict__ code, T* __restrict__ out,
                                                                int64_t n, int64_t blocksize, int shift,
                                                                bool vec_ok) {
  __shared__ float s_code[kCodebookSize];
  for (int i = threadIdx.x; i < kCodebookSize; i += blockDim.x) s_code[i] = code[i];
  __syncthreads();
  const int64_t groups = ceil_div(n, 8);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; gi < groups; gi += stride) {
    const int64_t i0 = gi * 8;
    const float a = absmax[kPow2 ? (i0 >> shift) : (i0 / blocksize)];
    if (vec_ok && i0 + 8 <= n) {
      const uint2 w = *reinterpret_cast<const uint2*>(q + i0);
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = __fmul_rn(s_code[byte_of(w, k)], a);
      Elem<T>::store8(out + i0, o);
    } else {
      for (int64_t i = i0; i < n && i < i0 + 8; ++i) Elem<T>::store(out + i, __fmul_rn(s_code[q[i]], a));
    }
  }
}

// stochastic_round_bf16: a grid-stride walk over the elements, element i with the bits of index
// offset + i. The stream comes from the step count read on the device.
__global__ void __launch_bounds__(kThreads) stochastic_round_bf16_kernel(const float* __restrict__ x,
                                                                        uint16_t* __restrict__ out, int64_t n,
                                                                        uint64_t key, const float* __restrict__ step,
                                                                        int64_t offset) {
  const uint64_t stream = sr_stream(key, *step);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = round_bf16_stochastic(x[i], sr_bits(stream, static_cast<uint64_t>(offset + i)));
  }
}

// 4-bit codes (pagedopt/four_bit.h), any blocksize (even): one warp per block, two strided passes,
// lane l quantizing the element pairs l, l + 32, ... of its block into whole bytes. The codebook's
// 16 entries in shared memory, the search nearest_code4 (as on the CPU).
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize4_kernel(const T* __restrict__ x, int64_t n, int64_t blocksize,
                                                               int64_t nblocks, const float* __restrict__ code,
                                                               uint8_t* __restrict__ codes,
                                                               float* __restrict__ absmax) {
  __shared__ float s_code[kCodebookSize4];
  for (int i = threadIdx.x; i < kCodebookSize4; i += blockDim.x) s_code[i] = code[i];
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  for_each_warp_block<kWarpsPerBlock>(nblocks, [&](int64_t b, int64_t) {
    const int64_t lo = b * blocksize;
    const int64_t len = std::min(blocksize, n - lo);
    float mx = 0.0f;
    for (int64_t i = lane; i < len; i += kWarp) mx = fmaxf(mx, finite_abs(Elem<T>::load(x + lo + i)));
    const BlockScale scale = block_scale(mx);
    for (int64_t k = lane; 2 * k < len; k += kWarp) {
      const int64_t i = lo + 2 * k;
      const uint8_t even = nearest_code4(s_code, __fmul_rn(Elem<T>::load(x + i), scale.inv));
      const uint8_t odd = 2 * k + 1 < len ? nearest_code4(s_code, __fmul_rn(Elem<T>::load(x + i + 1), scale.inv)) : 0;
      codes[i >> 1] = pack_nibbles(even, odd);
    }
    if (lane == 0) absmax[b] = scale.absmax;
  });
}

// 4-bit codes back to values: thread per byte, its two values (n = 2 * bytes).
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize4_kernel(const uint8_t* __restrict__ q,
                                                                 const float* __restrict__ absmax,
                                                                 const float* __restrict__ code, T* __restrict__ out,
                                                                 int64_t bytes, int64_t blocksize) {
  __shared__ float s_code[kCodebookSize4];
  for (int i = threadIdx.x; i < kCodebookSize4; i += blockDim.x) s_code[i] = code[i];
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes; k += stride) {
    const float a = absmax[(2 * k) / blocksize];  // both values of a byte are in one block (blocksize is even)
    const uint8_t byte = q[k];
    Elem<T>::store(out + 2 * k, __fmul_rn(s_code[byte & 0xF], a));
    Elem<T>::store(out + 2 * k + 1, __fmul_rn(s_code[byte >> 4], a));
  }
}

int grid_for(int64_t work_items, int per_block, int blocks_per_sm) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = ceil_div(work_items, per_block);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * blocks_per_sm)));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda_unchecked(const at::Tensor& x_in, const at::Tensor& code,
                                                                   int64_t blocksize) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  const bool four_bit = code.numel() == kCodebookSize4;  // checked: 16 or 256 entries
  at::Tensor codes = four_bit ? at::empty({packed_bytes(n)}, x.options().dtype(at::kByte))
                              : at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({blocks}, x.options().dtype(at::kFloat));
  if (n == 0) return {codes, absmax};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (four_bit) {
    auto launch4 = [&](auto* xs) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
      quantize4_kernel<T><<<grid_for(blocks, kWarpsPerBlock, 8), kThreads, 0, stream>>>(
          xs, n, blocksize, blocks, code.data_ptr<float>(), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    switch (x.scalar_type()) {
      case at::kFloat: launch4(static_cast<const float*>(x.const_data_ptr())); break;
      case at::kBFloat16: launch4(static_cast<const c10::BFloat16*>(x.const_data_ptr())); break;
      case at::kHalf: launch4(static_cast<const c10::Half*>(x.const_data_ptr())); break;
      default: TORCH_INTERNAL_ASSERT(false);
    }
    return {codes, absmax};
  }

  at::Tensor table_buf;
  const CodeTable* table = nullptr;
  if (n >= kFastTableMinNumel) {
    table_buf = at::empty({static_cast<int64_t>(sizeof(CodeTable))}, x.options().dtype(at::kByte));
    build_table_kernel<<<kTableBlocks, kTableThreads, 0, stream>>>(code.data_ptr<float>(),
                                                                   reinterpret_cast<CodeTable*>(table_buf.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    table = reinterpret_cast<const CodeTable*>(table_buf.data_ptr());
  }
  const bool vec_ok = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int grid = grid_for(blocks, kWarpsPerBlock, 8);
  auto launch = [&](auto* xs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
    if (blocksize == 256) {
      quantize_kernel<T, true><<<grid, kThreads, kSmemCodeBytes, stream>>>(
          xs, n, blocksize, blocks, vec_ok, code.data_ptr<float>(), table, codes.data_ptr<uint8_t>(),
          absmax.data_ptr<float>());
    } else {
      quantize_kernel<T, false><<<grid, kThreads, kSmemCodeBytes, stream>>>(
          xs, n, blocksize, blocks, vec_ok, code.data_ptr<float>(), table, codes.data_ptr<uint8_t>(),
          absmax.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (x.scalar_type()) {
    case at::kFloat: launch(static_cast<const float*>(x.const_data_ptr())); break;
    case at::kBFloat16: launch(static_cast<const c10::BFloat16*>(x.const_data_ptr())); break;
    case at::kHalf: launch(static_cast<const c10::Half*>(x.const_data_ptr())); break;
    default: TORCH_INTERNAL_ASSERT(false);
  }
  return {codes, absmax};
}

at::Tensor dequantize_blockwise_cuda_unchecked(const at::Tensor& codes_in, const at::Tensor& absmax_in,
                                             const at::Tensor& code, int64_t blocksize, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(codes_in.device());
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor absmax = absmax_in.contiguous();
  const int64_t n = codes.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  const bool four_bit = code.numel() == kCodebookSize4;  // checked: 16 or 256 entries
  at::Tensor out = four_bit ? at::empty({2 * n}, codes.options().dtype(dtype))
                            : at::empty(codes.sizes(), codes.options().dtype(dtype));
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (four_bit) {
    auto launch4 = [&](auto* os) {
      using T = std::remove_pointer_t<decltype(os)>;
      dequantize4_kernel<T><<<grid_for(n, kThreads, 16), kThreads, 0, stream>>>(
          codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), os, n, blocksize);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    switch (dtype) {
      case at::kFloat: launch4(static_cast<float*>(out.data_ptr())); break;
      case at::kBFloat16: launch4(static_cast<c10::BFloat16*>(out.data_ptr())); break;
      case at::kHalf: launch4(static_cast<c10::Half*>(out.data_ptr())); break;
      default: TORCH_INTERNAL_ASSERT(false);
    }
    return out;
  }
  const bool vec_ok = reinterpret_cast<uintptr_t>(codes.data_ptr()) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  const bool pow2 = (blocksize & (blocksize - 1)) == 0;
  int shift = 0;
  while ((int64_t{1} << shift) < blocksize) ++shift;
  const int grid = grid_for(ceil_div(n, 8), kThreads, 16);
  auto launch = [&](auto* os) {
    using T = std::remove_pointer_t<decltype(os)>;
    if (pow2) {
      dequantize_kernel<T, true><<<grid, kThreads, 0, stream>>>(
          codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), os, n, blocksize, shift, vec_ok);
    } else {
      dequantize_kernel<T, false><<<grid, kThreads, 0, stream>>>(
          codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(), os, n, blocksize, shift, vec_ok);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (dtype) {
    case at::kFloat: launch(static_cast<float*>(out.data_ptr())); break;
    case at::kBFloat16: launch(static_cast<c10::BFloat16*>(out.data_ptr())); break;
    case at::kHalf: launch(static_cast<c10::Half*>(out.data_ptr())); break;
    default: TORCH_INTERNAL_ASSERT(false);
  }
  return out;
}

at::Tensor stochastic_round_bf16_cuda_unchecked(const at::Tensor& x_in, const at::Tensor& step, int64_t seed, int64_t id,
                                                int64_t offset) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const uint64_t key = sr_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(id));
  stochastic_round_bf16_kernel<<<grid_for(n, kThreads, 8), kThreads, 0,
                                 at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, key, step.data_ptr<float>(),
      offset);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace pagedopt
