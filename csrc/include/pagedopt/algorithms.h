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
// 8-bit moments use codebook qmap<key+1>, blockwise with one absmax per 256 elements; 4-bit moments
// (a 16-entry qmap<key+1>) two codes a byte, one absmax per 128 elements (pagedopt/four_bit.h). An element
// counts toward its block's absmaxes only if all of its new moments are finite
// (counts_for_absmax): a non-finite moment is stored saturated by the quantizer and does not
// flatten the rest of its block.
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "pagedopt/algorithms/adagrad.h"
#include "pagedopt/algorithms/adam.h"
#include "pagedopt/algorithms/ademamix.h"
#include "pagedopt/algorithms/lamb.h"
#include "pagedopt/algorithms/lars.h"
#include "pagedopt/algorithms/lion.h"
#include "pagedopt/algorithms/rmsprop.h"
#include "pagedopt/algorithms/sgd.h"
#include "pagedopt/checks.h"
#include "pagedopt/common.h"

namespace pagedopt {

// Algorithms whose update is scaled per tensor by the norm of its direction (LARS, LAMB) declare
// kUpdateNorm = true, a direction(p, g, s, c) and a Constants::update_scale that the engine sets.
template <typename A, typename = void>
struct has_update_norm : std::false_type {};
template <typename A>
struct has_update_norm<A, std::void_t<decltype(A::kUpdateNorm)>> : std::bool_constant<A::kUpdateNorm> {};

template <int N>
PAGEDOPT_HOST_DEVICE bool counts_for_absmax(const float (&s)[N]) {
  bool ok = true;
PAGEDOPT_UNROLL
  for (int j = 0; j < N; ++j) ok = ok && fabsf(s[j]) <= 3.40282347e38f;  // false for NaN and +-inf
  return ok;
}

// The engine's absmax rule for one element of Algo: Algo::counts_for_absmax(s) where the
// algorithm declares a cheaper test that decides the same (Adam: v alone), else every moment finite.
template <typename A, typename = void>
struct has_own_absmax_rule : std::false_type {};
template <typename A>
struct has_own_absmax_rule<A, std::void_t<decltype(A::counts_for_absmax(std::declval<const float (&)[A::kMoments]>()))>>
    : std::true_type {};

template <typename Algo>
PAGEDOPT_HOST_DEVICE bool element_counts_for_absmax(const float (&s)[Algo::kMoments]) {
  if constexpr (has_own_absmax_rule<Algo>::value) {
    return Algo::counts_for_absmax(s);
  } else {
    return counts_for_absmax(s);
  }
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
  } else if (name == "lars") {
    f(LARS{});
  } else if (name == "lamb") {
    f(LAMB{});
  } else {
    TORCH_CHECK_VALUE(false, "quantized_step_: unknown algorithm '", name, "' (adam, lion, ademamix, sgd_momentum, rmsprop, adagrad, lars, lamb)");
  }
}

// check_quantized_step_args for the algorithm of that name (its state keys and their stacked
// moments); returns the width of the states (32, 8 or 4 bits).
// `per_tensor` (optional): the step's `scales` (float32) or the norm pass's `norms` (float64), one
// entry per parameter, only for algorithms with kUpdateNorm.
inline StateBits check_quantized_step(const std::string& algorithm, at::TensorList params, at::TensorList grads,
                                 at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                 at::TensorList qmaps, c10::ArrayRef<double> hyper,
                                 const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf,
                                 const std::optional<at::Tensor>& per_tensor = std::nullopt,
                                 const char* per_tensor_name = "scales",
                                 at::ScalarType per_tensor_dtype = at::kFloat) {
  StateBits bits = StateBits::k32;
  with_algorithm(algorithm, [&](auto algo) {
    using Algo = decltype(algo);
    int stacks[Algo::kKeys] = {};
    for (int j = 0; j < Algo::kMoments; ++j) stacks[Algo::key_of(j)] += 1;
    bits = check_quantized_step_args(Algo::kKeys, stacks, Algo::kHyper, params, grads, states, absmax, steps,
                                          qmaps, hyper, grad_scale, found_inf);
    if (per_tensor.has_value()) {
      TORCH_CHECK(has_update_norm<Algo>::value, "quantized_step_: ", per_tensor_name, " is only for algorithms whose "
                  "update is scaled by its norm (lars, lamb), not ", algorithm);
      const at::Tensor& t = *per_tensor;
      TORCH_CHECK(t.scalar_type() == per_tensor_dtype && t.dim() == 1 &&
                      t.numel() == static_cast<int64_t>(params.size()) && t.is_contiguous(),
                  per_tensor_name, " must be a contiguous 1-D ", per_tensor_dtype, " tensor with one entry per parameter (",
                  params.size(), "), got ", t.scalar_type(), " of shape ", t.sizes());
      TORCH_CHECK(params.empty() || t.device() == params[0].device(), per_tensor_name, " is on ", t.device(),
                  ", params on ", params[0].device());
    }
  });
  return bits;
}

}  // namespace pagedopt
