#pragma once
// The states of one fused quantized_step_ call, held on the C++ side (as AdamStateList does for
// Adam, and for the same reason: a step then passes only its parameters and gradients). The
// parameters are not held (see adam_state_list.h).
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pagedopt {

struct QuantizedStateList : torch::CustomClassHolder {
  std::string algorithm;
  std::vector<at::Tensor> states;  // one list per state key, key after key
  std::vector<at::Tensor> absmax;  // likewise (8-bit), or empty (32-bit)
  std::vector<at::Tensor> steps;
  std::vector<at::Tensor> qmaps;   // one codebook per state key (8-bit), or empty

  QuantizedStateList(std::string algorithm_, std::vector<at::Tensor> states_, std::vector<at::Tensor> absmax_,
                     std::vector<at::Tensor> steps_, std::vector<at::Tensor> qmaps_)
      : algorithm(std::move(algorithm_)),
        states(std::move(states_)),
        absmax(std::move(absmax_)),
        steps(std::move(steps_)),
        qmaps(std::move(qmaps_)) {}

  int64_t size() const { return static_cast<int64_t>(steps.size()); }

  // For torch.compile's fake class (pagedopt/_ops.py, FakeQuantizedStateList).
  auto obj_flatten() const {
    return std::make_tuple(std::make_tuple(std::string("algorithm"), algorithm),
                           std::make_tuple(std::string("states"), states),
                           std::make_tuple(std::string("absmax"), absmax),
                           std::make_tuple(std::string("steps"), steps),
                           std::make_tuple(std::string("qmaps"), qmaps));
  }
};

// torch.classes.pagedopt.QuantizedStateList (registered wherever this header is included; see
// adam_state_list.h for why an inline variable).
inline const auto kQuantizedStateListClass =
    torch::class_<QuantizedStateList>("pagedopt", "QuantizedStateList")
        .def(torch::init<std::string, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                         std::vector<at::Tensor>>())
        .def("size", &QuantizedStateList::size)
        .def("__obj_flatten__",
             [](const c10::intrusive_ptr<QuantizedStateList>& self) { return self->obj_flatten(); })
        .def("__eq__", [](const c10::intrusive_ptr<QuantizedStateList>& self,
                          const c10::intrusive_ptr<QuantizedStateList>& other) { return self.get() == other.get(); })
        .def("__len__", [](const c10::intrusive_ptr<QuantizedStateList>&) -> int64_t {
          TORCH_CHECK_TYPE(false, "QuantizedStateList has no len(); size() is the number of parameters it holds");
        });

// The kernel signature of quantized_step_list_ for a backend whose quantized_step_ is `step`.
template <auto step>
void quantized_step_list(const c10::intrusive_ptr<QuantizedStateList>& s, at::TensorList params,
                         at::TensorList grads, c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales) {
  step(s->algorithm, params, grads, s->states, s->absmax, s->steps, s->qmaps, hyper, grad_scale, found_inf, scales);
}

}  // namespace pagedopt
