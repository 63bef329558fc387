// Unified (managed) memory: cudaMallocManaged tensors, prefetch, advice and residency.
// See managed.h for the contract of each operator. Compiled only in CUDA builds.
#ifdef PAGEDOPT_WITH_CUDA

#include "managed.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/safe_numerics.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <limits>
#include <utility>

namespace pagedopt::paging {
namespace {

constexpr uintptr_t kDiscardPage = uintptr_t{2} << 20;  // discards cover whole 2 MiB pages

// The device ordinal of a CUDA device argument, resolving "cuda" (no index) to the current
// device, and checking that it exists.
c10::DeviceIndex resolve_cuda_index(const c10::Device& device, const char* what) {
  TORCH_CHECK(device.is_cuda(), what, ": expected a CUDA device, got ", device);
  const c10::DeviceIndex count = c10::cuda::device_count();
  TORCH_CHECK(count > 0, what, ": no CUDA device is available");
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < count, what, ": CUDA device ", static_cast<int>(index),
              " does not exist (", static_cast<int>(count), " visible)");
  return index;
}

// The address range [ptr, ptr + bytes) that `t`'s elements occupy (its storage offset and
// strides applied; torch strides are never negative). {nullptr, 0} for an empty tensor.
std::pair<void*, size_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {nullptr, 0};
  int64_t last = 0;  // offset, in elements, of the last element
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const size_t bytes = static_cast<size_t>(last + 1) * t.element_size();
  return {t.data_ptr(), bytes};
}

bool pointer_is_managed(const void* ptr) {
  if (ptr == nullptr) return false;
  cudaPointerAttributes attr{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  return attr.type == cudaMemoryTypeManaged;
}

// Checks shared by the tensor-taking ops; returns the device ordinal of `t`.
c10::DeviceIndex check_managed_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, ": expected a CUDA tensor allocated by pagedopt::managed_empty, got a ",
              t.device(), " tensor");
  const c10::DeviceIndex index = t.device().index();
  const auto [ptr, bytes] = byte_span(t);
  if (bytes == 0) return index;
  TORCH_CHECK(pointer_is_managed(ptr), what,
              ": the tensor is not in CUDA managed memory (it was not allocated by "
              "pagedopt::managed_empty / cudaMallocManaged); only managed tensors can be paged");
  return index;
}

// `to` as a target: std::nullopt means host; a CUDA device must be the tensor's own device
// (a tensor whose pages live on another GPU would lie about its device to torch).
std::optional<c10::DeviceIndex> resolve_target(const at::Tensor& t, const std::optional<c10::Device>& to,
                                               const char* what) {
  if (!to.has_value() || to->is_cpu()) return std::nullopt;
  TORCH_CHECK(to->is_cuda(), what, ": target must be None (host), 'cpu' or a CUDA device, got ", *to);
  const c10::DeviceIndex target = to->has_index() ? to->index() : t.device().index();
  TORCH_CHECK(target == t.device().index(), what, ": the tensor is on ", t.device(),
              " but the target is cuda:", static_cast<int>(target),
              "; a managed tensor can only be prefetched to its own device or to the host");
  return target;
}

#if CUDART_VERSION >= 13000
cudaMemLocation location_of(std::optional<c10::DeviceIndex> device) {
  cudaMemLocation loc{};
  if (device.has_value()) {
    loc.type = cudaMemLocationTypeDevice;
    loc.id = static_cast<int>(*device);
  } else {
    loc.type = cudaMemLocationTypeHost;
    loc.id = 0;  // ignored for cudaMemLocationTypeHost
  }
  return loc;
}
#else
int location_of(std::optional<c10::DeviceIndex> device) {
  return device.has_value() ? static_cast<int>(*device) : cudaCpuDeviceId;
}
#endif

void mem_advise(const void* ptr, size_t bytes, cudaMemoryAdvise advice, std::optional<c10::DeviceIndex> where) {
  C10_CUDA_CHECK(cudaMemAdvise(ptr, bytes, advice, location_of(where)));
}

}  // namespace

bool concurrent_managed_access(int64_t device_index) {
  TORCH_CHECK(device_index >= 0 && device_index <= std::numeric_limits<c10::DeviceIndex>::max(),
              "concurrent_managed_access: invalid device index ", device_index);
  const c10::DeviceIndex index =
      resolve_cuda_index(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index)),
                         "concurrent_managed_access");
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrConcurrentManagedAccess, static_cast<int>(index)));
  return value != 0;
}

at::Tensor managed_empty(c10::IntArrayRef size, at::ScalarType dtype, c10::Device device) {
  const c10::DeviceIndex index = resolve_cuda_index(device, "managed_empty");
  const c10::Device cuda_device(c10::kCUDA, index);
  int64_t numel = 1;
  for (const int64_t s : size) {
    TORCH_CHECK(s >= 0, "managed_empty: negative dimension in size ", size);
    TORCH_CHECK(!c10::mul_overflows(numel, s, &numel), "managed_empty: size ", size, " overflows int64");
  }
  const auto options = at::TensorOptions().dtype(dtype).device(cuda_device);
  if (numel == 0) return at::empty(size, options);  // nothing to page; an ordinary empty tensor

  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t nbytes = 0;
  TORCH_CHECK(!c10::mul_overflows(numel, itemsize, &nbytes), "managed_empty: size ", size, " of ", dtype,
              " overflows int64 bytes");

  c10::cuda::CUDAGuard guard(index);
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocManaged(&ptr, static_cast<size_t>(nbytes), cudaMemAttachGlobal);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) allocation error
    TORCH_CHECK(false, "managed_empty: cudaMallocManaged of ", nbytes, " bytes on cuda:",
                static_cast<int>(index), " failed: ", cudaGetErrorString(err));
  }
  try {
    return at::from_blob(
        ptr, size,
        // cudaFree is safe from any thread and any current device for managed memory; it waits
        // for outstanding work on the allocation. A destructor must not throw: warn on failure.
        [](void* p) { C10_CUDA_CHECK_WARN(cudaFree(p)); }, options, cuda_device);
  } catch (...) {
    (void)cudaFree(ptr);
    throw;
  }
}

void prefetch_(const at::Tensor& t, std::optional<c10::Device> to) {
  const c10::DeviceIndex index = check_managed_tensor(t, "prefetch_");
  const std::optional<c10::DeviceIndex> target = resolve_target(t, to, "prefetch_");
  const auto [ptr, bytes] = byte_span(t);
  if (bytes == 0) return;
  c10::cuda::CUDAGuard guard(index);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(index).stream();
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaMemPrefetchAsync(ptr, bytes, location_of(target), /*flags=*/0, stream));
#else
  C10_CUDA_CHECK(cudaMemPrefetchAsync(ptr, bytes, location_of(target), stream));
#endif
}

void advise_preferred_location_(const at::Tensor& t, std::optional<c10::Device> to) {
  const c10::DeviceIndex index = check_managed_tensor(t, "advise_preferred_location_");
  const std::optional<c10::DeviceIndex> target = resolve_target(t, to, "advise_preferred_location_");
  const auto [ptr, bytes] = byte_span(t);
  if (bytes == 0) return;
  c10::cuda::CUDAGuard guard(index);
  if (target.has_value()) {
    mem_advise(ptr, bytes, cudaMemAdviseSetPreferredLocation, target);
    mem_advise(ptr, bytes, cudaMemAdviseUnsetAccessedBy, index);
  } else {
    mem_advise(ptr, bytes, cudaMemAdviseSetPreferredLocation, std::nullopt);
    mem_advise(ptr, bytes, cudaMemAdviseSetAccessedBy, index);
  }
}

bool is_managed(const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  const void* ptr = t.numel() > 0 ? t.data_ptr() : t.storage().data();
  if (ptr == nullptr) return false;
  c10::cuda::CUDAGuard guard(t.device().index());
  return pointer_is_managed(ptr);
}

bool is_managed_cpu(const at::Tensor&) { return false; }

int64_t residency(const at::Tensor& t) {
  const c10::DeviceIndex index = check_managed_tensor(t, "residency");
  const auto [ptr, bytes] = byte_span(t);
  if (bytes == 0) return kResidencyUnknown;
  c10::cuda::CUDAGuard guard(index);
#if CUDART_VERSION >= 13000
  cudaMemLocationType type = cudaMemLocationTypeInvalid;
  C10_CUDA_CHECK(cudaMemRangeGetAttribute(&type, sizeof(type), cudaMemRangeAttributeLastPrefetchLocationType,
                                          ptr, bytes));
  switch (type) {
    case cudaMemLocationTypeDevice:
      return kResidencyDevice;
    case cudaMemLocationTypeHost:
    case cudaMemLocationTypeHostNuma:
    case cudaMemLocationTypeHostNumaCurrent:
      return kResidencyHost;
    default:
      return kResidencyUnknown;
  }
#else
  int location = cudaInvalidDeviceId;
  C10_CUDA_CHECK(cudaMemRangeGetAttribute(&location, sizeof(location), cudaMemRangeAttributeLastPrefetchLocation,
                                          ptr, bytes));
  if (location == cudaCpuDeviceId) return kResidencyHost;
  if (location >= 0) return kResidencyDevice;
  return kResidencyUnknown;
#endif
}

void discard_(const at::Tensor& t, std::optional<c10::Device> to) {
  const c10::DeviceIndex index = check_managed_tensor(t, "discard_");
  const auto [ptr, bytes] = byte_span(t);
  if (bytes == 0) return;
  std::optional<c10::DeviceIndex> target;
  const bool prefetch = to.has_value();
  if (prefetch) target = resolve_target(t, to, "discard_");
  // Only the whole pages inside the span are discarded (the driver refuses ranges that are not
  // page aligned; 2 MiB is the largest page it uses), so bytes outside the span are never touched.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kDiscardPage - 1) / kDiscardPage * kDiscardPage;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) / kDiscardPage * kDiscardPage;
  if (end <= begin) return;
  c10::cuda::CUDAGuard guard(index);
  const at::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream(index);
  // The batch calls refuse the legacy default stream: there, the discard runs on a pool stream
  // ordered after the current stream's work and before its later work (events, no host wait).
  const bool legacy = current.stream() == nullptr || current.stream() == cudaStreamLegacy;
  const at::cuda::CUDAStream side = legacy ? at::cuda::getStreamFromPool(false, index) : current;
  if (legacy) {
    at::cuda::CUDAEvent before;
    before.record(current);
    before.block(side);
  }
  const cudaStream_t stream = side.stream();
#if CUDART_VERSION >= 12080
  void* ptrs[1] = {reinterpret_cast<void*>(begin)};
  size_t sizes[1] = {static_cast<size_t>(end - begin)};
  cudaError_t err;
  if (prefetch) {
    cudaMemLocation loc{};
#if CUDART_VERSION >= 13000
    loc = location_of(target);
#else
    loc.type = target.has_value() ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
    loc.id = target.has_value() ? static_cast<int>(*target) : 0;
#endif
    size_t first[1] = {0};
    err = cudaMemDiscardAndPrefetchBatchAsync(ptrs, sizes, 1, &loc, first, 1, 0, stream);
  } else {
    err = cudaMemDiscardBatchAsync(ptrs, sizes, 1, 0, stream);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "discard_: ", prefetch ? "cudaMemDiscardAndPrefetchBatchAsync" : "cudaMemDiscardBatchAsync",
                " of ", bytes, " bytes on cuda:", static_cast<int>(index), " failed: ", cudaGetErrorString(err));
  }
#else
  (void)stream;
  TORCH_CHECK(false, "discard_: this build's CUDA runtime (", CUDART_VERSION,
              ") has no cudaMemDiscardBatchAsync (CUDA 12.8 or newer)");
#endif
  if (legacy) {
    at::cuda::CUDAEvent after;
    after.record(side);
    after.block(current);
  }
}

at::Tensor pinned_empty(c10::IntArrayRef size, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : size) {
    TORCH_CHECK(s >= 0, "pinned_empty: negative dimension in size ", size);
    TORCH_CHECK(!c10::mul_overflows(numel, s, &numel), "pinned_empty: size ", size, " overflows int64");
  }
  const auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  if (numel == 0) return at::empty(size, options);
  int64_t nbytes = 0;
  TORCH_CHECK(!c10::mul_overflows(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes),
              "pinned_empty: size ", size, " of ", dtype, " overflows int64 bytes");
  TORCH_CHECK(c10::cuda::device_count() > 0, "pinned_empty: page-locked memory needs a CUDA device");
  void* ptr = nullptr;
  const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "pinned_empty: cudaHostAlloc of ", nbytes, " bytes failed: ", cudaGetErrorString(err));
  }
  try {
    return at::from_blob(ptr, size, [](void* p) { C10_CUDA_CHECK_WARN(cudaFreeHost(p)); }, options);
  } catch (...) {
    (void)cudaFreeHost(ptr);
    throw;
  }
}

}  // namespace pagedopt::paging

// No tensor arguments, so there is no dispatch key to find: CompositeExplicitAutograd serves
// every key (including the empty key set of a factory call).
TORCH_LIBRARY_IMPL(pagedopt, CompositeExplicitAutograd, m) {
  m.impl("concurrent_managed_access", &pagedopt::paging::concurrent_managed_access);
  m.impl("managed_empty", &pagedopt::paging::managed_empty);
  m.impl("pinned_empty", &pagedopt::paging::pinned_empty);
}

TORCH_LIBRARY_IMPL(pagedopt, CUDA, m) {
  m.impl("prefetch_", &pagedopt::paging::prefetch_);
  m.impl("advise_preferred_location_", &pagedopt::paging::advise_preferred_location_);
  m.impl("is_managed", &pagedopt::paging::is_managed);
  m.impl("residency", &pagedopt::paging::residency);
  m.impl("discard_", &pagedopt::paging::discard_);
}

// A CPU tensor is never managed memory; answering false (rather than "no kernel") lets callers
// ask about any tensor.
TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("is_managed", &pagedopt::paging::is_managed_cpu);
}

#endif  // PAGEDOPT_WITH_CUDA
