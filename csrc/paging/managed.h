#pragma once
// Unified (managed) memory for pagedopt: allocation, prefetch, advice and residency queries.
//
// This is the one header in front of the CUDA-only paging code (csrc/paging/*.cpp, built only
// when PAGEDOPT_WITH_CUDA is defined). It includes no CUDA headers, and it knows nothing about
// any optimizer. The operators are declared in csrc/pagedopt.cpp and registered in managed.cpp:
//
//   concurrent_managed_access(int device_index) -> bool      CompositeExplicitAutograd
//   managed_empty(int[] size, ScalarType dtype, Device device) -> Tensor
//                                                             CompositeExplicitAutograd
//   prefetch_(Tensor(a!) t, Device? to) -> ()                 CUDA
//   advise_preferred_location_(Tensor(a!) t, Device? to) -> () CUDA
//   is_managed(Tensor t) -> bool                              CUDA, CPU (always false)
//   residency(Tensor t) -> int                                CUDA
//   discard_(Tensor(a!) t, Device? to) -> ()                  CUDA
//   pinned_empty(int[] size, ScalarType dtype) -> Tensor      CompositeExplicitAutograd
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace pagedopt::paging {

// Values returned by residency(): where the tensor's bytes were last *asked* to go by an
// explicit prefetch (cudaMemPrefetchAsync). It says nothing about whether that migration has
// finished, and the driver may have moved pages since (eviction under pressure, faults).
enum Residency : int64_t {
  kResidencyUnknown = 0,  // never prefetched as a whole, or its pages were prefetched to different places
  kResidencyDevice = 1,   // last prefetched to a GPU (cudaMemLocationTypeDevice)
  kResidencyHost = 2,     // last prefetched to host memory (cudaMemLocationTypeHost / HostNuma*)
};

// cudaDevAttrConcurrentManagedAccess of `device_index`: true when the CPU and GPU may touch
// managed memory concurrently (needed for prefetch-based paging; false on Windows/WSL and some
// virtualized setups).
bool concurrent_managed_access(int64_t device_index);

// A CUDA tensor on `device` whose bytes come from cudaMallocManaged(cudaMemAttachGlobal). The
// memory is returned by cudaFree when the last reference to the storage goes away. The contents
// are uninitialized. Zero elements: an ordinary empty CUDA tensor (not managed).
at::Tensor managed_empty(c10::IntArrayRef size, at::ScalarType dtype, c10::Device device);

// Asynchronously (on the current stream of t's device) migrate the bytes spanned by `t` to
// `to` (None or a CPU device: host memory; a CUDA device: must be t's own device).
void prefetch_(const at::Tensor& t, std::optional<c10::Device> to);

// cudaMemAdvise on the bytes spanned by `t`:
//   to = t's CUDA device: SetPreferredLocation(device) and UnsetAccessedBy(device) (the default
//                         migrate-on-touch behaviour, pages settle on the GPU);
//   to = None / CPU:      SetPreferredLocation(host) and SetAccessedBy(device) (pages stay in
//                         host memory and the GPU maps them and reads/writes them over the
//                         interconnect, no migration on GPU access).
void advise_preferred_location_(const at::Tensor& t, std::optional<c10::Device> to);

// True when t's data pointer is managed memory (cudaPointerGetAttributes type Managed).
bool is_managed(const at::Tensor& t);

// Last explicit prefetch location of the bytes spanned by `t`, as a Residency value.
int64_t residency(const at::Tensor& t);

// On the current stream of t's device: cudaMemDiscardBatchAsync of the whole 2 MiB pages inside
// the bytes spanned by `t` (to = None), or cudaMemDiscardAndPrefetchBatchAsync of them to `to`
// (host, or t's own device: the pages are populated there without moving the indeterminate
// contents). Bytes of the span outside those pages keep their contents; a span shorter than a
// page discards nothing. After a discard the discarded bytes are indeterminate until written; the
// paging code keeps their contents in a host copy first.
// Raises where the runtime (before CUDA 12.8) or the driver does not offer discards.
void discard_(const at::Tensor& t, std::optional<c10::Device> to);

// A CPU tensor in page-locked memory of exactly its size (cudaHostAlloc; torch's pinned caching
// allocator rounds every block up to a power of two), freed with cudaFreeHost when its storage
// dies. Uninitialized. Zero elements: an ordinary empty CPU tensor.
at::Tensor pinned_empty(c10::IntArrayRef size, at::ScalarType dtype);

}  // namespace pagedopt::paging
