#pragma once
// The per-parameter states of one fused 8-bit Adam call, held on the C++ side: an optimizer builds
// one per bucket of parameters and then passes only the parameters and gradients at each step
// (Python hands a tensor list to an op at about 0.15 us a tensor, so the five state lists would
// cost ~0.75 us per parameter and step). The parameters are not held: a held reference would
// keep torch.utils.swap_tensors (module.to(), load_state_dict(assign=...) with swapping on) from
// swapping them, and would go on updating the old tensor after a swap.
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pagedopt {

struct AdamStateList : torch::CustomClassHolder {
  std::vector<at::Tensor> state1;
  std::vector<at::Tensor> state2;
  std::vector<at::Tensor> absmax1;
  std::vector<at::Tensor> absmax2;
  std::vector<at::Tensor> steps;
  at::Tensor code1;
  at::Tensor code2;

  AdamStateList(std::vector<at::Tensor> state1_, std::vector<at::Tensor> state2_,
                std::vector<at::Tensor> absmax1_, std::vector<at::Tensor> absmax2_, std::vector<at::Tensor> steps_,
                at::Tensor code1_, at::Tensor code2_)
      : state1(std::move(state1_)),
        state2(std::move(state2_)),
        absmax1(std::move(absmax1_)),
        absmax2(std::move(absmax2_)),
        steps(std::move(steps_)),
        code1(std::move(code1_)),
        code2(std::move(code2_)) {}

  int64_t size() const { return static_cast<int64_t>(state1.size()); }

  // (name, value) pairs of everything held, for torch.compile's fake class (pagedopt/_ops.py,
  // FakeAdamStateList.__obj_unflatten__): tracing fakifies these tensors instead of running on the
  // real ones. The held tensors themselves, not copies (states can be gigabytes).
  auto obj_flatten() const {
    return std::make_tuple(std::make_tuple(std::string("state1"), state1),
                           std::make_tuple(std::string("state2"), state2),
                           std::make_tuple(std::string("absmax1"), absmax1),
                           std::make_tuple(std::string("absmax2"), absmax2),
                           std::make_tuple(std::string("steps"), steps),
                           std::make_tuple(std::string("code1"), code1),
                           std::make_tuple(std::string("code2"), code2));
  }
};

// Registers the class as torch.classes.pagedopt.AdamStateList. An inline variable: every file that
// includes this header (the op schemas, the kernels registering adam8bit_step_list_) sees the
// class registered before its own registrations run, whatever the order of static initialization.
inline const auto kAdamStateListClass =
    torch::class_<AdamStateList>("pagedopt", "AdamStateList")
        .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                         std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, at::Tensor>())
        .def("size", &AdamStateList::size)
        .def("__obj_flatten__", [](const c10::intrusive_ptr<AdamStateList>& self) { return self->obj_flatten(); })
        // Identity, for tracing's fake-tensor dispatch cache, whose keys hold the object.
        .def("__eq__", [](const c10::intrusive_ptr<AdamStateList>& self,
                          const c10::intrusive_ptr<AdamStateList>& other) { return self.get() == other.get(); })
        // len() raises TypeError, as for any Python object without a length (a script object's default
        // raises NotImplementedError, which torch.library.opcheck's input cloning does not expect).
        .def("__len__", [](const c10::intrusive_ptr<AdamStateList>&) -> int64_t {
          TORCH_CHECK_TYPE(false, "AdamStateList has no len(); size() is the number of parameters it holds");
        });

// The kernel signature of adam8bit_step_list_ for a backend whose adam8bit_step_ is `step`.
template <auto step>
void adam8bit_step_list(const c10::intrusive_ptr<AdamStateList>& s, at::TensorList params, at::TensorList grads,
                        double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  step(params, grads, s->state1, s->state2, s->absmax1, s->absmax2, s->steps, s->code1, s->code2, lr, beta1,
       beta2, eps, weight_decay, decoupled, grad_scale, found_inf);
}

}  // namespace pagedopt
