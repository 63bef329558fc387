// CUDA kernel of the generic quantized-state engine: one fused step of any algorithm of
// pagedopt/algorithms.h over a list of tensors, 8-bit (blockwise codes) or 32-bit states.
//
// The element math is the algorithm's update() and the quantization is codebook.h's, as on the
// CPU, so the states come out bit for bit as the CPU's. One warp owns one 256-element block:
// element lo + k * 32 + lane for k < 8 (coalesced scalar accesses), moments kept in registers
// while the warp reduces the block's new absmax, then the codes written. Each warp computes its
// tensor's constants from the step tensor on the GPU (no host synchronisation). Codebooks are read
// from shared memory with codebook.h's nearest_code.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <string>
#include <vector>

#include "launch.h"
#include "multi_tensor.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/codebook.h"

namespace pagedopt {
namespace {

using namespace cuda_detail;

constexpr int kStepThreads = 256;
constexpr int kStepWarps = kStepThreads / kWarp;
constexpr int kMaxKeys = 2;

struct TensorMeta {
  void* p;
  const void* g;
  void* state[kMaxKeys];
  float* absmax[kMaxKeys];
  const float* step;
  const float* scale;  // the tensor's update scale (lars, lamb), or nullptr
  double* norm;        // the norm pass's output for the tensor, or nullptr
  int64_t numel;
};

struct StepArgs {
  const TensorMeta* meta;
  const int64_t* starts;  // ntensors + 1 prefix sums of block counts
  int ntensors;
  int64_t total_blocks;
  const float* qmap[kMaxKeys];
  const float* grad_scale;  // nullptr when absent
  const float* found_inf;   // nullptr when absent
  OptimizerHyper hyper;
};

// The tensor owning global block gb: the last t with starts[t] <= gb.
__device__ __forceinline__ int owner_of(const int64_t* __restrict__ starts, int n, int64_t gb) {
  int lo = 0;
  int hi = n;  // starts[lo] <= gb < starts[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (starts[mid] <= gb) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The codebooks of the 8-bit states into shared memory, then a barrier for the whole block.
template <int K, bool kEightBit>
__device__ __forceinline__ void load_codebooks(float (&s_code)[K][kCodebookSize], const StepArgs& args) {
  if (kEightBit) {
    for (int i = threadIdx.x; i < K * kCodebookSize; i += blockDim.x) {
      s_code[i / kCodebookSize][i % kCodebookSize] = args.qmap[i / kCodebookSize][i % kCodebookSize];
    }
  }
  __syncthreads();
}

// Block lb's absmax of each moment of tensor m (8-bit states; read by every lane before lane 0
// writes the new ones).
template <typename Algo, bool kEightBit>
__device__ __forceinline__ void load_block_absmax(const TensorMeta& m, int64_t lb, int64_t blocks,
                                                  float (&absmax)[Algo::kMoments]) {
#pragma unroll
  for (int j = 0; j < Algo::kMoments; ++j) {
    absmax[j] = kEightBit ? m.absmax[Algo::key_of(j)][Algo::stack_of(j) * blocks + lb] : 0.0f;
  }
}

// Element i's moments: codes dequantized with the block's absmax, or the 32-bit values.
template <typename Algo, bool kEightBit, int K>
__device__ __forceinline__ void load_moments(const TensorMeta& m, const float (&s_code)[K][kCodebookSize], int64_t i,
                                             int64_t n, const float (&absmax)[Algo::kMoments],
                                             float (&s)[Algo::kMoments]) {
#pragma unroll
  for (int j = 0; j < Algo::kMoments; ++j) {
    const int64_t at = Algo::stack_of(j) * n + i;
    if (kEightBit) {
      const uint8_t q = static_cast<const uint8_t*>(m.state[Algo::key_of(j)])[at];
      s[j] = dequantize_value(s_code[Algo::key_of(j)], q, absmax[j]);
    } else {
      s[j] = static_cast<const float*>(m.state[Algo::key_of(j)])[at];
    }
  }
}

template <typename Algo, typename T, bool kEightBit>
__global__ void __launch_bounds__(kStepThreads) quantized_step_kernel(const StepArgs args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // grid-uniform
  __shared__ float s_code[K][kCodebookSize];
  load_codebooks<K, kEightBit>(s_code, args);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kStepWarps;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kStepWarps + threadIdx.x / kWarp; b < args.total_blocks;
       b += warps) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const int64_t lb = b - args.starts[t];
    const int64_t n = m.numel;
    const int64_t blocks = ceil_div(n, kStateBlockSize);
    auto c = Algo::constants(args.hyper, static_cast<double>(*m.step));
    if constexpr (has_update_norm<Algo>::value) {
      if (m.scale != nullptr) c.update_scale = *m.scale;
    }
    T* p = static_cast<T*>(m.p);
    const T* g = static_cast<const T*>(m.g);
    float old_absmax[M];
    float new_absmax[M] = {};
    load_block_absmax<Algo, kEightBit>(m, lb, blocks, old_absmax);
    float s[8][M];
    const int64_t lo = lb * kStateBlockSize;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = lo + k * kWarp + lane;
      if (i < n) {
        load_moments<Algo, kEightBit>(m, s_code, i, n, old_absmax, s[k]);
        const float gf = Elem<T>::load(g + i) * inv_scale;
        Elem<T>::store(p + i, Algo::update(Elem<T>::load(p + i), gf, s[k], c));
        if (kEightBit) {
          if (counts_for_absmax(s[k])) {
#pragma unroll
            for (int j = 0; j < M; ++j) new_absmax[j] = fmaxf(new_absmax[j], fabsf(s[k][j]));
          }
        } else {
#pragma unroll
          for (int j = 0; j < M; ++j) static_cast<float*>(m.state[Algo::key_of(j)])[Algo::stack_of(j) * n + i] = s[k][j];
        }
      }
    }
    if (kEightBit) {
      float inv[M];
#pragma unroll
      for (int j = 0; j < M; ++j) {
        new_absmax[j] = warp_max_nonneg(new_absmax[j]);  // every lane has read old_absmax before this
        inv[j] = absmax_reciprocal(new_absmax[j]);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t i = lo + k * kWarp + lane;
        if (i < n) {
#pragma unroll
          for (int j = 0; j < M; ++j) {
            static_cast<uint8_t*>(m.state[Algo::key_of(j)])[Algo::stack_of(j) * n + i] =
                quantize_value(s_code[Algo::key_of(j)], s[k][j], inv[j]);
          }
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < M; ++j) m.absmax[Algo::key_of(j)][Algo::stack_of(j) * blocks + lb] = new_absmax[j];
      }
    }
  }
}

// The norm pass (quantized_update_norm_): each warp adds the squares of its block's update
// directions, in double, to its tensor's norm (one atomicAdd per block: the sum's rounding
// depends on the order of the blocks, so it may differ from the CPU's in the last bits).
template <typename Algo, typename T, bool kEightBit>
__global__ void __launch_bounds__(kStepThreads) update_norm_kernel(const StepArgs args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  __shared__ float s_code[K][kCodebookSize];
  load_codebooks<K, kEightBit>(s_code, args);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kStepWarps;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kStepWarps + threadIdx.x / kWarp; b < args.total_blocks;
       b += warps) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const int64_t lb = b - args.starts[t];
    const int64_t n = m.numel;
    const int64_t blocks = ceil_div(n, kStateBlockSize);
    const auto c = Algo::constants(args.hyper, static_cast<double>(*m.step));
    const T* p = static_cast<const T*>(m.p);
    const T* g = static_cast<const T*>(m.g);
    const int64_t lo = lb * kStateBlockSize;
    float old_absmax[M];
    load_block_absmax<Algo, kEightBit>(m, lb, blocks, old_absmax);
    double sum = 0.0;
    for (int k = 0; k < 8; ++k) {
      const int64_t i = lo + k * kWarp + lane;
      if (i < n) {
        float s[M];
        load_moments<Algo, kEightBit>(m, s_code, i, n, old_absmax, s);
        const double u = Algo::direction(Elem<T>::load(p + i), Elem<T>::load(g + i) * inv_scale, s, c);
        sum += u * u;
      }
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (lane == 0) atomicAdd(m.norm, sum);
  }
}

template <typename Algo, typename T>
void launch(const StepArgs& args, bool eight_bit, bool norm_pass, cudaStream_t stream) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = ceil_div(args.total_blocks, int64_t{kStepWarps});
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * 8)));
  if constexpr (has_update_norm<Algo>::value) {
    if (norm_pass) {
      if (eight_bit) {
        update_norm_kernel<Algo, T, true><<<grid, kStepThreads, 0, stream>>>(args);
      } else {
        update_norm_kernel<Algo, T, false><<<grid, kStepThreads, 0, stream>>>(args);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  if (eight_bit) {
    quantized_step_kernel<Algo, T, true><<<grid, kStepThreads, 0, stream>>>(args);
  } else {
    quantized_step_kernel<Algo, T, false><<<grid, kStepThreads, 0, stream>>>(args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Algo>
void step_algorithm(at::TensorList params, at::TensorList grads, at::TensorList states, at::TensorList absmax,
                    at::TensorList steps, at::TensorList qmaps, c10::ArrayRef<double> hyper, bool eight_bit,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& norms) {
  static_assert(Algo::kKeys <= kMaxKeys, "raise kMaxKeys");
  const size_t n = params.size();
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  constexpr int kGroups = 3;
  const at::ScalarType group_dtype[kGroups] = {at::kFloat, at::kBFloat16, at::kHalf};
  std::vector<size_t> members[kGroups];
  for (size_t i = 0; i < n; ++i) {
    if (params[i].numel() == 0) continue;
    for (int gi = 0; gi < kGroups; ++gi) {
      if (params[i].scalar_type() == group_dtype[gi]) members[gi].push_back(i);
    }
  }
  size_t total = 0;
  for (const auto& mlist : members) total += mlist.size();
  if (total == 0) return;
  TORCH_CHECK(total < (size_t{1} << 30), "quantized_step_: too many tensors (", total, ")");
  // Host metadata: [meta: total entries][starts: per group, n_g + 1 entries], one H2D copy.
  const size_t meta_bytes = total * sizeof(TensorMeta);
  const int64_t bytes = static_cast<int64_t>(meta_bytes + (total + kGroups) * sizeof(int64_t));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* hmeta = reinterpret_cast<TensorMeta*>(host.data_ptr());
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
      TensorMeta& m = hmeta[mi++];
      m = TensorMeta{};
      m.p = params[i].data_ptr();
      m.g = grads[i].data_ptr();
      for (int key = 0; key < Algo::kKeys; ++key) {
        m.state[key] = states[key * n + i].data_ptr();
        m.absmax[key] = eight_bit ? absmax[key * n + i].data_ptr<float>() : nullptr;
      }
      m.step = steps[i].data_ptr<float>();
      m.scale = scales.has_value() ? scales->data_ptr<float>() + i : nullptr;
      m.norm = norms.has_value() ? norms->data_ptr<double>() + i : nullptr;
      m.numel = params[i].numel();
      acc += ceil_div(m.numel, kStateBlockSize);
      hstarts[si++] = acc;
    }
    group_blocks[gi] = acc;
  }
  at::Tensor dev = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  dev.copy_(host, /*non_blocking=*/true);  // the caching host allocator keeps `host` alive until it is done
  const auto* dmeta = reinterpret_cast<const TensorMeta*>(dev.data_ptr());
  const auto* dstarts = reinterpret_cast<const int64_t*>(static_cast<const uint8_t*>(dev.data_ptr()) + meta_bytes);

  StepArgs args{};
  for (int key = 0; key < Algo::kKeys; ++key) args.qmap[key] = eight_bit ? qmaps[key].data_ptr<float>() : nullptr;
  args.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  // the norm pass ignores found_inf (its result is not used when the step is skipped)
  args.found_inf = found_inf.has_value() && !norms.has_value() ? found_inf->data_ptr<float>() : nullptr;
  std::copy(hyper.begin(), hyper.end(), args.hyper.v);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int gi = 0; gi < kGroups; ++gi) {
    if (members[gi].empty()) continue;
    args.meta = dmeta + meta_off[gi];
    args.starts = dstarts + starts_off[gi];
    args.ntensors = static_cast<int>(members[gi].size());
    args.total_blocks = group_blocks[gi];
    switch (group_dtype[gi]) {
      case at::kFloat:
        launch<Algo, float>(args, eight_bit, norms.has_value(), stream);
        break;
      case at::kBFloat16:
        launch<Algo, c10::BFloat16>(args, eight_bit, norms.has_value(), stream);
        break;
      case at::kHalf:
        launch<Algo, c10::Half>(args, eight_bit, norms.has_value(), stream);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false);
    }
  }
}

}  // namespace

void quantized_step_cuda_unchecked(const std::string& algorithm, at::TensorList params, at::TensorList grads,
                                   at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                   at::TensorList qmaps, c10::ArrayRef<double> hyper, bool eight_bit,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales,
                                   const std::optional<at::Tensor>& norms) {
  if (params.empty()) return;
  if (norms.has_value()) norms->zero_();  // the norm pass adds into it
  with_algorithm(algorithm, [&](auto algo) {
    step_algorithm<decltype(algo)>(params, grads, states, absmax, steps, qmaps, hyper, eight_bit, grad_scale,
                                   found_inf, scales, norms);
  });
}

}  // namespace pagedopt
