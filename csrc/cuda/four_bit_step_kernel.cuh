#pragma once
// The engine's 4-bit step kernel (csrc/cuda/quantized_step.cu launches it through
// launch_four_bit_step), generic over the algorithm (pagedopt/algorithms.h) and the parameter
// dtype. The states' layout is pagedopt/four_bit.h's: two codes a byte (element i in byte i / 2,
// low nibble for an even i), one absmax per 128-element block, a 16-entry codebook per state key.
// The norm pass of LARS and LAMB on 4-bit states is four_bit_norm_kernel.cuh's.
//
// Work: a warp takes tiles of 256 elements, two 128-blocks of one tensor (the host counts each
// tensor's tiles; a tensor of an odd number of blocks ends with a tile of one). As the 8-bit kernel
// does it, warp w of the grid owns the contiguous run of tiles [w * chunk, (w + 1) * chunk) over
// the concatenated tensors, finds its first tensor once, walks on, and asks L2 for its next tile's
// lines while it works on the current one. One thread block of 1024 (768 for three moments) threads
// per SM. Lane l owns elements [8 l, 8 l + 8) of the tile: lanes 0-15 the first block, 16-31 the
// second. A full tile of a tensor aligned for it (p, g 16-byte aligned, each moment's codes 4-byte
// aligned) reads 8 params and 8 grads with one (16-bit) or two (fp32) 16-byte vector loads each, and
// each moment's 8 codes with one 4-byte load; stores likewise. Any other tile (the tensor's last one
// when it is not full, every tile of a tensor not so aligned) takes the same lane layout element by
// element, skipping the elements at or past the tensor's end.
//
// Per tile and moment: the lane dequantizes its 8 codes by shuffles from a 16-entry table of its
// group, code[q] * absmax (lane q of the group holds entry q: one multiply per lane instead of one
// per element, and no shared-memory load); update() per element; the block's new absmax is one
// maximum over its 16 lanes (two reductions of the warp); the 8 new codes come from the codebook's
// search table (code_table4.cuh: a saturating multiply, a shared load and an add per value) in one
// 4-byte store (the last key's codebook, when it has no negative code, the maps of second moments:
// by the search without sign, two instructions less per value). A codebook that does not fit the
// table (a custom qmap) is searched with nearest_code4 itself, as are the partial tiles. Every
// lane reads its block's old absmax before the group's reduction, and the group's first lane
// writes the new one after it, so nothing is written before it is read; a lane reads and writes
// only its own code bytes.
//
// Cost (sm_90 SASS of Adam, a full tile, bf16 parameters): about 450 instructions per lane and
// tile, 56 per element, against 64 for the 8-bit kernel's full block (the old 4-bit kernel, a warp
// per 128-block with a binary search of the codebook per value, took about 150); no spills but in
// the loop of stochastic rounding (and a few reloads of loop invariants per tile with fp32 and
// three moments).
//
// Bit for bit as the CPU: code * absmax and x * (1 / absmax) are each rounded once (__fmul_rn, and
// the table search returns nearest_code4 of the rounded product), the update is the same functor,
// an element counts toward its block's absmax only if its new moments are finite
// (element_counts_for_absmax), and a bf16 parameter rounded stochastically takes the random bits of
// its index (store8_param, store_param).
#include <c10/cuda/CUDAException.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "code_table4.cuh"
#include "eight_bit_step_kernel.cuh"
#include "element_io.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/codebook.h"
#include "pagedopt/four_bit.h"
#include "warp_block.cuh"

namespace pagedopt {
namespace cuda_detail {

constexpr int kBlock4 = static_cast<int>(kStateBlockSize4);  // 128 elements per absmax
constexpr int kTile4 = 2 * kBlock4;                         // a warp's unit of work
constexpr int kLane4 = kTile4 / kWarp;                      // elements per lane
constexpr int kGroup4 = kBlock4 / kLane4;                   // lanes per 128-block
static_assert(kLane4 == 8 && kGroup4 == 16, "two 128-blocks per warp, 8 elements per lane, 16 lanes per block");

// As the 8-bit kernel: 1024 threads of at most 64 registers, 768 for three moments (AdEMAMix).
template <typename Algo>
constexpr int four_bit_threads() {
  return Algo::kMoments > 2 ? 768 : 1024;
}

// Shared memory: [K search tables][K codebooks].
template <int K>
constexpr size_t four_bit_smem_bytes() {
  return K * (sizeof(CodeTable4) + kCodebookSize4 * sizeof(float));
}

// Moment j's packed codes and absmax of tensor m (key_of(j), at stack index stack_of(j)).
template <typename Algo>
__device__ __forceinline__ uint8_t* moment_codes4(const TensorMeta& m, int j) {
  return static_cast<uint8_t*>(m.state[Algo::key_of(j)]) + Algo::stack_of(j) * packed_bytes(m.numel);
}
template <typename Algo>
__device__ __forceinline__ float* moment_absmax4(const TensorMeta& m, int j) {
  return m.absmax[Algo::key_of(j)] + Algo::stack_of(j) * ceil_div(m.numel, kStateBlockSize4);
}

// The step kernel's dynamic shared memory: [K search tables][K codebooks]. Addressed from the
// symbol, so that the addresses are constants rather than registers.
extern __shared__ __align__(16) unsigned char four_bit_smem[];

__device__ __forceinline__ uint32_t smem4_table(int key) {
  return smem_addr(four_bit_smem) + static_cast<uint32_t>(key * sizeof(CodeTable4));
}
template <int K>
__device__ __forceinline__ const float* smem4_code(int key) {
  return reinterpret_cast<const float*>(four_bit_smem + K * sizeof(CodeTable4)) + key * kCodebookSize4;
}

// The lane's 8 elements [i0, i0 + 8) as floats: kFull: vector loads (p + i0 16-byte aligned), else
// one at a time, the first `valid` of them, 0 past them.
template <typename T, bool kFull>
__device__ __forceinline__ void load_lane8(const T* p, int64_t i0, int valid, float (&x)[kLane4]) {
  if constexpr (kFull) {
    Elem<T>::load8(p + i0, x);
  } else {
#pragma unroll
    for (int k = 0; k < kLane4; ++k) x[k] = k < valid ? Elem<T>::load(p + i0 + k) : 0.0f;
  }
}

// The lane's 8 codes of one moment, code k in bits [4 k, 4 k + 4) (the packed layout's order):
// its 4 bytes from byte i0 / 2, kFull: one 4-byte load; else the bytes that hold elements below
// `valid`, zeros for the others.
template <bool kFull>
__device__ __forceinline__ uint32_t load_codes8(const uint8_t* codes, int64_t i0, int valid) {
  const uint8_t* at = codes + (i0 >> 1);
  if constexpr (kFull) {
    return __ldcs(reinterpret_cast<const unsigned int*>(at));
  } else {
    uint32_t w = 0;
#pragma unroll
    for (int b = 0; b < kLane4 / 2; ++b) {
      if (2 * b < valid) w |= static_cast<uint32_t>(at[b]) << (8 * b);
    }
    return w;
  }
}

// The lane's 8 new codes into the bytes load_codes8 read; a partial lane's codes at or past
// `valid` are 0 (an odd n's padding nibble, as on the CPU).
template <bool kFull>
__device__ __forceinline__ void store_codes8_4(uint8_t* codes, int64_t i0, int valid, uint32_t q) {
  uint8_t* at = codes + (i0 >> 1);
  if constexpr (kFull) {
    __stcs(reinterpret_cast<unsigned int*>(at), q);
  } else {
    if (valid < kLane4) q &= (1u << (4 * valid)) - 1u;
#pragma unroll
    for (int b = 0; b < kLane4 / 2; ++b) {
      if (2 * b < valid) at[b] = static_cast<uint8_t>(q >> (8 * b));
    }
  }
}

// The code of s * inv in the top byte (code_table4.cuh's table4_sum, with the saturating multiply
// and the table at shared address `table`); kSigned false: the search without sign, for a
// codebook4_unsigned codebook.
template <bool kSigned>
__device__ __forceinline__ uint32_t table4_code_sum(uint32_t table, float s, float inv) {
  const auto entry = [table](uint32_t i) { return lds_u32(table + 4 * i); };
  return kSigned ? table4_sum(entry, mul_sat_abs(s, inv), sign_mask(s)) : table4_sum(entry, mul_sat(s, inv), 0u);
}

// The codes of 8 values times inv, packed as 8 nibbles (value k in bits [4 k, 4 k + 4)): from the
// search table (kFast; kSigned as table4_code_sum), else by nearest_code4.
template <bool kFast, bool kSigned>
__device__ __forceinline__ uint32_t nearest8_4(uint32_t table, const float* code, const float (&v)[kLane4],
                                               float inv) {
  if constexpr (kFast) {
    uint32_t e[kLane4];
#pragma unroll
    for (int k = 0; k < kLane4; ++k) e[k] = table4_code_sum<kSigned>(table, v[k], inv);
    // the top bytes (codes < 16) as bytes c0 | c1 << 8 | ..., then two codes per byte
    const uint32_t lo = top_bytes(e[0], e[1], e[2], e[3]);
    const uint32_t hi = top_bytes(e[4], e[5], e[6], e[7]);
    return __byte_perm(lo | (lo >> 4), hi | (hi >> 4), 0x6420u);
  } else {
    uint32_t q = 0;
#pragma unroll
    for (int k = 0; k < kLane4; ++k) q |= static_cast<uint32_t>(nearest_code4(code, __fmul_rn(v[k], inv))) << (4 * k);
    return q;
  }
}

// The largest x of the lane's group of 16 (group: 0 or 16), x >= 0: two reductions over the whole
// warp, the other group's lanes giving 0 (a reduction with a mask of the group, differing
// between the two halves of the warp, is compiled into a slower, serialized form).
__device__ __forceinline__ uint32_t group_max16(uint32_t x, int group) {
  const uint32_t first = __reduce_max_sync(kFullMask, group == 0 ? x : 0u);
  const uint32_t second = __reduce_max_sync(kFullMask, group == 0 ? 0u : x);
  return group == 0 ? first : second;
}

// One tile for one lane (see the top). kFull: a full tile of an aligned tensor (vector accesses);
// kFast: the codebooks fit their search tables; kUnsignedLast (with kFast): the last key's codebook
// takes the search without sign (codebook4_unsigned).
template <typename Algo, typename T, bool kFull, bool kFast, bool kUnsignedLast = false>
__device__ __forceinline__ void four_bit_tile(const TensorMeta& m, const typename Algo::Constants& c, int64_t tile,
                                              int lane, float inv_scale, const ParamRounding& rounding) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  const int64_t n = m.numel;
  const int64_t i0 = tile * kTile4 + lane * kLane4;  // the lane's first element
  const int64_t lb = 2 * tile + lane / kGroup4;      // its 128-block
  const int group = lane & kGroup4;                  // the first lane of its block's group
  int valid = kLane4;      // the lane's elements in the tensor: [i0, i0 + valid)
  bool has_block = true;   // the lane's block is in the tensor (a tile's second block may not be)
  if constexpr (!kFull) {
    valid = static_cast<int>(n - i0 < 0 ? 0 : (n - i0 < kLane4 ? n - i0 : kLane4));
    has_block = lb * kBlock4 < n;
  }
  T* p = static_cast<T*>(m.p);
  float pv[kLane4];
  float gv[kLane4];
  load_lane8<T, kFull>(p, i0, valid, pv);
  load_lane8<T, kFull>(static_cast<const T*>(m.g), i0, valid, gv);
  uint32_t w[M];
  float dq[M];  // code[lane % 16] * the block's old absmax: the group's dequantization table
#pragma unroll
  for (int j = 0; j < M; ++j) {
    w[j] = load_codes8<kFull>(moment_codes4<Algo>(m, j), i0, valid);
    const float old_absmax = has_block ? moment_absmax4<Algo>(m, j)[lb] : 0.0f;
    dq[j] = __fmul_rn(smem4_code<K>(Algo::key_of(j))[lane % kGroup4], old_absmax);
  }
  float s[kLane4][M];
  float mx[M];
#pragma unroll
  for (int j = 0; j < M; ++j) mx[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < kLane4; ++k) {
    // code q of element k from lane q of the lane's group (a shuffle within 16 lanes takes the
    // source's low 4 bits, the nibble)
#pragma unroll
    for (int j = 0; j < M; ++j) s[k][j] = __shfl_sync(kFullMask, dq[j], static_cast<int>(w[j] >> (4 * k)), kGroup4);
    pv[k] = Algo::update(pv[k], gv[k] * inv_scale, s[k], c);
    bool counts = element_counts_for_absmax<Algo>(s[k]);
    if constexpr (!kFull) counts = counts && k < valid;
    if (counts) {  // mx >= +0, so skipping an element is fmaxf(mx, 0), as the CPU's rule
#pragma unroll
      for (int j = 0; j < M; ++j) mx[j] = fmaxf(mx[j], fabsf(s[k][j]));
    }
  }
  if constexpr (kFull) {
    store8_param<T>(p + i0, pv, rounding, i0);
  } else {
#pragma unroll
    for (int k = 0; k < kLane4; ++k) {
      if (k < valid) store_param<T>(p + i0 + k, pv[k], rounding, i0 + k);  // this lane's elements only
    }
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    // the block's new absmax (finite, >= 0: ordered as unsigned integers, 0 the identity); every
    // lane of the group has read the old one before this
    mx[j] = __uint_as_float(group_max16(__float_as_uint(mx[j]), group));
    float col[kLane4];
#pragma unroll
    for (int k = 0; k < kLane4; ++k) col[k] = s[k][j];
    const int key = Algo::key_of(j);
    const float inv = absmax_reciprocal(mx[j]);
    const uint32_t q = kUnsignedLast && key == K - 1  // (decided at compile time: the loop is unrolled)
                           ? nearest8_4<kFast, false>(smem4_table(key), smem4_code<K>(key), col, inv)
                           : nearest8_4<kFast, true>(smem4_table(key), smem4_code<K>(key), col, inv);
    store_codes8_4<kFull>(moment_codes4<Algo>(m, j), i0, valid, q);
  }
  if (lane % kGroup4 == 0 && has_block) {
#pragma unroll
    for (int j = 0; j < M; ++j) moment_absmax4<Algo>(m, j)[lb] = mx[j];
  }
}

// The lanes ask L2 for tile `tile`'s params, grads and codes, one 128-byte line each (a moment's
// 128 code bytes may straddle two lines: both are asked for).
template <typename Algo, typename T>
__device__ __forceinline__ void prefetch_tile4(const TensorMeta& m, int64_t tile, int lane) {
  constexpr int kLine = 128;
  constexpr int kParamLines = kTile4 * static_cast<int>(sizeof(T)) / kLine;
  constexpr int kCodeBytes = kTile4 / 2;
  static_assert(2 * kParamLines + 2 * Algo::kMoments <= kWarp, "one line per lane");
  const int64_t i0 = tile * kTile4;
  int line = lane;
  const char* at;
  if (line < kParamLines) {
    at = reinterpret_cast<const char*>(static_cast<const T*>(m.p) + i0) + line * kLine;
  } else if ((line -= kParamLines) < kParamLines) {
    at = reinterpret_cast<const char*>(static_cast<const T*>(m.g) + i0) + line * kLine;
  } else if ((line -= kParamLines) < 2 * Algo::kMoments) {
    at = reinterpret_cast<const char*>(moment_codes4<Algo>(m, line / 2) + (i0 >> 1)) + (line % 2) * (kCodeBytes - 1);
  } else {
    return;
  }
  prefetch_l2(at);
}

// The walk of warp w (see the top). kSr: bf16 parameters rounded stochastically, in a loop of its
// own (its hashes need registers that the loop without it keeps for its own values).
template <typename Algo, typename T, bool kSr>
__device__ __forceinline__ void four_bit_warp_loop(const StepArgs<Algo>& args, bool fast, bool unsigned_last) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int warps = gridDim.x * (blockDim.x / kWarp);
  const int64_t chunk = ceil_div(args.total_blocks, static_cast<int64_t>(warps));  // tiles
  const int64_t first = warp * chunk;
  if (first >= args.total_blocks) return;
  int b = static_cast<int>(first);  // < total tiles < 2^31
  const int end = static_cast<int>(min(args.total_blocks, first + chunk));
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  int t = find_tensor(args.starts, args.ntensors, b, lane);
  for (; b < end; ++b) {
    // the tensor's first tile read again at each tile rather than kept (two registers more for
    // the tile's values)
    if (b >= args.starts[t + 1]) ++t;  // tensors have at least one tile, so one step suffices
    const TensorMeta& m = args.meta[t];
    const int64_t tile = b - args.starts[t];
    if ((tile + 2) * kTile4 <= m.numel && b + 1 < end) prefetch_tile4<Algo, T>(m, tile + 1, lane);  // the next tile
    const ParamRounding rounding = kSr ? ParamRounding{args.sr_streams + t, m.sr_offset} : ParamRounding{nullptr, 0};
    const auto& c = args.consts[t];
    if (m.vec_ok != 0 && (tile + 1) * kTile4 <= m.numel) {  // warp-uniform, as `fast`
      if (fast && unsigned_last) {
        four_bit_tile<Algo, T, true, true, true>(m, c, tile, lane, inv_scale, rounding);
      } else if (fast) {
        four_bit_tile<Algo, T, true, true>(m, c, tile, lane, inv_scale, rounding);
      } else {
        four_bit_tile<Algo, T, true, false>(m, c, tile, lane, inv_scale, rounding);
      }
    } else {
      four_bit_tile<Algo, T, false, false>(m, c, tile, lane, inv_scale, rounding);
    }
  }
}

template <typename Algo, typename T>
__global__ void __launch_bounds__(four_bit_threads<Algo>(), 1) four_bit_step_kernel(const StepArgs<Algo> args) {
  constexpr int K = Algo::kKeys;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // grid-uniform
  auto* tables = reinterpret_cast<uint4*>(four_bit_smem);
  auto* codes = reinterpret_cast<float*>(four_bit_smem + K * sizeof(CodeTable4));
  constexpr int kQuads = static_cast<int>(sizeof(CodeTable4) / sizeof(uint4));
  bool ok = true;
  for (int i = threadIdx.x; i < K * kQuads; i += blockDim.x) {
    const uint4 e = reinterpret_cast<const uint4*>(args.tables4)[i];
    ok = ok && e.x != kBadEntry && e.y != kBadEntry && e.z != kBadEntry && e.w != kBadEntry;
    tables[i] = e;
  }
  for (int i = threadIdx.x; i < K * kCodebookSize4; i += blockDim.x) {
    codes[i] = args.qmap[i / kCodebookSize4][i % kCodebookSize4];
  }
  const bool fast = __syncthreads_and(ok) != 0;
  const bool unsigned_last = codebook4_unsigned(codes + (K - 1) * kCodebookSize4);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (args.sr_streams != nullptr) {  // as param_rounding: stochastic rounding of bf16 parameters
      four_bit_warp_loop<Algo, T, true>(args, fast, unsigned_last);
      return;
    }
  }
  four_bit_warp_loop<Algo, T, false>(args, fast, unsigned_last);
}

// The step's launch: one block per SM at most (dynamic shared memory opted in once per device).
template <typename Algo, typename T>
void launch_four_bit_step(const StepArgs<Algo>& args, int sms, int device, cudaStream_t stream) {
  constexpr int kThreads = four_bit_threads<Algo>();
  constexpr int kSmem = static_cast<int>(four_bit_smem_bytes<Algo::kKeys>());
  static std::atomic<bool> ready[64] = {};
  TORCH_CHECK(device >= 0 && device < 64, "quantized_step_: device index ", device, " out of range");
  if (!ready[device].load(std::memory_order_relaxed)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(four_bit_step_kernel<Algo, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kSmem));
    ready[device].store(true, std::memory_order_relaxed);
  }
  const int64_t want = ceil_div(args.total_blocks, int64_t{kThreads / kWarp});
  const int grid = static_cast<int>(want < sms ? (want < 1 ? 1 : want) : sms);
  four_bit_step_kernel<Algo, T><<<grid, kThreads, kSmem, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_detail
}  // namespace pagedopt
