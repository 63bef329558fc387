// QuantizedStateList::gather_grads (csrc/include/pagedopt/quantized_state_list.h): reads the held
// parameters from their Python objects, so it is compiled here, with torch's Python headers, and
// not in the header that nvcc-compiled and backend files include; and step_torch_fused, which
// calls torch's fused Adam/AdamW ops.
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <torch/csrc/autograd/python_variable.h>

#include "pagedopt/quantized_state_list.h"

namespace pagedopt {

bool QuantizedStateList::gather_grads() {
  release();
  const size_t n = held_pyobjs.size();
  if (n == 0 || n != steps.size()) return false;
  gathered_params.reserve(n);
  gathered_grads.reserve(n);
  const bool fused = torch_fused() && states.size() == 2 * n;
  for (size_t i = 0; i < n; ++i) {
    PyObject* obj = static_cast<PyObject*>(held_pyobjs[i]);
    if (!THPVariable_Check(obj)) {
      release();
      return false;
    }
    const at::Tensor& p = THPVariable_Unpack(obj);
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != p.scalar_type() || g.device() != p.device() ||
        g.sizes() != p.sizes() || !g.is_contiguous() || !p.is_contiguous()) {
      release();
      return false;
    }
    if (fused && !fused_states_match(i, p)) {
      release();
      return false;
    }
    gathered_params.push_back(p);
    gathered_grads.push_back(g);
  }
  return true;
}

bool QuantizedStateList::fused_states_match(size_t i, const at::Tensor& p) const {
  const size_t n = steps.size();
  for (const at::Tensor& s : {states[i], states[n + i]}) {
    if (s.scalar_type() != at::kFloat || s.numel() != p.numel() || !s.is_contiguous() || s.device() != p.device()) {
      return false;
    }
  }
  return true;
}

void QuantizedStateList::step_torch_fused(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                          const std::vector<double>& hyper,
                                          const std::optional<at::Tensor>& grad_scale,
                                          const std::optional<at::Tensor>& found_inf,
                                          const std::optional<at::Tensor>& lr) {
  const size_t n = steps.size();
  TORCH_CHECK_VALUE(hyper.size() == 5, "step_gathered: ", algorithm, " takes 5 hyper values (lr, beta1, beta2, ",
                    "weight_decay, eps), got ", hyper.size());
  TORCH_CHECK(states.size() == 2 * n && absmax.empty() && qmaps.empty(), "step_gathered: ", algorithm,
              " holds 2 x ", n, " fp32 states and no codebooks, not ", states.size(), " states");
  const at::TensorList all(states);
  const at::TensorList exp_avgs = all.slice(0, n), exp_avg_sqs = all.slice(n, n);
  const bool decoupled = algorithm == "_fused_adamw_";
  const double beta1 = hyper[1], beta2 = hyper[2], weight_decay = hyper[3], eps = hyper[4];
  // the op's float-lr or tensor-lr overload, as `lr_arg` is a double or a tensor
  const auto run = [&](const auto& lr_arg) {
    if (decoupled) {
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, lr_arg, beta1, beta2, weight_decay, eps,
                        /*amsgrad=*/false, /*maximize=*/false, grad_scale, found_inf);
    } else {
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, lr_arg, beta1, beta2, weight_decay, eps,
                       /*amsgrad=*/false, /*maximize=*/false, grad_scale, found_inf);
    }
  };
  if (lr.has_value()) {
    run(*lr);
  } else {
    run(hyper[0]);
  }
}

}  // namespace pagedopt
