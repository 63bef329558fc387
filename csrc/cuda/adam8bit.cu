// CUDA fused 8-bit Adam/AdamW step over a list of tensors, in a handful of launches.
//
// The element math is pagedopt/adam.h, as on the CPU: the states (codes and absmax) come out bit
// for bit as the CPU's, the parameters within 2^-20 of the update (the GPU's approximate sqrt and
// division; see adam.h). The step-independent constants come from the header's
// adam_step_constants evaluated on the host; the two step-dependent ones are computed on the
// device from steps[i] in double (see pow_step in multi_tensor.cuh for the one caveat).
//
// Launches per call: one H2D copy of a metadata table (pinned, non_blocking), one setup kernel
// (codebook search tables + per-tensor bias corrections), and one step kernel per param dtype.
// In the step kernel one warp owns one 256-element block: 8 consecutive elements per lane,
// vector loads/stores, one warp reduction per absmax, and the codes written after the new absmax
// is known. Dequantization reads a 32-way replicated codebook (lane l reads copy l: no bank
// conflicts); quantization one table entry per value (multi_tensor.cuh), branch-free.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "multi_tensor.cuh"
#include "pagedopt/adam.h"
#include "launch.h"
#include "pagedopt/codebook.h"

namespace pagedopt {
namespace {

using namespace cuda_detail;

// One 1024-thread block per SM (64 registers a thread): the replicated codebooks and the two
// search tables take 130 KB of shared memory, too much for two blocks.
constexpr int kThreads = 1024;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int kBlock = static_cast<int>(kStateBlockSize);
static_assert(kBlock == 8 * kWarp, "one warp per 256-element block, 8 elements per lane");

// Replicated codebooks for dequantization: rep[q * 32 + lane] == code[q], so the 32 lanes of a
// warp always read 32 different banks.
constexpr size_t kRepBytes = size_t{kCodebookSize} * kWarp * sizeof(float);
constexpr size_t kCode1Offset = 2 * kRepBytes;
constexpr size_t kCode2Offset = kCode1Offset + kSmemCodeBytes;
constexpr size_t kAdamSmemBytes = kCode2Offset + kSmemCodeBytes;

// One entry per non-empty tensor, filled on the host.
struct AdamTensorMeta {
  void* p;
  const void* g;
  uint8_t* q1;
  uint8_t* q2;
  float* a1;
  float* a2;
  const float* step;
  int64_t numel;
  int64_t vec_ok;  // p, g 16-byte aligned and q1, q2 8-byte aligned
};

// Per-tensor constants that depend on the step (written by the setup kernel).
struct alignas(8) StepConsts {
  float step_size;
  float inv_bc2;  // 1 / sqrt(1 - beta2^t)
};

struct AdamKernelArgs {
  const AdamTensorMeta* meta;  // this dtype group's tensors
  const StepConsts* consts;    // parallel to meta
  const int64_t* starts;       // ntensors + 1 prefix sums of block counts
  int ntensors;
  int64_t total_blocks;
  const float* code1;
  const float* code2;
  const CodeTable* tables;  // [2]
  const float* grad_scale;  // nullptr when absent
  const float* found_inf;   // nullptr when absent
  AdamStepConstants c;      // step-independent fields only
};

// ---------------------------------------------------------------------------------------------
// Setup: blocks [0, 2 * kTableBlocks) build the two codebooks' search tables, the rest compute
// step_size and 1 / sqrt(1 - beta2^t) for each tensor from its device step count.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kTableThreads) adam_setup_kernel(const float* __restrict__ code1,
                                                                     const float* __restrict__ code2,
                                                                     CodeTable* __restrict__ tables,
                                                                     const AdamTensorMeta* __restrict__ meta,
                                                                     int ntensors, StepConsts* __restrict__ consts,
                                                                     double lr, double beta1, double beta2) {
  if (blockIdx.x < 2 * kTableBlocks) {
    const int which = blockIdx.x / kTableBlocks;
    build_code_table_block(which == 0 ? code1 : code2, tables + which, blockIdx.x % kTableBlocks);
    return;
  }
  const int i = (blockIdx.x - 2 * kTableBlocks) * blockDim.x + threadIdx.x;
  if (i >= ntensors) return;
  const double t = static_cast<double>(*meta[i].step);
  StepConsts s;
  adam_bias_constants(lr, pow_step(beta1, t), pow_step(beta2, t), s.step_size, s.inv_bc2);
  consts[i] = s;
}

// What a warp needs of its current tensor. Re-read from the (L1-resident) metadata for every
// block rather than kept in registers across blocks.
struct TensorView {
  void* p;
  const void* g;
  uint8_t* q1;
  uint8_t* q2;
  float* a1;
  float* a2;
  int64_t numel;
  bool vec_ok;
  StepConsts s;
};

__device__ __forceinline__ TensorView load_tensor(const AdamKernelArgs& args, int t) {
  const AdamTensorMeta* m = args.meta + t;
  TensorView v;
  v.p = m->p;
  v.g = m->g;
  v.q1 = m->q1;
  v.q2 = m->q2;
  v.a1 = m->a1;
  v.a2 = m->a2;
  v.numel = m->numel;
  v.vec_ok = m->vec_ok != 0;
  v.s = args.consts[t];
  return v;
}

// The tensor owning global block `gb`: the last t with starts[t] <= gb (32-way search by a warp).
__device__ __forceinline__ int find_tensor(const int64_t* __restrict__ starts, int n, int64_t gb, int lane) {
  int lo = 0;
  int hi = n;  // starts[lo] <= gb < starts[hi]
  while (hi - lo > 1) {
    const int stride = (hi - lo + kWarp - 1) / kWarp;
    const int idx = lo + lane * stride;
    const bool le = idx < hi && starts[idx] <= gb;
    const unsigned ball = __ballot_sync(kFullMask, le);  // lane 0 is always set
    const int last = kWarp - 1 - __clz(ball);
    lo += last * stride;
    hi = min(hi, lo + stride);
  }
  return lo;
}

// What the element loop reads from shared memory.
struct SmemView {
  uint32_t rep1;  // shared address of this lane's column of the replicated codebooks: + (q << 7)
  uint32_t rep2;
  SmemCode sc1;
  SmemCode sc2;
};

// One element: dequantize the moments (dequantize_value, from this lane's copy of the codebook),
// then adam_update.
template <bool kHasScale>
__device__ __forceinline__ float adam_element(float p, float g, float& m, float& v, uint32_t q1, uint32_t q2,
                                              float a1, float a2, const SmemView& sm, const AdamStepConstants& c,
                                              float inv_scale) {
  m = lds_f32(sm.rep1 + (q1 << 7)) * a1;
  v = lds_f32(sm.rep2 + (q2 << 7)) * a2;
  return adam_update(p, kHasScale ? g * inv_scale : g, m, v, c);
}

// The lanes ask L2 for block lb's params, grads and codes, one 128-byte line each, so that the
// warp's loads of them (after it has finished the current block) hit L2 instead of waiting for HBM.
template <typename T>
__device__ __forceinline__ void prefetch_block(const TensorView& tv, int64_t lb, int lane) {
  constexpr int kLine = 128;
  constexpr int kParamLines = kBlock * static_cast<int>(sizeof(T)) / kLine;
  constexpr int kCodeLines = kBlock / kLine;
  static_assert(2 * kParamLines + 2 * kCodeLines <= kWarp, "one line per lane");
  const int64_t i0 = lb * kBlock;
  const char* base;
  int line = lane;
  if (line < kParamLines) {
    base = reinterpret_cast<const char*>(static_cast<const T*>(tv.p) + i0);
  } else if ((line -= kParamLines) < kParamLines) {
    base = reinterpret_cast<const char*>(static_cast<const T*>(tv.g) + i0);
  } else if ((line -= kParamLines) < kCodeLines) {
    base = reinterpret_cast<const char*>(tv.q1 + i0);
  } else if ((line -= kCodeLines) < kCodeLines) {
    base = reinterpret_cast<const char*>(tv.q2 + i0);
  } else {
    return;
  }
  prefetch_l2(base + line * kLine);
}

// A full, aligned block: lane owns elements [8 lane, 8 lane + 8), vector loads and stores.
template <typename T, bool kHasScale, bool kFast>
__device__ __forceinline__ void adam_block_full(const TensorView& tv, int64_t lb, int lane, const SmemView& sm,
                                                const AdamStepConstants& c, float inv_scale) {
  const int64_t i0 = lb * kBlock + lane * 8;
  T* p = static_cast<T*>(tv.p) + i0;
  float pv[8];
  float gv[8];
  Elem<T>::load8(p, pv);
  Elem<T>::load8(static_cast<const T*>(tv.g) + i0, gv);
  const uint2 w1 = __ldcs(reinterpret_cast<const uint2*>(tv.q1 + i0));
  const uint2 w2 = __ldcs(reinterpret_cast<const uint2*>(tv.q2 + i0));
  const float a1 = tv.a1[lb];
  const float a2 = tv.a2[lb];
  float m[8];
  float v[8];
  float mx1 = 0.0f;
  float mx2 = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    pv[k] = adam_element<kHasScale>(pv[k], gv[k], m[k], v[k], byte_of(w1, k), byte_of(w2, k), a1, a2, sm, c,
                                    inv_scale);
    float t1;
    float t2;
    adam_absmax_terms(m[k], v[k], t1, t2);  // an element with a non-finite v counts for neither
    mx1 = fmaxf(mx1, t1);
    mx2 = fmaxf(mx2, t2);
  }
  Elem<T>::store8(p, pv);
  mx1 = warp_max_nonneg(mx1);
  mx2 = warp_max_nonneg(mx2);
  __stcs(reinterpret_cast<uint2*>(tv.q1 + i0), sm.sc1.template nearest8<kFast>(m, absmax_reciprocal(mx1)));
  __stcs(reinterpret_cast<uint2*>(tv.q2 + i0), sm.sc2.template nearest8<kFast>(v, absmax_reciprocal(mx2)));
  if (lane == 0) {  // every lane has read a1/a2 before the reductions above
    tv.a1[lb] = mx1;
    tv.a2[lb] = mx2;
  }
}

// A tail block, or any block of a tensor whose pointers are not aligned for vector access:
// element lo + k * 32 + lane (coalesced scalar accesses), not unrolled. Two passes over the
// inputs: the first finds the new absmax, the second recomputes the (deterministic) update and
// writes everything; nothing is written before the second pass reads it.
template <typename T, bool kHasScale, bool kFast>
__device__ __forceinline__ void adam_block_partial(const TensorView& tv, int64_t lb, int lane, const SmemView& sm,
                                                   const AdamStepConstants& c, float inv_scale) {
  const int64_t lo = lb * kBlock;
  T* p = static_cast<T*>(tv.p);
  const T* g = static_cast<const T*>(tv.g);
  const float a1 = tv.a1[lb];
  const float a2 = tv.a2[lb];
  float mx1 = 0.0f;
  float mx2 = 0.0f;
#pragma unroll 1
  for (int k = 0; k < 8; ++k) {
    const int64_t i = lo + k * kWarp + lane;
    if (i < tv.numel) {
      float m;
      float v;
      adam_element<kHasScale>(Elem<T>::load(p + i), Elem<T>::load(g + i), m, v, tv.q1[i], tv.q2[i], a1, a2, sm, c,
                              inv_scale);
      float t1;
      float t2;
      adam_absmax_terms(m, v, t1, t2);
      mx1 = fmaxf(mx1, t1);
      mx2 = fmaxf(mx2, t2);
    }
  }
  mx1 = warp_max_nonneg(mx1);
  mx2 = warp_max_nonneg(mx2);
  const float inv1 = absmax_reciprocal(mx1);
  const float inv2 = absmax_reciprocal(mx2);
#pragma unroll 1
  for (int k = 0; k < 8; ++k) {
    const int64_t i = lo + k * kWarp + lane;
    if (i < tv.numel) {
      float m;
      float v;
      const float pn = adam_element<kHasScale>(Elem<T>::load(p + i), Elem<T>::load(g + i), m, v, tv.q1[i], tv.q2[i],
                                               a1, a2, sm, c, inv_scale);
      Elem<T>::store(p + i, pn);
      tv.q1[i] = static_cast<uint8_t>(sm.sc1.template nearest<kFast>(m * inv1));
      tv.q2[i] = static_cast<uint8_t>(sm.sc2.template nearest<kFast>(v * inv2));
    }
  }
  __syncwarp();
  if (lane == 0) {  // every lane has read a1/a2 (first lines) before the reductions above
    tv.a1[lb] = mx1;
    tv.a2[lb] = mx2;
  }
}

// Warp w of the grid owns the contiguous run of global blocks [w * chunk, (w + 1) * chunk): it
// finds its first tensor by a search over `starts`, then walks on. Block indices fit in 32 bits
// (checked on the host); element indices are 64-bit.
template <typename T, bool kHasScale, bool kFast>
__device__ __forceinline__ void adam_warp_loop(const AdamKernelArgs& args, const SmemView& sm) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  const int warps = gridDim.x * kWarpsPerBlock;
  const int64_t chunk = ceil_div(args.total_blocks, static_cast<int64_t>(warps));
  const int64_t first = warp * chunk;
  if (first >= args.total_blocks) return;
  int b = static_cast<int>(first);  // < total_blocks < 2^31
  const int end = static_cast<int>(min(args.total_blocks, first + chunk));
  const float inv_scale = kHasScale ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  AdamStepConstants c = args.c;
  int t = find_tensor(args.starts, args.ntensors, b, lane);
  int t_begin = static_cast<int>(args.starts[t]);
  int t_end = static_cast<int>(args.starts[t + 1]);
  for (; b < end; ++b) {
    if (b >= t_end) {  // tensors have at least one block, so one step suffices
      ++t;
      t_begin = t_end;
      t_end = static_cast<int>(args.starts[t + 1]);
    }
    const TensorView tv = load_tensor(args, t);
    c.step_size = tv.s.step_size;
    c.inv_bias_correction2_sqrt = tv.s.inv_bc2;
    const int64_t lb = b - t_begin;
    if ((lb + 2) * kBlock <= tv.numel && b + 1 < end) prefetch_block<T>(tv, lb + 1, lane);  // the warp's next block
    if (tv.vec_ok && (lb + 1) * kBlock <= tv.numel) {
      adam_block_full<T, kHasScale, kFast>(tv, lb, lane, sm, c, inv_scale);
    } else {
      adam_block_partial<T, kHasScale, kFast>(tv, lb, lane, sm, c, inv_scale);
    }
  }
}

template <typename T, bool kHasScale>
__global__ void __launch_bounds__(kThreads, 1) adam8bit_kernel(const AdamKernelArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // block-uniform
  extern __shared__ __align__(16) unsigned char smem[];
  float* rep1 = reinterpret_cast<float*>(smem);
  float* rep2 = rep1 + kCodebookSize * kWarp;
  for (int i = threadIdx.x; i < kCodebookSize * kWarp; i += kThreads) {
    rep1[i] = args.code1[i / kWarp];
    rep2[i] = args.code2[i / kWarp];
  }
  const bool fast1 = load_smem_code(smem + kCode1Offset, args.code1, args.tables);
  const bool fast2 = load_smem_code(smem + kCode2Offset, args.code2, args.tables + 1);
  const int lane = threadIdx.x % kWarp;
  const SmemView sm{smem_addr(rep1 + lane), smem_addr(rep2 + lane), smem_code_view(smem + kCode1Offset),
                    smem_code_view(smem + kCode2Offset)};
  if (fast1 && fast2) {
    adam_warp_loop<T, kHasScale, true>(args, sm);
  } else {
    adam_warp_loop<T, kHasScale, false>(args, sm);
  }
}

// Per device: dynamic shared memory opted in.
template <typename T, bool kHasScale>
void prepare_kernel(int device) {
  static std::atomic<bool> ready[64] = {};
  TORCH_CHECK(device >= 0 && device < 64, "adam8bit_step_: device index ", device, " out of range");
  if (ready[device].load(std::memory_order_relaxed)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(adam8bit_kernel<T, kHasScale>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kAdamSmemBytes)));
  ready[device].store(true, std::memory_order_relaxed);
}

template <typename T, bool kHasScale>
void launch_group(const AdamKernelArgs& args, int device, cudaStream_t stream) {
  prepare_kernel<T, kHasScale>(device);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = ceil_div(args.total_blocks, int64_t{kWarpsPerBlock});
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms})));
  adam8bit_kernel<T, kHasScale><<<grid, kThreads, kAdamSmemBytes, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void adam8bit_step_cuda_unchecked(at::TensorList params, at::TensorList grads, at::TensorList state1, at::TensorList state2,
                        at::TensorList absmax1, at::TensorList absmax2, at::TensorList steps,
                        const at::Tensor& code1, const at::Tensor& code2, double lr, double beta1, double beta2,
                        double eps, double weight_decay, bool decoupled, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "adam8bit_step_: the CUDA kernel got tensors on ", device);
  const c10::cuda::CUDAGuard guard(device);

  // Group the non-empty tensors by dtype: one step kernel per dtype.
  constexpr int kGroups = 3;
  const at::ScalarType group_dtype[kGroups] = {at::kFloat, at::kBFloat16, at::kHalf};
  std::vector<size_t> members[kGroups];
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    for (int gi = 0; gi < kGroups; ++gi) {
      if (params[i].scalar_type() == group_dtype[gi]) members[gi].push_back(i);
    }
  }
  size_t total = 0;
  for (const auto& mlist : members) total += mlist.size();
  if (total == 0) return;
  TORCH_CHECK(total < (size_t{1} << 30), "adam8bit_step_: too many tensors (", total, ")");

  // Host metadata: [meta: total entries][starts: per group, n_g + 1 entries].
  const size_t meta_bytes = total * sizeof(AdamTensorMeta);
  const size_t starts_bytes = (total + kGroups) * sizeof(int64_t);
  const int64_t bytes = static_cast<int64_t>(meta_bytes + starts_bytes);
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* hmeta = reinterpret_cast<AdamTensorMeta*>(host.data_ptr());
  auto* hstarts = reinterpret_cast<int64_t*>(static_cast<uint8_t*>(host.data_ptr()) + meta_bytes);
  size_t meta_off[kGroups];
  size_t starts_off[kGroups];
  int64_t group_blocks[kGroups];
  size_t mi = 0;
  size_t si = 0;
  for (int gi = 0; gi < kGroups; ++gi) {
    meta_off[gi] = mi;
    starts_off[gi] = si;
    int64_t acc = 0;
    hstarts[si++] = 0;
    for (size_t i : members[gi]) {
      AdamTensorMeta& m = hmeta[mi++];
      m.p = params[i].data_ptr();
      m.g = grads[i].data_ptr();
      m.q1 = state1[i].data_ptr<uint8_t>();
      m.q2 = state2[i].data_ptr<uint8_t>();
      m.a1 = absmax1[i].data_ptr<float>();
      m.a2 = absmax2[i].data_ptr<float>();
      m.step = steps[i].data_ptr<float>();
      m.numel = params[i].numel();
      const auto addr = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); };
      m.vec_ok = (addr(m.p) % 16 == 0 && addr(m.g) % 16 == 0 && addr(m.q1) % 8 == 0 && addr(m.q2) % 8 == 0) ? 1 : 0;
      acc += ceil_div(m.numel, kStateBlockSize);
      hstarts[si++] = acc;
    }
    group_blocks[gi] = acc;
    TORCH_CHECK(acc < (int64_t{1} << 31), "adam8bit_step_: more than 2^31 blocks of ", kStateBlockSize,
                " elements of one dtype in one call");
  }
  const auto byte_opts = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor dev = at::empty({bytes}, byte_opts);
  dev.copy_(host, /*non_blocking=*/true);  // the caching host allocator keeps `host` alive until it is done
  const auto* dmeta = reinterpret_cast<const AdamTensorMeta*>(dev.data_ptr());
  const auto* dstarts = reinterpret_cast<const int64_t*>(static_cast<const uint8_t*>(dev.data_ptr()) + meta_bytes);

  // Work buffer: [2 code tables][step constants per tensor].
  at::Tensor work = at::empty({static_cast<int64_t>(2 * sizeof(CodeTable) + total * sizeof(StepConsts))}, byte_opts);
  auto* tables = reinterpret_cast<CodeTable*>(work.data_ptr());
  auto* consts = reinterpret_cast<StepConsts*>(static_cast<uint8_t*>(work.data_ptr()) + 2 * sizeof(CodeTable));

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int const_blocks = static_cast<int>(ceil_div(static_cast<int64_t>(total), kTableThreads));
  adam_setup_kernel<<<2 * kTableBlocks + const_blocks, kTableThreads, 0, stream>>>(
      code1.data_ptr<float>(), code2.data_ptr<float>(), tables, dmeta, static_cast<int>(total), consts, lr, beta1,
      beta2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // The step-independent constants, computed by the header on the host exactly as the CPU does.
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled};
  AdamKernelArgs args;
  args.c = adam_step_constants(h, 1.0f);
  args.c.step_size = 0.0f;  // per tensor, from consts
  args.c.inv_bias_correction2_sqrt = 0.0f;
  args.code1 = code1.data_ptr<float>();
  args.code2 = code2.data_ptr<float>();
  args.tables = tables;
  args.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  args.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  const int device_index = device.index();
  for (int gi = 0; gi < kGroups; ++gi) {
    if (members[gi].empty()) continue;
    args.meta = dmeta + meta_off[gi];
    args.consts = consts + meta_off[gi];
    args.starts = dstarts + starts_off[gi];
    args.ntensors = static_cast<int>(members[gi].size());
    args.total_blocks = group_blocks[gi];
    const bool has_scale = args.grad_scale != nullptr;
    switch (group_dtype[gi]) {
      case at::kFloat:
        has_scale ? launch_group<float, true>(args, device_index, stream)
                  : launch_group<float, false>(args, device_index, stream);
        break;
      case at::kBFloat16:
        has_scale ? launch_group<c10::BFloat16, true>(args, device_index, stream)
                  : launch_group<c10::BFloat16, false>(args, device_index, stream);
        break;
      case at::kHalf:
        has_scale ? launch_group<c10::Half, true>(args, device_index, stream)
                  : launch_group<c10::Half, false>(args, device_index, stream);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false);
    }
  }
}


}  // namespace pagedopt
