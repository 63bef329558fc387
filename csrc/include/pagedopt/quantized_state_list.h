#pragma once
// The per-parameter states of one fused quantized_step_ call, held on the C++ side: an optimizer
// builds one per bucket of parameters and then passes only the parameters and gradients at each
// step (Python hands a tensor list to an op at about 0.15 us a tensor, so the state lists would
// cost about 0.75 us per parameter and step). The parameters are not held: a held reference would
// keep torch.utils.swap_tensors (module.to(), load_state_dict(assign=...) with swapping on) from
// swapping them, and would go on updating the old tensor after a swap.
//
// The fast step (gather_grads, then step_gathered) holds no reference at all, only the address of
// each parameter's Python object (swap_tensors refuses tensors with C++ weak references too), and
// reads the parameter from that object at each step. So a step passes no tensor list.
//
// A list whose algorithm is torch's fused Adam/AdamW ("_fused_adam_", "_fused_adamw_": 32-bit
// states of fp32 parameters, first moments then second moments, no codebooks) is stepped by that
// aten op instead of quantized_step_, in the fast step only.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>
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
  std::vector<int64_t> sr_ids;      // each parameter's id for stochastic rounding (set_sr_ids), or empty
  std::vector<int64_t> sr_offsets;  // and the index of its first element in its whole parameter

  QuantizedStateList(std::string algorithm_, std::vector<at::Tensor> states_, std::vector<at::Tensor> absmax_,
                     std::vector<at::Tensor> steps_, std::vector<at::Tensor> qmaps_)
      : algorithm(std::move(algorithm_)),
        states(std::move(states_)),
        absmax(std::move(absmax_)),
        steps(std::move(steps_)),
        qmaps(std::move(qmaps_)) {}

  // The fast step's parameters: the address of each one's Python object (see above), and the
  // tensors gather_grads collected for the next step_gathered.
  std::vector<void*> held_pyobjs;
  std::vector<at::Tensor> gathered_params;
  std::vector<at::Tensor> gathered_grads;

  int64_t size() const { return static_cast<int64_t>(steps.size()); }

  bool torch_fused() const { return algorithm == "_fused_adam_" || algorithm == "_fused_adamw_"; }

  // Holds, for the fast step, the Python objects of `params` (one per held state, in order).
  void hold_params(std::vector<at::Tensor> params) {
    TORCH_CHECK_VALUE(params.size() == steps.size(), "hold_params: ", params.size(), " params for ", steps.size(),
                      " held states");
    std::vector<void*> pyobjs;
    for (size_t i = 0; i < params.size(); ++i) {
      void* obj = params[i].unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
      TORCH_CHECK_VALUE(obj != nullptr, "hold_params: params[", i, "] has no Python object");
      pyobjs.push_back(obj);
    }
    held_pyobjs = std::move(pyobjs);
  }

  // The ids and offsets of the held parameters for stochastic rounding (quantized_step_'s sr_ids
  // and sr_offsets).
  void set_sr_ids(std::vector<int64_t> ids, std::vector<int64_t> offsets) {
    TORCH_CHECK_VALUE(ids.size() == steps.size() && offsets.size() == steps.size(), "set_sr_ids: ", ids.size(),
                      " ids and ", offsets.size(), " offsets for ", steps.size(), " held states");
    for (size_t i = 0; i < offsets.size(); ++i) {
      TORCH_CHECK_VALUE(offsets[i] >= 0, "set_sr_ids: offsets[", i, "] = ", offsets[i], " must be >= 0");
    }
    sr_ids = std::move(ids);
    sr_offsets = std::move(offsets);
  }

  // The sr_ids and sr_offsets of quantized_step_ for a step with `sr_seed` (none without one).
  std::pair<at::OptionalIntArrayRef, at::OptionalIntArrayRef> sr_for(const std::optional<int64_t>& sr_seed,
                                                                     const char* op) const {
    if (!sr_seed.has_value()) return {std::nullopt, std::nullopt};
    TORCH_CHECK_VALUE(sr_ids.size() == steps.size(), op, ": sr_seed given, but the list holds no sr_ids (set_sr_ids)");
    return {at::IntArrayRef(sr_ids), at::IntArrayRef(sr_offsets)};
  }

  void release() {
    gathered_params.clear();
    gathered_grads.clear();
  }

  // Collects each held parameter (the tensor its Python object holds now: a swapped one is seen as
  // it is) and its gradient for step_gathered. False (and nothing kept) when the ordinary step must
  // run instead: no parameters held, or a gradient missing or not matching its parameter (other
  // dtype, shape, device or layout, or either not contiguous: the ordinary step copies or refuses
  // those), or, for a torch_fused() list, a moment that no longer matches its parameter (the
  // ordinary step names it). The caller guarantees that the held Python objects are alive: fast_step.py checks that
  // the param groups hold exactly them, in order, right before (csrc/quantized_state_list.cpp).
  bool gather_grads();

  // For a torch_fused() list: whether parameter i's held moments are still what torch's fused op
  // may read for `p` (float32, contiguous, on its device, of its size: the op does not check, and
  // would read and write past a moment resized in place).
  bool fused_states_match(size_t i, const at::Tensor& p) const;

  // torch's fused Adam/AdamW on the held states (torch_fused()): hyper is (lr, beta1, beta2,
  // weight_decay, eps), `lr` (a float32 tensor on the parameters' device) replacing hyper[0] when
  // given (csrc/quantized_state_list.cpp).
  void step_torch_fused(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<double>& hyper, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr);

  // The step on what gather_grads collected, through the op quantized_step_ (every argument check
  // of the ordinary step runs), or torch's fused op for a torch_fused() list; the collected tensors
  // are released whatever happens.
  void step_gathered(std::vector<double> hyper, std::optional<at::Tensor> grad_scale,
                     std::optional<at::Tensor> found_inf, std::optional<at::Tensor> lr,
                     std::optional<int64_t> sr_seed) {
    std::vector<at::Tensor> params = std::move(gathered_params);
    std::vector<at::Tensor> grads = std::move(gathered_grads);
    release();
    TORCH_CHECK(!params.empty() && params.size() == steps.size(),
                "step_gathered: gather_grads() did not collect this list's parameters first");
    if (torch_fused()) {
      TORCH_CHECK_VALUE(!sr_seed.has_value(), "step_gathered: ", algorithm, " has no stochastic rounding");
      step_torch_fused(params, grads, hyper, grad_scale, found_inf, lr);
      return;
    }
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("pagedopt::quantized_step_", "")
            .typed<void(c10::string_view, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                        at::TensorList, at::TensorList, c10::ArrayRef<double>, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, at::OptionalIntArrayRef, at::OptionalIntArrayRef,
                        int64_t)>();
    const auto sr = sr_for(sr_seed, "step_gathered");
    op.call(algorithm, params, grads, states, absmax, steps, qmaps, hyper, grad_scale, found_inf, std::nullopt, lr,
            sr.first, sr.second, sr_seed.value_or(0));
  }

  // (name, value) pairs of everything held, for torch.compile's fake class (pagedopt/_ops.py,
  // FakeQuantizedStateList.__obj_unflatten__): tracing fakifies these tensors instead of running on
  // the real ones. The held tensors themselves, not copies (states can be gigabytes).
  auto obj_flatten() const {
    return std::make_tuple(std::make_tuple(std::string("algorithm"), algorithm),
                           std::make_tuple(std::string("states"), states),
                           std::make_tuple(std::string("absmax"), absmax),
                           std::make_tuple(std::string("steps"), steps),
                           std::make_tuple(std::string("qmaps"), qmaps),
                           std::make_tuple(std::string("sr_ids"), sr_ids),
                           std::make_tuple(std::string("sr_offsets"), sr_offsets));
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
        .def("hold_params", &QuantizedStateList::hold_params)
        .def("gather_grads", &QuantizedStateList::gather_grads)
        .def("release", &QuantizedStateList::release)
        .def("set_sr_ids", &QuantizedStateList::set_sr_ids)
        .def("step_gathered", &QuantizedStateList::step_gathered, "",
             {torch::arg("hyper"), torch::arg("grad_scale"), torch::arg("found_inf"), torch::arg("lr"),
              torch::arg("sr_seed") = torch::arg::none()})
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
                         const std::optional<at::Tensor>& lr, std::optional<int64_t> sr_seed) {
  const auto sr = s->sr_for(sr_seed, "quantized_step_list_");
  step(s->algorithm, params, grads, s->states, s->absmax, s->steps, s->qmaps, hyper, grad_scale, found_inf, scales,
       lr, sr.first, sr.second, sr_seed.value_or(0));
}

}  // namespace pagedopt
