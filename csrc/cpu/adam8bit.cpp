// CPU adam8bit_step_ / adam8bit_step_list_: the generic engine's step (quantized_step.cpp) with
// the Adam functor (pagedopt/algorithms/adam.h), behind Adam's own op signature and checks.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "cpu_kernels.h"
#include "pagedopt/adam_state_list.h"
#include "pagedopt/checks.h"

namespace pagedopt {
namespace {

std::vector<at::Tensor> concat(at::TensorList a, at::TensorList b) {
  std::vector<at::Tensor> out(a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

void adam8bit_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state1,
                       at::TensorList state2, at::TensorList absmax1, at::TensorList absmax2,
                       at::TensorList steps, const at::Tensor& code1, const at::Tensor& code2, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam8bit_args(params, grads, state1, state2, absmax1, absmax2, steps, code1, code2, grad_scale,
                      found_inf);
  const double hyper[] = {lr, beta1, beta2, eps, weight_decay, decoupled ? 1.0 : 0.0};
  quantized_step_cpu_unchecked("adam", params, grads, concat(state1, state2), concat(absmax1, absmax2), steps,
                               {code1, code2}, hyper, /*eight_bit=*/true, grad_scale, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("adam8bit_step_", &adam8bit_step_cpu);
  m.impl("adam8bit_step_list_", &adam8bit_step_list<adam8bit_step_cpu>);
}

}  // namespace pagedopt
