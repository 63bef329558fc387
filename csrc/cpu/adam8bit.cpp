// CPU fused 8-bit Adam/AdamW step: one pass per 256-element block.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "pagedopt/adam.h"
#include "pagedopt/adam_state_list.h"
#include "pagedopt/checks.h"
#include "pagedopt/codebook.h"

namespace pagedopt {
namespace {

template <typename scalar_t>
void adam8bit_tensor_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state1,
                         const at::Tensor& state2, const at::Tensor& absmax1, const at::Tensor& absmax2,
                         const float* code1, const float* code2, const AdamHyper& h, float step,
                         float inv_grad_scale) {
  const AdamStepConstants c = adam_step_constants(h, step);
  const int64_t n = param.numel();
  const int64_t blocks = ceil_div(n, kStateBlockSize);
  scalar_t* p = param.data_ptr<scalar_t>();
  const scalar_t* g = grad.data_ptr<scalar_t>();
  uint8_t* q1 = state1.data_ptr<uint8_t>();
  uint8_t* q2 = state2.data_ptr<uint8_t>();
  float* a1 = absmax1.data_ptr<float>();
  float* a2 = absmax2.data_ptr<float>();
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float m[kStateBlockSize];
    float v[kStateBlockSize];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kStateBlockSize;
      const int64_t len = std::min<int64_t>(kStateBlockSize, n - lo);
      float new_absmax1 = 0.0f;
      float new_absmax2 = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = lo + j;
        const float gf = static_cast<float>(g[i]) * inv_grad_scale;
        m[j] = dequantize_value(code1, q1[i], a1[b]);
        v[j] = dequantize_value(code2, q2[i], a2[b]);
        p[i] = static_cast<scalar_t>(adam_update(static_cast<float>(p[i]), gf, m[j], v[j], c));
        float t1;
        float t2;
        adam_absmax_terms(m[j], v[j], t1, t2);  // an element with a non-finite v counts for neither
        new_absmax1 = std::max(new_absmax1, t1);
        new_absmax2 = std::max(new_absmax2, t2);
      }
      const float inv1 = absmax_reciprocal(new_absmax1);
      const float inv2 = absmax_reciprocal(new_absmax2);
      for (int64_t j = 0; j < len; ++j) {
        q1[lo + j] = quantize_value(code1, m[j], inv1);
        q2[lo + j] = quantize_value(code2, v[j], inv2);
      }
      a1[b] = new_absmax1;
      a2[b] = new_absmax2;
    }
  });
}

void adam8bit_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state1,
                       at::TensorList state2, at::TensorList absmax1, at::TensorList absmax2,
                       at::TensorList steps, const at::Tensor& code1, const at::Tensor& code2, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam8bit_args(params, grads, state1, state2, absmax1, absmax2, steps, code1, code2, grad_scale,
                      found_inf);
  if (found_inf.has_value() && found_inf->item<float>() != 0.0f) return;
  // g * (1 / grad_scale): exact for GradScaler's power-of-two scales, as the CUDA kernel does it.
  const float inv_scale = grad_scale.has_value() ? 1.0f / grad_scale->item<float>() : 1.0f;
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled};
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[i].scalar_type(), "adam8bit_step_cpu", [&] {
      adam8bit_tensor_cpu<scalar_t>(params[i], grads[i], state1[i], state2[i], absmax1[i], absmax2[i],
                                    code1.data_ptr<float>(), code2.data_ptr<float>(), h,
                                    steps[i].item<float>(), inv_scale);
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("adam8bit_step_", &adam8bit_step_cpu);
  m.impl("adam8bit_step_list_", &adam8bit_step_list<adam8bit_step_cpu>);
}

}  // namespace pagedopt
