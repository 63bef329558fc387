#pragma once
// Adagrad, as torch.optim.Adagrad with lr_decay = 0 and initial_accumulator_value = 0:
//   g   += weight_decay * p                                  (L2)
//   sum += g * g
//   p   -= lr * g / (sqrt(sum) + eps)
// One moment (state1). The moment is bit for bit equal on the CPU and the GPU; the parameter's
// sqrt and division are approx_math.h's.
#include "pagedopt/approx_math.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct Adagrad {
  static constexpr int kKeys = 1;     // state1
  static constexpr int kMoments = 1;  // sum = state1
  static constexpr int kHyper = 3;    // lr, eps, weight_decay
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int) { return 0; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    float lr;
    float eps;
    float weight_decay;
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double /*step*/) {
    return Constants{static_cast<float>(h.v[0]), static_cast<float>(h.v[1]), static_cast<float>(h.v[2])};
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    if (c.weight_decay != 0.0f) g = fmaf(c.weight_decay, p, g);
    s[0] = fmaf(g, g, s[0]);
    return fmaf(-c.lr, approx_div(g, approx_sqrt(s[0]) + c.eps), p);
  }
};

}  // namespace pagedopt
