// CUDA kernels of the generic quantized-state engine: one fused step of any algorithm of
// pagedopt/algorithms.h over a list of tensors, 8-bit (blockwise codes) or 32-bit states, and the
// norm pass of the algorithms whose update is scaled by its norm (LARS, LAMB). 4-bit states (a
// 16-entry codebook per key) go to four_bit_step_kernel.cuh's step kernel, in tiles of two
// 128-blocks, and four_bit_norm_kernel.cuh's norm pass, in 128-blocks.
//
// The element math is the algorithm's update() and the quantization is codebook.h's nearest code,
// as on the CPU, so the states come out bit for bit as the CPU's. Launches per call: one H2D copy
// of a metadata table when it differs from the last one kept (device_metadata), one setup kernel (the codebooks' search tables and
// each tensor's constants, from its step count on the GPU: no host synchronisation), and one step
// kernel per parameter dtype.
//
// The 8-bit step kernel (eight_bit_step_kernel.cuh): one warp owns one 256-element block, 8
// consecutive elements per lane, vector loads and stores, one warp reduction per moment's absmax,
// the codes written once the new absmaxes are known, the warp's next block prefetched into L2.
// Dequantization reads a 32-way replicated codebook (lane l reads copy l: no bank conflicts),
// quantization one table entry per value (code_table.cuh). The 32-bit states and the norm pass
// use plain kernels: a grid-stride walk over the blocks, element lo + k * 32 + lane of the block
// (the norm pass through warp_block.cuh's block loop, which the 8-bit step kernel shares; the
// 32-bit step keeps its loops written out, see there).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "launch.h"
#include "eight_bit_step_kernel.cuh"
#include "four_bit_norm_kernel.cuh"
#include "four_bit_step_kernel.cuh"
#include "pagedopt/algorithms.h"
#include "pagedopt/codebook.h"

namespace pagedopt {
namespace {

using namespace cuda_detail;

constexpr int kPlainThreads = 256;
constexpr int kPlainWarps = kPlainThreads / kWarp;

// ---------------------------------------------------------------------------------------------
// Setup: blocks [0, table_blocks) build the codebooks' search tables (8-bit states: kTableBlocks
// per key; 4-bit steps, args.tables4 set: kTable4Blocks per key), the rest
// compute each tensor's constants from its step count (and the update scale, for LARS and LAMB) and,
// with stochastic rounding, its stream (pagedopt/stochastic_round.h).
// ---------------------------------------------------------------------------------------------
template <typename Algo>
__global__ void __launch_bounds__(kTableThreads) engine_setup_kernel(const StepArgs<Algo> args, int table_blocks,
                                                                     int ntensors,
                                                                     typename Algo::Constants* __restrict__ consts,
                                                                     uint64_t* __restrict__ streams) {
  if (static_cast<int>(blockIdx.x) < table_blocks) {
    if (args.tables4 != nullptr) {
      build_code_table4_block(args.qmap[blockIdx.x / kTable4Blocks], args.tables4 + blockIdx.x / kTable4Blocks,
                              blockIdx.x % kTable4Blocks);
      return;
    }
    const int key = blockIdx.x / kTableBlocks;
    build_code_table_block(args.qmap[key], args.tables + key, blockIdx.x % kTableBlocks);
    return;
  }
  const int i = (blockIdx.x - table_blocks) * blockDim.x + threadIdx.x;
  if (i >= ntensors) return;
  const TensorMeta& m = args.meta[i];
  OptimizerHyper hyper = args.hyper;
  if (args.lr_f32 != nullptr) hyper.v[0] = static_cast<double>(*args.lr_f32);
  if (args.lr_f64 != nullptr) hyper.v[0] = *args.lr_f64;
  auto c = Algo::constants(hyper, static_cast<double>(*m.step));
  if constexpr (has_update_norm<Algo>::value) {
    if (m.scale != nullptr) c.update_scale = *m.scale;
  }
  consts[i] = c;
  if (streams != nullptr) streams[i] = sr_stream(m.sr_key, *m.step);
}

// ---------------------------------------------------------------------------------------------
// The plain kernels: 32-bit states, and the norm pass (8-bit or 32-bit).
// ---------------------------------------------------------------------------------------------

// The codebooks of the 8-bit states into shared memory, then a barrier for the whole block.
template <int K, bool kEightBit, typename Args>
__device__ __forceinline__ void load_codebooks(float (&s_code)[K][kCodebookSize], const Args& args) {
  if (kEightBit) {
    for (int i = threadIdx.x; i < K * kCodebookSize; i += blockDim.x) {
      s_code[i / kCodebookSize][i % kCodebookSize] = args.qmap[i / kCodebookSize][i % kCodebookSize];
    }
  }
  __syncthreads();
}

// Element i's moments: codes dequantized with the block's absmax (read by every lane before
// anything is written), or the 32-bit values.
template <typename Algo, bool kEightBit>
__device__ __forceinline__ void load_moments(const TensorMeta& m, const float (*s_code)[kCodebookSize], int64_t i,
                                             int64_t lb, float (&s)[Algo::kMoments]) {
  const int64_t n = m.numel;
#pragma unroll
  for (int j = 0; j < Algo::kMoments; ++j) {
    const int64_t at = Algo::stack_of(j) * n + i;
    if (kEightBit) {
      const uint8_t q = static_cast<const uint8_t*>(m.state[Algo::key_of(j)])[at];
      const float a = m.absmax[Algo::key_of(j)][Algo::stack_of(j) * ceil_div(n, kStateBlockSize) + lb];
      s[j] = dequantize_value(s_code[Algo::key_of(j)], q, a);
    } else {
      s[j] = static_cast<const float*>(m.state[Algo::key_of(j)])[at];
    }
  }
}

// The 32-bit step: each element's moments read, updated and written back in place.
template <typename Algo, typename T>
__global__ void __launch_bounds__(kPlainThreads) fp32_state_step_kernel(const StepArgs<Algo> args) {
  constexpr int M = Algo::kMoments;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // grid-uniform
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kPlainWarps;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;  // as the CPU kernel
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kPlainWarps + threadIdx.x / kWarp; b < args.total_blocks;
       b += warps) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const auto& c = args.consts[t];
    const int64_t lb = b - args.starts[t];
    const int64_t n = m.numel;
    T* p = static_cast<T*>(m.p);
    const T* g = static_cast<const T*>(m.g);
    for (int k = 0; k < 8; ++k) {
      const int64_t i = lb * kStateBlockSize + k * kWarp + lane;
      if (i < n) {
        float s[M];
        load_moments<Algo, false>(m, nullptr, i, lb, s);
        store_param<T>(p + i, Algo::update(Elem<T>::load(p + i), Elem<T>::load(g + i) * inv_scale, s, c),
                       param_rounding<T>(args, m, t), i);
#pragma unroll
        for (int j = 0; j < M; ++j) static_cast<float*>(m.state[Algo::key_of(j)])[Algo::stack_of(j) * n + i] = s[j];
      }
    }
  }
}

// The norm pass (quantized_update_norm_): each warp adds the squares of its block's update
// directions, in double, to its tensor's norm (one atomicAdd per block: the sum's rounding
// depends on the order of the blocks, so it may differ from the CPU's in the last bits).
template <typename Algo, typename T, bool kEightBit>
__global__ void __launch_bounds__(kPlainThreads) update_norm_kernel(const StepArgs<Algo> args) {
  constexpr int M = Algo::kMoments;
  constexpr int K = Algo::kKeys;
  __shared__ float s_code[K][kCodebookSize];
  load_codebooks<K, kEightBit>(s_code, args);
  const int lane = threadIdx.x % kWarp;
  const float inv_scale = args.grad_scale != nullptr ? 1.0f / *args.grad_scale : 1.0f;
  for_each_warp_block<kPlainWarps>(args.total_blocks, [&](int64_t b, int64_t) {
    const int t = owner_of(args.starts, args.ntensors, b);
    const TensorMeta& m = args.meta[t];
    const auto& c = args.consts[t];
    const int64_t lb = b - args.starts[t];
    const T* p = static_cast<const T*>(m.p);
    const T* g = static_cast<const T*>(m.g);
    double sum = 0.0;
    for_each_strided_element<0>(lb * kStateBlockSize, m.numel, lane, [&](int, int64_t i) {
      float s[M];
      load_moments<Algo, kEightBit>(m, s_code, i, lb, s);
      const double u = Algo::direction(Elem<T>::load(p + i), Elem<T>::load(g + i) * inv_scale, s, c);
      sum += u * u;
    });
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (lane == 0) atomicAdd(m.norm, sum);
  });
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

// Per device and instantiation: the 8-bit kernel's dynamic shared memory opted in.
template <typename Algo, typename T>
void prepare_eight_bit_kernel(int device) {
  static std::atomic<bool> ready[64] = {};
  TORCH_CHECK(device >= 0 && device < 64, "quantized_step_: device index ", device, " out of range");
  if (ready[device].load(std::memory_order_relaxed)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(eight_bit_step_kernel<Algo, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(eight_bit_smem_bytes<Algo::kKeys>())));
  ready[device].store(true, std::memory_order_relaxed);
}

template <typename Algo, typename T>
void launch(const StepArgs<Algo>& args, StateBits bits, bool norm_pass, int device, cudaStream_t stream) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool eight_bit = bits == StateBits::k8;
  if (bits == StateBits::k4) {
    if constexpr (has_update_norm<Algo>::value) {
      if (norm_pass) {
        launch_four_bit_norm<Algo, T>(args, sms, stream);
        return;
      }
    }
    launch_four_bit_step<Algo, T>(args, sms, device, stream);
    return;
  }
  if (eight_bit && !norm_pass) {
    prepare_eight_bit_kernel<Algo, T>(device);
    constexpr int kThreads = engine_threads<Algo>();
    const int64_t want = ceil_div(args.total_blocks, int64_t{kThreads / kWarp});
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms})));
    eight_bit_step_kernel<Algo, T><<<grid, kThreads, eight_bit_smem_bytes<Algo::kKeys>(), stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t want = ceil_div(args.total_blocks, int64_t{kPlainWarps});
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * 8)));
  if constexpr (has_update_norm<Algo>::value) {
    if (norm_pass) {
      if (eight_bit) {
        update_norm_kernel<Algo, T, true><<<grid, kPlainThreads, 0, stream>>>(args);
      } else {
        update_norm_kernel<Algo, T, false><<<grid, kPlainThreads, 0, stream>>>(args);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  fp32_state_step_kernel<Algo, T><<<grid, kPlainThreads, 0, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether work queued on `stream` now is being captured into a CUDA graph.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The device copy of a step's metadata table (`table`, built on the host), on `stream`.
//
// Eager steps: the device copies of recent tables are kept, by (device, first parameter's address,
// size); a step whose table is byte for byte the last one's there (the usual case: the same
// parameters, gradients and states step after step) uploads nothing and reuses it, and only a
// changed table goes up, through page-locked memory from the caching host allocator. Taking a new
// page-locked block at every step would call cudaHostAlloc whenever the GPU runs several steps
// behind the host (the blocks of the steps it has not run yet are all still in use), and that call
// waits for the device. A kept copy is never written again, so the kernels of earlier steps that
// read it need no ordering; a replaced one goes back to the caching allocator, for later work on
// its stream only, after the work of every other stream that read it (recordStream).
//
// Inside graph capture: the graph's copy reads its source again at every replay, so the table goes
// up from page-locked memory of our own that is never freed (a few hundred bytes per tensor per
// captured step), allocated in relaxed capture mode (allocation is refused in global mode, as
// torch's allocators do it), into a device buffer of the graph's pool.
at::Tensor device_metadata(const std::vector<uint8_t>& table, int device, uintptr_t first,
                           const at::TensorOptions& opts, bool in_capture, cudaStream_t stream) {
  const int64_t bytes = static_cast<int64_t>(table.size());
  if (in_capture) {
    static std::mutex kept_mutex;
    static std::vector<void*> kept;  // read by captured graphs for as long as they may be replayed
    void* buffer = nullptr;
    {
      const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      const std::lock_guard<std::mutex> lock(kept_mutex);
      C10_CUDA_CHECK(cudaHostAlloc(&buffer, table.size(), cudaHostAllocDefault));
      kept.push_back(buffer);
    }
    std::memcpy(buffer, table.data(), table.size());
    at::Tensor dev = at::empty({bytes}, opts);
    C10_CUDA_CHECK(cudaMemcpyAsync(dev.data_ptr(), buffer, table.size(), cudaMemcpyHostToDevice, stream));
    return dev;
  }
  struct Kept {
    std::vector<uint8_t> table;
    at::Tensor dev;
  };
  // never destroyed: its device tensors must not be freed after CUDA shuts down at exit
  static auto* mutex = new std::mutex;
  static auto* kept = new std::map<std::tuple<int, uintptr_t, int64_t>, Kept>;
  const auto key = std::make_tuple(device, first, bytes);
  const std::lock_guard<std::mutex> lock(*mutex);
  auto it = kept->find(key);
  if (it != kept->end() && it->second.table == table) {
    // read on another stream than the one it was made on (updates on a side stream, then on the
    // current one): the allocator must not hand its memory out again before that stream's work
    // has read it, when the copy is replaced
    c10::cuda::CUDACachingAllocator::recordStream(it->second.dev.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(stream, device));
    return it->second.dev;
  }
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), table.size());
  at::Tensor dev = at::empty({bytes}, opts);
  dev.copy_(host, /*non_blocking=*/true);  // the caching host allocator keeps `host` until the copy is done
  if (it == kept->end() && kept->size() >= 64) kept->clear();  // bounded: a few MiB at most
  (*kept)[key] = Kept{table, dev};
  return dev;
}

template <typename Algo>
void step_algorithm(at::TensorList params, at::TensorList grads, at::TensorList states, at::TensorList absmax,
                    at::TensorList steps, at::TensorList qmaps, c10::ArrayRef<double> hyper, StateBits bits,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& norms,
                    const std::optional<at::Tensor>& lr, const SrArgs& sr) {
  const bool quantized = bits != StateBits::k32;
  const bool four_bit = bits == StateBits::k4;
  // the kernels' unit of work: a 4-bit step's warps take tiles of two 128-blocks
  const int64_t block_size = four_bit && !norms.has_value() ? int64_t{kTile4} : state_block_size(bits);
  static_assert(Algo::kKeys <= kMaxKeys, "raise kMaxKeys");
  using Constants = typename Algo::Constants;
  // what a launch allocates per tensor: its metadata and block start (the kept table), its
  // constants and stochastic-rounding stream (the work buffer); pagedopt/optim/kernels.py's
  // ENGINE_BYTES_PER_TENSOR bounds it, so that a step reserves its temporaries before it begins
  static_assert(sizeof(TensorMeta) + sizeof(int64_t) + sizeof(Constants) + sizeof(uint64_t) <= 256,
                "raise ENGINE_BYTES_PER_TENSOR in pagedopt/optim/kernels.py and here");
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
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool in_capture = capturing(stream);
  static thread_local std::vector<uint8_t> table;
  table.assign(static_cast<size_t>(bytes), 0);  // zeroed: padding too, so that equal tables compare equal
  auto* hmeta = reinterpret_cast<TensorMeta*>(table.data());
  auto* hstarts = reinterpret_cast<int64_t*>(table.data() + meta_bytes);
  const auto addr = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); };
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

      m.p = params[i].data_ptr();
      m.g = grads[i].data_ptr();
      m.numel = params[i].numel();
      bool vec_ok = addr(m.p) % 16 == 0 && addr(m.g) % 16 == 0;
      for (int key = 0; key < Algo::kKeys; ++key) {
        m.state[key] = states[key * n + i].data_ptr();
        m.absmax[key] = quantized ? absmax[key * n + i].data_ptr<float>() : nullptr;
      }
      for (int j = 0; j < Algo::kMoments; ++j) {  // each moment's codes: 8-byte (4-bit: 4-byte) aligned
        if (four_bit) {
          vec_ok = vec_ok && (addr(m.state[Algo::key_of(j)]) + Algo::stack_of(j) * packed_bytes(m.numel)) % 4 == 0;
        } else {
          vec_ok = vec_ok && (addr(m.state[Algo::key_of(j)]) + Algo::stack_of(j) * m.numel) % 8 == 0;
        }
      }
      m.vec_ok = vec_ok ? 1 : 0;
      m.step = steps[i].data_ptr<float>();
      m.scale = scales.has_value() ? scales->data_ptr<float>() + i : nullptr;
      m.norm = norms.has_value() ? norms->data_ptr<double>() + i : nullptr;
      m.sr_key = sr.on ? sr.key(i) : 0;
      m.sr_offset = sr.on ? sr.offset(i) : 0;
      acc += ceil_div(m.numel, block_size);
      hstarts[si++] = acc;
    }
    group_blocks[gi] = acc;
    TORCH_CHECK(acc < (int64_t{1} << 31), "quantized_step_: more than 2^31 blocks of ", block_size,
                " elements of one dtype in one call");
  }
  const auto byte_opts = at::TensorOptions().dtype(at::kByte).device(device);
  const at::Tensor dev = device_metadata(table, device.index(), addr(params[0].data_ptr()), byte_opts, in_capture,
                                         stream);
  const auto* dmeta = reinterpret_cast<const TensorMeta*>(dev.data_ptr());
  const auto* dstarts = reinterpret_cast<const int64_t*>(static_cast<const uint8_t*>(dev.data_ptr()) + meta_bytes);

  // Work buffer: [K code tables (8-bit and 4-bit steps)][stream per tensor (stochastic rounding)]
  // [constants per tensor].
  const bool tables = bits == StateBits::k8 && !norms.has_value();
  const bool tables4 = four_bit && !norms.has_value();
  const bool rounding = sr.on && !norms.has_value();
  static_assert(sizeof(CodeTable) == 8192 * 4 && sizeof(CodeTable4) == 8196 * 4,
                "kernels.CODE_TABLE_BYTES / CODE_TABLE4_BYTES count the engine's search tables");
  const size_t tables_bytes = tables    ? Algo::kKeys * sizeof(CodeTable)
                              : tables4 ? Algo::kKeys * sizeof(CodeTable4)
                                        : 0;
  const size_t streams_at = (tables_bytes + 15) / 16 * 16;
  const size_t consts_at = streams_at + (rounding ? total * sizeof(uint64_t) : 0);
  at::Tensor work = at::empty({static_cast<int64_t>(consts_at + total * sizeof(Constants))}, byte_opts);
  StepArgs<Algo> args{};
  args.tables = tables ? reinterpret_cast<CodeTable*>(work.data_ptr()) : nullptr;
  args.tables4 = tables4 ? reinterpret_cast<CodeTable4*>(work.data_ptr()) : nullptr;
  auto* streams = rounding ? reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(work.data_ptr()) + streams_at) : nullptr;
  auto* consts = reinterpret_cast<Constants*>(static_cast<uint8_t*>(work.data_ptr()) + consts_at);
  for (int key = 0; key < Algo::kKeys; ++key) args.qmap[key] = quantized ? qmaps[key].data_ptr<float>() : nullptr;
  args.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  // the norm pass ignores found_inf (its result is not used when the step is skipped)
  args.found_inf = found_inf.has_value() && !norms.has_value() ? found_inf->data_ptr<float>() : nullptr;
  std::copy(hyper.begin(), hyper.end(), args.hyper.v);
  if (lr.has_value()) {
    if (lr->scalar_type() == at::kDouble) {
      args.lr_f64 = lr->data_ptr<double>();
    } else {
      args.lr_f32 = lr->data_ptr<float>();
    }
  }
  args.meta = dmeta;

  const int table_blocks = tables ? Algo::kKeys * kTableBlocks : tables4 ? Algo::kKeys * kTable4Blocks : 0;
  const int const_blocks = static_cast<int>(ceil_div(static_cast<int64_t>(total), int64_t{kTableThreads}));
  engine_setup_kernel<Algo><<<table_blocks + const_blocks, kTableThreads, 0, stream>>>(
      args, table_blocks, static_cast<int>(total), consts, streams);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  for (int gi = 0; gi < kGroups; ++gi) {
    if (members[gi].empty()) continue;
    args.meta = dmeta + meta_off[gi];
    args.consts = consts + meta_off[gi];
    args.sr_streams = streams != nullptr ? streams + meta_off[gi] : nullptr;
    args.starts = dstarts + starts_off[gi];
    args.ntensors = static_cast<int>(members[gi].size());
    args.total_blocks = group_blocks[gi];
    switch (group_dtype[gi]) {
      case at::kFloat:
        launch<Algo, float>(args, bits, norms.has_value(), device.index(), stream);
        break;
      case at::kBFloat16:
        launch<Algo, c10::BFloat16>(args, bits, norms.has_value(), device.index(), stream);
        break;
      case at::kHalf:
        launch<Algo, c10::Half>(args, bits, norms.has_value(), device.index(), stream);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false);
    }
  }
}

}  // namespace

void quantized_step_cuda_unchecked(const std::string& algorithm, at::TensorList params, at::TensorList grads,
                                   at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                   at::TensorList qmaps, c10::ArrayRef<double> hyper, StateBits bits,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales,
                                   const std::optional<at::Tensor>& norms, const std::optional<at::Tensor>& lr,
                                   const SrArgs& sr) {
  if (params.empty()) return;
  if (norms.has_value()) norms->zero_();  // the norm pass adds into it
  with_algorithm(algorithm, [&](auto algo) {
    step_algorithm<decltype(algo)>(params, grads, states, absmax, steps, qmaps, hyper, bits, grad_scale,
                                   found_inf, scales, norms, lr, sr);
  });
}

}  // namespace pagedopt
