#pragma once
// The Adam/AdamW update of one element, in fp32, shared by the CPU and CUDA kernels.
// It follows torch.optim.Adam/AdamW exactly:
//   Adam  (L2):        g += weight_decay * p
//   AdamW (decoupled): p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Scalars derived from the hyperparameters (1 - beta, bias corrections, lr * weight_decay)
// are formed in double and rounded once to float, as torch's fused Adam does.
#include <cmath>

#include "pagedopt/common.h"

namespace pagedopt {

struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;
};

// The fp32 constants one update needs; they depend on the step count through the bias corrections.
struct AdamStepConstants {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;            // for L2 decay, added to the gradient
  float decay_factor;            // 1 - lr * weight_decay, for decoupled decay
  float step_size;               // lr / (1 - beta1^t)
  float bias_correction2_sqrt;   // sqrt(1 - beta2^t)
  bool decoupled;
};

PAGEDOPT_HOST_DEVICE AdamStepConstants adam_step_constants(const AdamHyper& h, float step) {
  AdamStepConstants c;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const double t = static_cast<double>(step);
  c.step_size = static_cast<float>(h.lr / (1.0 - pow(h.beta1, t)));
  c.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, t)));
  c.decoupled = h.decoupled;
  return c;
}

// Updates p, m, v in place. `g` is the (already unscaled) gradient.
PAGEDOPT_HOST_DEVICE void adam_update(float& p, float g, float& m, float& v, const AdamStepConstants& c) {
  if (c.weight_decay != 0.0f) {
    if (c.decoupled) {
      p *= c.decay_factor;
    } else {
      g += c.weight_decay * p;
    }
  }
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  p -= c.step_size * m / denom;
}

}  // namespace pagedopt
