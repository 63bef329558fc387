#pragma once
// LAMB as bitsandbytes runs it: Adam (algorithms/adam.h; decoupled decay with adam_w_mode, L2
// otherwise) whose update u = m_hat / (sqrt(v_hat) + eps) is scaled down when its norm exceeds
// max_unorm times the parameter's norm:
//   scale = min(1, max_unorm * ||p|| / ||u||) per tensor (1 when max_unorm = 0)
//   p     = p * (1 - lr * weight_decay) - lr * scale * u       (adam_w_mode)
// Without bias_correction, m_hat = m and v_hat = v. The engine computes ||u|| in a first pass
// (quantized_update_norm_, from direction()); the optimizer passes the scale to the step.
#include "pagedopt/adam_update.h"
#include "pagedopt/approx_math.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct LAMB {
  static constexpr int kKeys = 2;
  static constexpr int kMoments = 2;  // m = state1, v = state2
  // lr, beta1, beta2, eps, weight_decay, decoupled (adam_w_mode), bias_correction (1 or 0)
  static constexpr int kHyper = 7;
  static constexpr bool kUpdateNorm = true;
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int j) { return j; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    AdamStepConstants adam;
    float lr;
    float inv_bias_correction1;  // 1 / (1 - beta1^t), or 1 without bias correction
    float update_scale;          // set per tensor by the engine
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double t) {
    const AdamHyper a{h.v[0], h.v[1], h.v[2], h.v[3], h.v[4], h.v[5] != 0.0};
    const bool bias_correction = h.v[6] != 0.0;
    Constants c;
    c.adam = adam_step_constants(a, t);
    c.lr = static_cast<float>(h.v[0]);
    c.inv_bias_correction1 = bias_correction ? static_cast<float>(1.0 / (1.0 - pow_step(h.v[1], t))) : 1.0f;
    if (!bias_correction) c.adam.inv_bias_correction2_sqrt = 1.0f;
    c.update_scale = 1.0f;
    return c;
  }

  PAGEDOPT_HOST_DEVICE static float direction(float p, float g, float (&s)[kMoments], const Constants& c) {
    const AdamStepConstants& k = c.adam;
    if (k.l2_decay != 0.0f) g = fmaf(k.l2_decay, p, g);
    s[0] = fmaf(k.beta1, s[0], k.one_minus_beta1 * g);
    s[1] = fmaf(k.beta2, s[1], k.one_minus_beta2 * g * g);
    const float denom = fmaf(approx_sqrt(s[1]), k.inv_bias_correction2_sqrt, k.eps);
    return approx_div(s[0] * c.inv_bias_correction1, denom);
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    const float u = direction(p, g, s, c);
    return fmaf(-(c.lr * c.update_scale), u, p * c.adam.decay_factor);
  }
};

}  // namespace pagedopt
