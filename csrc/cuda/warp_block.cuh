#pragma once
// One warp per 256-element block: the block loop of the CUDA kernels, written once.
//
// The kernels that walk the 8-bit states, or the elements alongside them, give each warp whole
// blocks of kBlock = 256 elements (the states' quantization blocks), so that no block is split
// between warps and a block's absmax is one warp reduction: the 8-bit step
// (eight_bit_step_kernel.cuh), the norm pass of LARS and LAMB (quantized_step.cu) and blockwise
// quantization (quantize.cu). A lane holds 8 elements of its block, in one of two layouts:
//  * vector: elements [8 lane, 8 lane + 8) of the block, one 16- or 32-byte access per array and
//    the 8 codes in one 8-byte store (full blocks of suitably aligned tensors);
//  * strided: elements lane + 32 k, k = 0..7, each access coalesced over the warp, any alignment,
//    elements at or past the tensor's end skipped (tail blocks, unaligned tensors, the norm pass):
//    for_each_strided_element.
// Once its lanes hold the block's new values, a block is quantized the same way everywhere: each
// lane's largest counted magnitude, the warp's maximum of those (the block's new absmax, which lane
// 0 stores), its reciprocal (block_scale), and each value's nearest code of value * reciprocal
// (store_codes8, code_of; the search is code_table.cuh's). The norm pass and quantization take
// their blocks in a grid-stride walk (for_each_warp_block).
//
// What stays with each kernel, and why:
//  * what a value is (a quantized input; an algorithm's updated moment) and which count toward the
//    absmax (finite_abs of each input; all of an element's moments finite, counts_for_absmax);
//  * the 8-bit step's schedule: each warp owns one contiguous run of blocks and prefetches the next
//    block into L2 while it works on the current one. The grid-stride walk of the other kernels
//    would lose that prefetch's distance of one block (the walk's next block is a grid away);
//  * the 8-bit step's strided path computes each element's update twice (the first pass finds the
//    absmaxes, the second writes): holding 8 elements' moments like the vector path would need the
//    loop unrolled with all 8 updates in registers, a different register budget on a rare path;
//  * the norm pass sums in double, lane by lane in the strided layout, then over the warp by
//    shuffles: its rounding (bit for bit) depends on that order;
//  * the 32-bit step (fp32_state_step_kernel, quantized_step.cu), which quantizes nothing, keeps its
//    loops written out: through these helpers the compiler addresses the parameters differently
//    (an extra integer add per block for Adam and LAMB, per two elements for AdEMAMix, with float32
//    parameters), a change of its hot loop that could not be timed here.
// Written with the helpers, the other kernels' code is what it was: their PTX holds the same
// instructions (a few independent ones in another order, in the strided paths), with the same
// register counts and no spills.
#include <cstdint>

#include "code_table.cuh"
#include "element_io.cuh"
#include "pagedopt/codebook.h"
#include "pagedopt/common.h"

namespace pagedopt {
namespace cuda_detail {

constexpr int kBlock = static_cast<int>(kStateBlockSize);
constexpr int kLaneElems = kBlock / kWarp;
static_assert(kLaneElems == 8, "one warp per 256-element block, 8 elements per lane");

// The largest of the lanes' non-negative, non-NaN floats: their bit patterns order as unsigned
// integers, so one warp reduction instruction does it. The kernels pass finite_abs maxima (finite,
// >= 0: +inf, whose pattern is above every finite one, never reaches it).
__device__ __forceinline__ float warp_max_nonneg(float x) {
  return __uint_as_float(__reduce_max_sync(kFullMask, __float_as_uint(x)));
}

// The grid-stride walk: warp w of the grid (kWarpsPerCta warps per thread block) takes the blocks
// w, w + W, w + 2 W, ... below `nblocks`, W being the grid's number of warps: body(b, W) for each.
template <int kWarpsPerCta, typename Body>
__device__ __forceinline__ void for_each_warp_block(int64_t nblocks, Body&& body) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp; b < nblocks; b += warps) {
    body(b, warps);
  }
}

// The strided layout: body(k, i) for the lane's elements i = lo + 32 k + lane below n, k = 0..7
// (lo: the block's first element, n: the tensor's size, read where the caller keeps it, e.g. in the
// kernels' metadata table). kUnroll: the loop's unroll factor, 1 for none (a long body kept once),
// 0 for the compiler's choice (no pragma).
template <int kUnroll, typename Body>
__device__ __forceinline__ void for_each_strided_element(int64_t lo, const int64_t& n, int lane, Body&& body) {
  if constexpr (kUnroll == 0) {
    for (int k = 0; k < kLaneElems; ++k) {
      const int64_t i = lo + k * kWarp + lane;
      if (i < n) body(k, i);
    }
  } else {
#pragma unroll(kUnroll > 0 ? kUnroll : 1)
    for (int k = 0; k < kLaneElems; ++k) {
      const int64_t i = lo + k * kWarp + lane;
      if (i < n) body(k, i);
    }
  }
}

// A block's new absmax, the warp's maximum of its lanes' largest counted magnitudes (each lane
// passes its own), and the reciprocal that the block's values are normalized by.
struct BlockScale {
  float absmax;
  float inv;
};

__device__ __forceinline__ BlockScale block_scale(float lane_max) {
  const float absmax = warp_max_nonneg(lane_max);
  return BlockScale{absmax, absmax_reciprocal(absmax)};
}

// The vector layout's codes: the lane's 8 values, times `inv`, as their 8 nearest codes (in `sc`)
// in one 8-byte streaming store at `codes` (the lane's first element, 8-byte aligned).
template <bool kFast>
__device__ __forceinline__ void store_codes8(uint8_t* codes, const SmemCode& sc, const float (&v)[8], float inv) {
  __stcs(reinterpret_cast<uint2*>(codes), sc.template nearest8<kFast>(v, inv));
}

// The strided layout's codes, one at a time: the nearest code (in `sc`) of v * inv.
template <bool kFast>
__device__ __forceinline__ uint8_t code_of(const SmemCode& sc, float v, float inv) {
  return static_cast<uint8_t>(sc.template nearest<kFast>(v * inv));
}

}  // namespace cuda_detail
}  // namespace pagedopt
