// CUDA registrations of the pagedopt ops: argument checks (shared with the CPU backend), then
// the kernels' host entry points. Kept in a host-compiled file so every argument error is
// raised before any nvcc-compiled code runs.
#include <torch/library.h>

#include "launch.h"
#include "pagedopt/algorithms.h"
#include "pagedopt/quantized_state_list.h"
#include "pagedopt/checks.h"

namespace pagedopt {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda(const at::Tensor& x, const at::Tensor& code,
                                                           int64_t blocksize) {
  check_quantize_args(x, code, blocksize);
  return quantize_blockwise_cuda_unchecked(x, code, blocksize);
}

at::Tensor dequantize_blockwise_cuda(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
                                     int64_t blocksize, at::ScalarType dtype) {
  check_dequantize_args(codes, absmax, code, blocksize, dtype);
  return dequantize_blockwise_cuda_unchecked(codes, absmax, code, blocksize, dtype);
}

void quantized_step_cuda(c10::string_view algorithm, at::TensorList params, at::TensorList grads,
                         at::TensorList states, at::TensorList absmax, at::TensorList steps, at::TensorList qmaps,
                         c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& lr, at::OptionalIntArrayRef sr_ids,
                         at::OptionalIntArrayRef sr_offsets, int64_t sr_seed) {
  const std::string name(algorithm);
  const StateBits bits =
      check_quantized_step(name, params, grads, states, absmax, steps, qmaps, hyper, grad_scale, found_inf, scales);
  check_lr_tensor(lr, params, "quantized_step_");
  const SrArgs sr = check_stochastic_round(sr_ids, sr_offsets, sr_seed, params.size(), "quantized_step_");
  if (!params.empty()) {
    TORCH_CHECK(params[0].is_cuda(), "quantized_step_: the CUDA kernel got tensors on ", params[0].device());
  }
  quantized_step_cuda_unchecked(name, params, grads, states, absmax, steps, qmaps, hyper, bits, grad_scale,
                                found_inf, scales, std::nullopt, lr, sr);
}

at::Tensor stochastic_round_bf16_cuda(const at::Tensor& x, const at::Tensor& step, int64_t seed, int64_t id,
                                      int64_t offset) {
  check_stochastic_round_bf16_args(x, step, offset);
  TORCH_CHECK(x.is_cuda(), "stochastic_round_bf16: the CUDA kernel got x on ", x.device());
  return stochastic_round_bf16_cuda_unchecked(x, step, seed, id, offset);
}

void quantized_update_norm_cuda(c10::string_view algorithm, at::TensorList params, at::TensorList grads,
                                at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                at::TensorList qmaps, c10::ArrayRef<double> hyper,
                                const std::optional<at::Tensor>& grad_scale, const at::Tensor& norms,
                                const std::optional<at::Tensor>& lr) {
  const std::string name(algorithm);
  const StateBits bits = check_quantized_step(name, params, grads, states, absmax, steps, qmaps, hyper, grad_scale,
                                              std::nullopt, norms, "norms", at::kDouble);
  check_lr_tensor(lr, params, "quantized_update_norm_");
  if (!params.empty()) {
    TORCH_CHECK(params[0].is_cuda(), "quantized_update_norm_: the CUDA kernel got tensors on ", params[0].device());
  }
  quantized_step_cuda_unchecked(name, params, grads, states, absmax, steps, qmaps, hyper, bits, grad_scale,
                                std::nullopt, std::nullopt, norms, lr);
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CUDA, m) {
  m.impl("quantized_step_", &quantized_step_cuda);
  m.impl("quantized_step_list_", &quantized_step_list<quantized_step_cuda>);
  m.impl("quantized_update_norm_", &quantized_update_norm_cuda);
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
  m.impl("dequantize_blockwise", &dequantize_blockwise_cuda);
  m.impl("stochastic_round_bf16", &stochastic_round_bf16_cuda);
}

}  // namespace pagedopt
