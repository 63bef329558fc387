#pragma once
// SGD with momentum, as torch.optim.SGD (plain SGD, momentum = 0, has no state and no functor: the
// optimizer class runs it with torch ops):
//   g  += weight_decay * p                                   (L2)
//   buf = g at the first step, else momentum * buf + (1 - dampening) * g
//   p  -= lr * (nesterov ? g + momentum * buf : buf)
// One moment (state1). Only correctly rounded operations: CPU and GPU agree bit for bit.
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct SGDMomentum {
  static constexpr int kKeys = 1;     // state1
  static constexpr int kMoments = 1;  // buf = state1
  static constexpr int kHyper = 5;    // lr, momentum, dampening, weight_decay, nesterov (1 or 0)
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int) { return 0; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    float lr;
    float momentum;
    float one_minus_dampening;
    float weight_decay;
    bool nesterov;
    bool first;  // the first step: the buffer becomes the gradient
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double t) {
    Constants c;
    c.lr = static_cast<float>(h.v[0]);
    c.momentum = static_cast<float>(h.v[1]);
    c.one_minus_dampening = static_cast<float>(1.0 - h.v[2]);
    c.weight_decay = static_cast<float>(h.v[3]);
    c.nesterov = h.v[4] != 0.0;
    c.first = t <= 1.0;
    return c;
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    if (c.weight_decay != 0.0f) g = fmaf(c.weight_decay, p, g);
    s[0] = c.first ? g : fmaf(c.momentum, s[0], c.one_minus_dampening * g);
    const float direction = c.nesterov ? fmaf(c.momentum, s[0], g) : s[0];
    return fmaf(-c.lr, direction, p);
  }
};

}  // namespace pagedopt
