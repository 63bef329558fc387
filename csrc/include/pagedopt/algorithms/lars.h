#pragma once
// LARS as bitsandbytes runs it: SGD with momentum (algorithms/sgd.h, torch's semantics) whose update
// is scaled down when its norm exceeds max_unorm times the parameter's norm:
//   d      = the SGD-momentum direction (buf, or g + momentum * buf with nesterov)
//   scale  = min(1, max_unorm * ||p|| / ||d||) per tensor (1 when max_unorm = 0)
//   p     -= lr * scale * d
// The engine computes ||d|| in a first pass (quantized_update_norm_, from direction()); the
// optimizer forms the scale and passes it to the step (Constants::update_scale).
#include "pagedopt/algorithms/sgd.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct LARS {
  static constexpr int kKeys = 1;
  static constexpr int kMoments = 1;
  static constexpr int kHyper = 5;  // lr, momentum, dampening, weight_decay, nesterov (as SGDMomentum)
  static constexpr bool kUpdateNorm = true;
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int) { return 0; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  struct Constants {
    SGDMomentum::Constants sgd;
    float update_scale;  // set per tensor by the engine
  };

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double t) {
    return Constants{SGDMomentum::constants(h, t), 1.0f};
  }

  // The update direction of one element; the moment is updated in s as update() updates it.
  PAGEDOPT_HOST_DEVICE static float direction(float p, float g, float (&s)[kMoments], const Constants& c) {
    const SGDMomentum::Constants& k = c.sgd;
    if (k.weight_decay != 0.0f) g = fmaf(k.weight_decay, p, g);
    s[0] = k.first ? g : fmaf(k.momentum, s[0], k.one_minus_dampening * g);
    return k.nesterov ? fmaf(k.momentum, s[0], g) : s[0];
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    const float d = direction(p, g, s, c);
    return fmaf(-(c.sgd.lr * c.update_scale), d, p);
  }
};

}  // namespace pagedopt
