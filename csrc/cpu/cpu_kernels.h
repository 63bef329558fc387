#pragma once
// Host entry points of the CPU kernels that other CPU files call. They assume their arguments
// passed the checks of pagedopt/checks.h.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace pagedopt {

// The generic engine's step (csrc/cpu/quantized_step.cpp) for the algorithm `name` of
// pagedopt/algorithms.h; `eight_bit` as check_quantized_step returned it.
void quantized_step_cpu_unchecked(const std::string& name, at::TensorList params, at::TensorList grads,
                                  at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                  at::TensorList qmaps, c10::ArrayRef<double> hyper, bool eight_bit,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& scales = std::nullopt);

}  // namespace pagedopt
