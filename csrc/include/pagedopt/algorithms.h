#pragma once
// The optimizers of the generic quantized-state engine (csrc/cpu/quantized_step.cpp,
// csrc/cuda/quantized_step.cu), and what the engine asks of each.
//
// An algorithm is a struct with
//   kKeys                 state tensors per parameter (state1, state2, ...)
//   kMoments              moment arrays; moment j lives in state key key_of(j), at stack index
//                         stack_of(j) of that tensor (a key with two moments holds them stacked,
//                         shape (2, *param.shape), and its absmax has shape (2, blocks))
//   kHyper                how many values of the op's `hyper` list it reads (in its documented order)
//   Constants             the fp32 constants of one update
//   constants(hyper, t)   those constants at step t (the step count, already incremented; host
//                         and device: the CUDA kernels compute them on the GPU from the step tensor)
//   update(p, g, s, c)    one element: g already unscaled, s[j] the moments (dequantized), updated
//                         in place; returns the new parameter value
// 8-bit moments use codebook qmap<key+1>, blockwise with one absmax per 256 elements. An element
// counts toward its block's absmaxes only if all of its new moments are finite
// (counts_for_absmax): a non-finite moment is stored saturated by the quantizer and does not
// flatten the rest of its block.
#include <c10/util/Exception.h>

#include <cmath>
#include <string>

#include "pagedopt/algorithms/adagrad.h"
#include "pagedopt/algorithms/adam.h"
#include "pagedopt/algorithms/ademamix.h"
#include "pagedopt/algorithms/lion.h"
#include "pagedopt/algorithms/rmsprop.h"
#include "pagedopt/algorithms/sgd.h"
#include "pagedopt/checks.h"
#include "pagedopt/common.h"

namespace pagedopt {

template <int N>
PAGEDOPT_HOST_DEVICE bool counts_for_absmax(const float (&s)[N]) {
  bool ok = true;
PAGEDOPT_UNROLL
  for (int j = 0; j < N; ++j) ok = ok && fabsf(s[j]) <= 3.40282347e38f;  // false for NaN and +-inf
  return ok;
}

// Calls f(Algorithm{}) for the algorithm of that name.
template <typename F>
void with_algorithm(const std::string& name, F&& f) {
  if (name == "adam") {
    f(Adam{});
  } else if (name == "lion") {
    f(Lion{});
  } else if (name == "ademamix") {
    f(AdEMAMix{});
  } else if (name == "sgd_momentum") {
    f(SGDMomentum{});
  } else if (name == "rmsprop") {
    f(RMSprop{});
  } else if (name == "adagrad") {
    f(Adagrad{});
  } else {
    TORCH_CHECK_VALUE(false, "quantized_step_: unknown algorithm '", name, "' (adam, lion, ademamix, sgd_momentum, rmsprop, adagrad)");
  }
}

// check_quantized_step_args for the algorithm of that name (its state keys and their stacked
// moments); returns whether the states are 8-bit.
inline bool check_quantized_step(const std::string& algorithm, at::TensorList params, at::TensorList grads,
                                 at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                 at::TensorList qmaps, c10::ArrayRef<double> hyper,
                                 const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf) {
  bool eight_bit = false;
  with_algorithm(algorithm, [&](auto algo) {
    using Algo = decltype(algo);
    int stacks[Algo::kKeys] = {};
    for (int j = 0; j < Algo::kMoments; ++j) stacks[Algo::key_of(j)] += 1;
    eight_bit = check_quantized_step_args(Algo::kKeys, stacks, Algo::kHyper, params, grads, states, absmax, steps,
                                          qmaps, hyper, grad_scale, found_inf);
  });
  return eight_bit;
}

}  // namespace pagedopt
