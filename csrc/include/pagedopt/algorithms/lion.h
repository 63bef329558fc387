#pragma once
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as bitsandbytes runs it:
//   p *= 1 - lr * weight_decay                       (decoupled weight decay)
//   p -= lr * sign(beta1 * m + (1 - beta1) * g)
//   m  = beta2 * m + (1 - beta2) * g
// One moment (state1). Only correctly rounded operations (fmaf, *, compares), so the CPU and the
// GPU agree bit for bit on the moment and on the parameter.
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct Lion {
  static constexpr int kKeys = 1;     // state1
  static constexpr int kMoments = 1;  // m = state1
  static constexpr int kHyper = 4;    // lr, beta1, beta2, weight_decay
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int) { return 0; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    float lr;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float decay_factor;  // 1 - lr * weight_decay
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double /*step*/) {
    const double lr = h.v[0], beta1 = h.v[1], beta2 = h.v[2], weight_decay = h.v[3];
    Constants c;
    c.lr = static_cast<float>(lr);
    c.beta1 = static_cast<float>(beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    c.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
    return c;
  }

  // sign(x): -1, 0 or +1, and NaN for NaN (as torch.sign).
  PAGEDOPT_HOST_DEVICE static float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x * 0.0f); }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    p = p * c.decay_factor;
    const float direction = sign(fmaf(c.beta1, s[0], c.one_minus_beta1 * g));
    s[0] = fmaf(c.beta2, s[0], c.one_minus_beta2 * g);
    return fmaf(-c.lr, direction, p);
  }
};

}  // namespace pagedopt
