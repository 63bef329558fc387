#pragma once
// The Adam/AdamW update of one element, in fp32, shared by the CPU and CUDA kernels.
// It follows torch.optim.Adam/AdamW exactly:
//   Adam  (L2):        g += weight_decay * p
//   AdamW (decoupled): p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
#include <cmath>

#include "pagedopt/common.h"

namespace pagedopt {

struct AdamHyper {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  bool decoupled;
};

// Per-tensor constants that depend on the step count (bias corrections).
struct AdamStepConstants {
  float step_size;            // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float decay_factor;         // 1 - lr * weight_decay, for decoupled decay
};

PAGEDOPT_HOST_DEVICE AdamStepConstants adam_step_constants(const AdamHyper& h, float step) {
  AdamStepConstants c;
  const float bias_correction1 = 1.0f - powf(h.beta1, step);
  const float bias_correction2 = 1.0f - powf(h.beta2, step);
  c.step_size = h.lr / bias_correction1;
  c.bias_correction2_sqrt = sqrtf(bias_correction2);
  c.decay_factor = 1.0f - h.lr * h.weight_decay;
  return c;
}

// Updates p, m, v in place. `g` is the (already unscaled) gradient.
PAGEDOPT_HOST_DEVICE void adam_update(float& p, float g, float& m, float& v, const AdamHyper& h,
                                      const AdamStepConstants& c) {
  if (h.weight_decay != 0.0f) {
    if (h.decoupled) {
      p *= c.decay_factor;
    } else {
      g += h.weight_decay * p;
    }
  }
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  const float denom = sqrtf(v) / c.bias_correction2_sqrt + h.eps;
  p -= c.step_size * m / denom;
}

}  // namespace pagedopt
