#pragma once
// RMSprop, as torch.optim.RMSprop without momentum and not centered:
//   g += weight_decay * p                                    (L2)
//   v  = alpha * v + (1 - alpha) * g * g
//   p -= lr * g / (sqrt(v) + eps)
// One moment (state1). The moment is bit for bit equal on the CPU and the GPU; the parameter's
// sqrt and division are approx_math.h's.
#include "pagedopt/approx_math.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct RMSprop {
  static constexpr int kKeys = 1;     // state1
  static constexpr int kMoments = 1;  // v = state1
  static constexpr int kHyper = 4;    // lr, alpha, eps, weight_decay
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int) { return 0; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    float lr;
    float alpha;
    float one_minus_alpha;
    float eps;
    float weight_decay;
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double /*step*/) {
    Constants c;
    c.lr = static_cast<float>(h.v[0]);
    c.alpha = static_cast<float>(h.v[1]);
    c.one_minus_alpha = static_cast<float>(1.0 - h.v[1]);
    c.eps = static_cast<float>(h.v[2]);
    c.weight_decay = static_cast<float>(h.v[3]);
    return c;
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    if (c.weight_decay != 0.0f) g = fmaf(c.weight_decay, p, g);
    s[0] = fmaf(c.alpha, s[0], c.one_minus_alpha * g * g);
    return fmaf(-c.lr, approx_div(g, approx_sqrt(s[0]) + c.eps), p);
  }
};

}  // namespace pagedopt
