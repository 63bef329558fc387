// CPU adam8bit_step_: the generic engine's step (quantized_step.cpp) with
// the Adam functor (pagedopt/algorithms/adam.h), behind Adam's own op signature and checks.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "pagedopt/adam8bit_op.h"
#include "pagedopt/checks.h"

namespace pagedopt {
namespace {

void adam8bit_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state1,
                       at::TensorList state2, at::TensorList absmax1, at::TensorList absmax2,
                       at::TensorList steps, const at::Tensor& code1, const at::Tensor& code2, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam8bit_args(params, grads, state1, state2, absmax1, absmax2, steps, code1, code2, grad_scale,
                      found_inf);
  const auto call = adam8bit_engine_call(state1, state2, absmax1, absmax2, lr, beta1, beta2, eps, weight_decay,
                                         decoupled);
  quantized_step_cpu_unchecked("adam", params, grads, call.states, call.absmax, steps, {code1, code2}, call.hyper,
                               /*eight_bit=*/true, grad_scale, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("adam8bit_step_", &adam8bit_step_cpu);
}

}  // namespace pagedopt
