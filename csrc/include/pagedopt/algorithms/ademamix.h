#pragma once
// AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"), as
// bitsandbytes runs it, with the paper's warm-up schedules of alpha and beta3:
//   p  *= 1 - lr * weight_decay                              (decoupled weight decay)
//   m1  = beta1 * m1 + (1 - beta1) * g                       (fast EMA)
//   m2  = beta3_t * m2 + (1 - beta3_t) * g                   (slow EMA)
//   nu  = beta2 * nu + (1 - beta2) * g * g
//   p  -= lr * (m1 / (1 - beta1^t) + alpha_t * m2) / (sqrt(nu) / sqrt(1 - beta2^t) + eps)
// with t the step count (1 at the first step) and, when t_alpha / t_beta3 are given (> 0),
//   alpha_t = min(t * alpha / t_alpha, alpha)
//   beta3_t = min(exp(ln(beta1) ln(beta3) / ((1 - t/t_beta3) ln(beta3) + (t/t_beta3) ln(beta1))), beta3)
// (alpha and beta3 otherwise). Three moments in two state tensors: state1 = (m1, m2) stacked,
// state2 = nu. The moments use only correctly rounded operations, so the CPU and the GPU agree on
// them bit for bit; the parameter's sqrt and division are approx_math.h's.
#include <cmath>

#include "pagedopt/approx_math.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"
#include "pagedopt/step_power.h"

namespace pagedopt {

struct AdEMAMix {
  static constexpr int kKeys = 2;     // state1 (2 moments stacked), state2
  static constexpr int kMoments = 3;  // m1 = state1[0], m2 = state1[1], nu = state2
  static constexpr int kHyper = 9;    // lr, beta1, beta2, beta3, alpha, eps, weight_decay, t_alpha, t_beta3
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int j) { return j < 2 ? 0 : 1; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int j) { return j < 2 ? j : 0; }

  struct Constants {
    float lr;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float beta3;  // beta3_t
    float one_minus_beta3;
    float alpha;  // alpha_t
    float eps;
    float decay_factor;               // 1 - lr * weight_decay
    float inv_bias_correction1;       // 1 / (1 - beta1^t)
    float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  };

  // The paper's beta3 schedule at step t of t_beta3 (t_beta3 > 0).
  PAGEDOPT_HOST_DEVICE static double beta3_at(double beta1, double beta3, double t, double t_beta3) {
    if (t >= t_beta3 || beta3 <= 0.0) return beta3;
    if (beta1 <= 0.0) return pow(beta3, t_beta3 / t);  // the formula's limit as beta1 -> 0 (t >= 1)
    const double f = t / t_beta3;
    const double l1 = log(beta1);
    const double l3 = log(beta3);
    const double b = exp(l1 * l3 / ((1.0 - f) * l3 + f * l1));
    return b < beta3 ? b : beta3;
  }

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double t) {
    const double lr = h.v[0], beta1 = h.v[1], beta2 = h.v[2], beta3 = h.v[3], alpha = h.v[4], eps = h.v[5],
                 weight_decay = h.v[6], t_alpha = h.v[7], t_beta3 = h.v[8];
    const double alpha_t = t_alpha > 0.0 && t < t_alpha ? t * alpha / t_alpha : alpha;
    const double beta3_t = t_beta3 > 0.0 ? beta3_at(beta1, beta3, t, t_beta3) : beta3;
    Constants c;
    c.lr = static_cast<float>(lr);
    c.beta1 = static_cast<float>(beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    c.beta3 = static_cast<float>(beta3_t);
    c.one_minus_beta3 = static_cast<float>(1.0 - beta3_t);
    c.alpha = static_cast<float>(alpha_t);
    c.eps = static_cast<float>(eps);
    c.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
    c.inv_bias_correction1 = static_cast<float>(1.0 / (1.0 - pow_step(beta1, t)));
    c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - pow_step(beta2, t)));
    return c;
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    p = p * c.decay_factor;
    s[0] = fmaf(c.beta1, s[0], c.one_minus_beta1 * g);
    s[1] = fmaf(c.beta3, s[1], c.one_minus_beta3 * g);
    s[2] = fmaf(c.beta2, s[2], c.one_minus_beta2 * g * g);
    const float denom = fmaf(approx_sqrt(s[2]), c.inv_bias_correction2_sqrt, c.eps);
    const float numer = fmaf(c.alpha, s[1], s[0] * c.inv_bias_correction1);
    return fmaf(-c.lr, approx_div(numer, denom), p);
  }
};

}  // namespace pagedopt
