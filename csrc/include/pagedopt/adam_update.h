#pragma once
// The Adam/AdamW update of one element, in fp32, shared by the CPU and CUDA kernels.
// It follows torch.optim.Adam/AdamW:
//   Adam  (L2):        g += weight_decay * p
//   AdamW (decoupled): p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// Written for the GPU: fused multiply-adds and a reciprocal of the bias correction. The moments
// use only correctly rounded operations (fmaf, *), so CPU and CUDA compute them bit for bit. The
// parameter's last two operations (sqrt(v), m / denom) use the GPU's approximate instructions
// (sqrt.approx, div.approx: within 2 ulp, subnormals flushed); the CPU uses IEEE sqrt and division there. So the
// two backends agree exactly on the states and to within 2^-20 of the update on the parameter.
// Scalars derived from the hyperparameters (1 - beta, bias corrections, lr * weight_decay) are
// formed in double and rounded once to float.
#include <cmath>

#include "pagedopt/approx_math.h"
#include "pagedopt/common.h"
#include "pagedopt/step_power.h"

namespace pagedopt {

struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;
};

// The fp32 constants one update needs; step_size and inv_bias_correction2_sqrt depend on the
// step count.
struct AdamStepConstants {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float l2_decay;                   // Adam: weight_decay (added to the gradient); AdamW: 0
  float decay_factor;               // AdamW: 1 - lr * weight_decay; Adam: 1
  float step_size;                  // lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
};

// The step-dependent constants from beta1^t and beta2^t (each backend computes those powers).
PAGEDOPT_HOST_DEVICE void adam_bias_constants(double lr, double beta1_pow_t, double beta2_pow_t, float& step_size,
                                              float& inv_bias_correction2_sqrt) {
  step_size = static_cast<float>(lr / (1.0 - beta1_pow_t));
  inv_bias_correction2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - beta2_pow_t));
}

// Every constant at step `step` (beta^t by pow_step: the same floats on the CPU and the GPU).
PAGEDOPT_HOST_DEVICE AdamStepConstants adam_step_constants(const AdamHyper& h, double step) {
  AdamStepConstants c;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.l2_decay = h.decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay_factor = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  adam_bias_constants(h.lr, pow_step(h.beta1, step), pow_step(h.beta2, step), c.step_size,
                      c.inv_bias_correction2_sqrt);
  return c;
}

// One element: `m` and `v` hold the dequantized moments and are updated in place; returns the new
// parameter. `g` is the (already unscaled) gradient.
PAGEDOPT_HOST_DEVICE float adam_update(float p, float g, float& m, float& v, const AdamStepConstants& c) {
  p = p * c.decay_factor;
  if (c.l2_decay != 0.0f) g = fmaf(c.l2_decay, p, g);
  m = fmaf(c.beta1, m, c.one_minus_beta1 * g);
  v = fmaf(c.beta2, v, c.one_minus_beta2 * g * g);
  const float denom = fmaf(approx_sqrt(v), c.inv_bias_correction2_sqrt, c.eps);
  return fmaf(-c.step_size, approx_div(m, denom), p);
}

}  // namespace pagedopt
