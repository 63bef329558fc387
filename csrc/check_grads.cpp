// check_grads: the per-step validation of an optimizer's gradients, for any device.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "pagedopt/checks.h"

namespace pagedopt {
namespace {

constexpr int64_t kGradsContiguous = -1;
constexpr int64_t kGradsNotContiguous = -2;

int64_t check_grads(at::TensorList params, at::TensorList grads) {
  TORCH_CHECK(params.size() == grads.size(), "check_grads: ", params.size(), " params but ", grads.size(),
              " grads");
  bool contiguous = true;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const bool ok = g.layout() == at::kStrided && is_supported_param_dtype(p.scalar_type()) &&
                    g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes() && g.device() == p.device();
    if (!ok) return static_cast<int64_t>(i);
    contiguous = contiguous && p.is_contiguous() && g.is_contiguous();
  }
  return contiguous ? kGradsContiguous : kGradsNotContiguous;
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CompositeExplicitAutograd, m) { m.impl("check_grads", &check_grads); }

}  // namespace pagedopt
