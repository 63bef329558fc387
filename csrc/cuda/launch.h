#pragma once
// Host entry points of the CUDA kernels. They assume their arguments passed the checks of
// pagedopt/checks.h: csrc/cuda/ops.cpp runs those checks (compiled by the host compiler, so
// argument errors are thrown from host-compiled code) and then calls these.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "pagedopt/checks.h"

namespace pagedopt {

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda_unchecked(const at::Tensor& x, const at::Tensor& code,
                                                                     int64_t blocksize);

at::Tensor dequantize_blockwise_cuda_unchecked(const at::Tensor& codes, const at::Tensor& absmax,
                                               const at::Tensor& code, int64_t blocksize, at::ScalarType dtype);

// The generic quantized-state step (csrc/cuda/quantized_step.cu); `bits` as
// check_quantized_step returned it. With `norms`, the norm pass instead (quantized_update_norm_):
// nothing but `norms` is written. `lr` (checked by check_lr_tensor): read by the setup kernel in
// place of hyper[0]. `sr` (check_stochastic_round): stochastic rounding of bfloat16 parameters,
// each tensor's stream computed by the setup kernel from its step count. Inside CUDA graph capture the metadata goes up from page-locked memory that is
// kept for the life of the process (the graph's copy reads it again at every replay).
void quantized_step_cuda_unchecked(const std::string& algorithm, at::TensorList params, at::TensorList grads,
                                   at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                   at::TensorList qmaps, c10::ArrayRef<double> hyper, StateBits bits,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const std::optional<at::Tensor>& found_inf,
                                   const std::optional<at::Tensor>& scales = std::nullopt,
                                   const std::optional<at::Tensor>& norms = std::nullopt,
                                   const std::optional<at::Tensor>& lr = std::nullopt, const SrArgs& sr = SrArgs{});

// stochastic_round_bf16 (csrc/pagedopt.cpp) on arguments that passed check_stochastic_round_bf16_args.
at::Tensor stochastic_round_bf16_cuda_unchecked(const at::Tensor& x, const at::Tensor& step, int64_t seed, int64_t id,
                                                int64_t offset);

}  // namespace pagedopt
