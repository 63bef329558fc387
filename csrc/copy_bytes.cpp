// copy_bytes_: many byte copies in one call, for the host-resident pager's runs (one call per group
// instead of one torch copy_ per run: each copy_ costs tens of microseconds of host time in
// dispatch, TensorIterator set-up and the pinned-memory checks, and a chunk of updates during
// backward moves several runs in and back). Every build has it; CUDA builds copy to and from the GPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef PAGEDOPT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

#include <cstring>
#include <optional>

namespace pagedopt {

// dst[i] <- src[i], byte for byte, for every i. Each pair is contiguous and of the same number of
// bytes (dtypes and shapes may differ); every tensor is on the CPU or on one CUDA device. Copies
// that touch the GPU are queued on that device's current stream (cudaMemcpyAsync: asynchronous
// where the host side is page-locked; the caller orders reuse of the memory, as with
// copy_(non_blocking=True) of memory that torch's caching host allocator does not own); CPU to CPU
// pairs are copied at once. Every pair is checked before any byte moves.
void copy_bytes_(at::TensorList dst, at::TensorList src) {
  TORCH_CHECK(dst.size() == src.size(), "copy_bytes_: ", dst.size(), " destinations for ", src.size(), " sources");
  std::optional<c10::Device> cuda;
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    const at::Tensor& s = src[i];
    TORCH_CHECK(d.defined() && s.defined(), "copy_bytes_: pair ", i, " has an undefined tensor");
    TORCH_CHECK(d.is_contiguous() && s.is_contiguous(), "copy_bytes_: pair ", i, " is not contiguous");
    TORCH_CHECK(d.nbytes() == s.nbytes(), "copy_bytes_: pair ", i, " copies ", s.nbytes(), " bytes into ",
                d.nbytes());
    for (const at::Tensor* t : {&d, &s}) {
      if (t->is_cuda()) {
        TORCH_CHECK(!cuda.has_value() || *cuda == t->device(), "copy_bytes_: pair ", i, " is on ", t->device(),
                    ", an earlier one on ", *cuda, " (one CUDA device per call)");
        cuda = t->device();
      } else {
        TORCH_CHECK(t->is_cpu(), "copy_bytes_: pair ", i, " has a ", t->device(), " tensor (CPU or CUDA only)");
      }
    }
  }
  if (!cuda.has_value()) {
    for (size_t i = 0; i < dst.size(); ++i) {
      if (dst[i].nbytes() > 0) std::memcpy(dst[i].data_ptr(), src[i].data_ptr(), dst[i].nbytes());
    }
    return;
  }
#ifdef PAGEDOPT_WITH_CUDA
  const c10::cuda::CUDAGuard guard(*cuda);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (size_t i = 0; i < dst.size(); ++i) {
    const size_t n = dst[i].nbytes();
    if (n > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst[i].data_ptr(), src[i].data_ptr(), n, cudaMemcpyDefault, stream));
  }
#else
  TORCH_CHECK(false, "copy_bytes_: this build of pagedopt has no CUDA support (a ", *cuda, " tensor)");
#endif
}

}  // namespace pagedopt

// The lists may mix CPU and CUDA tensors: one kernel for every backend key.
TORCH_LIBRARY_IMPL(pagedopt, CompositeExplicitAutograd, m) {
  m.impl("copy_bytes_", &pagedopt::copy_bytes_);
}
