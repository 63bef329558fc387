#pragma once
// adam8bit_step_ (Adam's own op signature: state1/state2, absmax1/absmax2, code1/code2 and named
// hyperparameters) as a call of the generic engine's step with the Adam functor
// (pagedopt/algorithms/adam.h): what each backend passes to its quantized_step_*_unchecked.
#include <ATen/core/Tensor.h>

#include <array>
#include <vector>

namespace pagedopt {

struct Adam8bitEngineCall {
  std::vector<at::Tensor> states;  // state1..., state2...
  std::vector<at::Tensor> absmax;  // absmax1..., absmax2...
  std::array<double, 6> hyper;     // Adam's kHyper values, in its documented order
};

inline Adam8bitEngineCall adam8bit_engine_call(at::TensorList state1, at::TensorList state2, at::TensorList absmax1,
                                               at::TensorList absmax2, double lr, double beta1, double beta2,
                                               double eps, double weight_decay, bool decoupled) {
  Adam8bitEngineCall call;
  call.states.assign(state1.begin(), state1.end());
  call.states.insert(call.states.end(), state2.begin(), state2.end());
  call.absmax.assign(absmax1.begin(), absmax1.end());
  call.absmax.insert(call.absmax.end(), absmax2.begin(), absmax2.end());
  call.hyper = {lr, beta1, beta2, eps, weight_decay, decoupled ? 1.0 : 0.0};
  return call;
}

}  // namespace pagedopt
