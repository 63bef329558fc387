#pragma once
// The norm pass (quantized_update_norm_) of LARS and LAMB on 4-bit states (csrc/cuda/quantized_step.cu
// launches it through launch_four_bit_norm): one warp per 128-element block, in a grid-stride walk
// over the blocks of the concatenated tensors (the host counts 128-blocks for it; the step kernel,
// four_bit_step_kernel.cuh, takes tiles of two). Lane l owns the block's elements [4 l, 4 l + 4),
// read element by element; the warp adds the squares of their update directions, in double, to
// its tensor's norm (one atomicAdd per block: the sum's rounding depends on the order of the
// blocks, so it may differ from the CPU's in the last bits).
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "eight_bit_step_kernel.cuh"
#include "element_io.cuh"
#include "four_bit_step_kernel.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/four_bit.h"
#include "warp_block.cuh"

namespace pagedopt {
namespace cuda_detail {

constexpr int kFourBitNormThreads = 256;
constexpr int kFourBitNormWarps = kFourBitNormThreads / kWarp;
static_assert(kBlock4 == 4 * kWarp, "one warp per 128-element block, 4 elements per lane");

// The lane's 4 codes of one moment, code k in bits [4 k, 4 k + 4): the bytes that exist (a tail
// lane past the end reads nothing).
__device__ __forceinline__ uint32_t load_codes4(const uint8_t* codes, int64_t i0, int64_t n) {
  const int64_t byte = i0 >> 1;
  uint32_t w = 0;
  if (i0 < n) w = codes[byte];
  if (i0 + 2 < n) w |= static_cast<uint32_t>(codes[byte + 1]) << 8;
  return w;
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

template <typename Algo, typename T>
__global__ void __launch_bounds__(kFourBitNormThreads) four_bit_update_norm_kernel(const StepArgs<Algo> args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  __shared__ float s_code[K][kCodebookSize4];
  for (int i = threadIdx.x; i < K * kCodebookSize4; i += blockDim.x) {
    s_code[i / kCodebookSize4][i % kCodebookSize4] = args.qmap[i / kCodebookSize4][i % kCodebookSize4];
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;
  for_each_warp_block<kFourBitNormWarps>(args.total_blocks, [&](int64_t b, int64_t) {
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
      w[j] = load_codes4(moment_codes4<Algo>(m, j), i0, n);
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

// The norm pass's launch: a grid-stride walk of at most 8 blocks of 256 threads per SM.
template <typename Algo, typename T>
void launch_four_bit_norm(const StepArgs<Algo>& args, int sms, cudaStream_t stream) {
  const int64_t want = ceil_div(args.total_blocks, int64_t{kFourBitNormWarps});
  const int64_t cap = int64_t{sms} * 8;
  const int grid = static_cast<int>(want < cap ? (want < 1 ? 1 : want) : cap);
  four_bit_update_norm_kernel<Algo, T><<<grid, kFourBitNormThreads, 0, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_detail
}  // namespace pagedopt
