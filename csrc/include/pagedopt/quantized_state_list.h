#pragma once
// The per-parameter states of one fused quantized_step_ call, held on the C++ side: an optimizer
// builds one per bucket of parameters and then passes only the parameters and gradients at each
// step (Python hands a tensor list to an op at about 0.15 us a tensor, so the state lists would
// cost about 0.75 us per parameter and step). The parameters are not held: a held reference would
// keep torch.utils.swap_tensors (module.to(), load_state_dict(assign=...) with swapping on) from
// swapping them, and would go on updating the old tensor after a swap.
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

  // (name, value) pairs of everything held, for torch.compile's fake class (pagedopt/_ops.py,
  // FakeQuantizedStateList.__obj_unflatten__): tracing fakifies these tensors instead of running on
  // the real ones. The held tensors themselves, not copies (states can be gigabytes).
  auto obj_flatten() const {
    return std::make_tuple(std::make_tuple(std::string("algorithm"), algorithm),
                           std::make_tuple(std::string("states"), states),
                           std::make_tuple(std::string("absmax"), absmax),
                           std::make_tuple(std::string("steps"), steps),
                           std::make_tuple(std::string("qmaps"), qmaps));
  }
};

// Registers the class as torch.classes.pagedopt.QuantizedStateList. An inline variable: every file
// that includes this header (the op schemas, the kernels registering quantized_step_list_) sees the
// class registered before its own registrations run, whatever the order of static initialization.
inline const auto kQuantizedStateListClass =
    torch::class_<QuantizedStateList>("pagedopt", "QuantizedStateList")
        .def(torch::init<std::string, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                         std::vector<at::Tensor>>())
        .def("size", &QuantizedStateList::size)
        .def("__obj_flatten__",
             [](const c10::intrusive_ptr<QuantizedStateList>& self) { return self->obj_flatten(); })
        // Identity, for tracing's fake-tensor dispatch cache, whose keys hold the object.
        .def("__eq__", [](const c10::intrusive_ptr<QuantizedStateList>& self,
                          const c10::intrusive_ptr<QuantizedStateList>& other) { return self.get() == other.get(); })
        // len() raises TypeError, as for any Python object without a length (a script object's
        // default raises NotImplementedError, which torch.library.opcheck's input cloning does not expect).
        .def("__len__", [](const c10::intrusive_ptr<QuantizedStateList>&) -> int64_t {
          TORCH_CHECK_TYPE(false, "QuantizedStateList has no len(); size() is the number of parameters it holds");
        });

// The kernel signature of quantized_step_list_ for a backend whose quantized_step_ is `step`.
template <auto step>
void quantized_step_list(const c10::intrusive_ptr<QuantizedStateList>& s, at::TensorList params,
                         at::TensorList grads, c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& lr) {
  step(s->algorithm, params, grads, s->states, s->absmax, s->steps, s->qmaps, hyper, grad_scale, found_inf, scales,
       lr);
}

}  // namespace pagedopt
