#pragma once
// Adam / AdamW (pagedopt/adam_update.h) as an algorithm of the generic engine: two moments, m in state1
// (signed codebook) and v in state2 (unsigned). Its absmax rule is the engine's: an element whose
// new m or v is not finite counts for neither absmax (a NaN or infinite gradient, or a finite one
// whose square overflows: v = inf, while m may be a huge finite value that would otherwise set
// absmax1 and round the block's other moments to 0 for hundreds of steps).
#include "pagedopt/adam_update.h"
#include "pagedopt/common.h"
#include "pagedopt/optimizer_hyper.h"

namespace pagedopt {

struct Adam {
  static constexpr int kKeys = 2;     // state1, state2
  static constexpr int kMoments = 2;  // m = state1, v = state2
  static constexpr int kHyper = 6;    // lr, beta1, beta2, eps, weight_decay, decoupled (1: AdamW, 0: Adam)
  PAGEDOPT_HOST_DEVICE static constexpr int key_of(int j) { return j; }
  PAGEDOPT_HOST_DEVICE static constexpr int stack_of(int) { return 0; }

  using Constants = AdamStepConstants;

  PAGEDOPT_HOST_DEVICE static Constants constants(const OptimizerHyper& h, double t) {
    const AdamHyper a{h.v[0], h.v[1], h.v[2], h.v[3], h.v[4], h.v[5] != 0.0};
    return adam_step_constants(a, t);
  }

  // The engine's rule (every new moment finite) decided by v alone: m and v see the same g, and
  // one_minus_beta2 > 0 (beta2 < 1), so a non-finite g makes v non-finite, and a finite g (with a
  // finite old m) keeps m finite. One comparison per element instead of two.
  PAGEDOPT_HOST_DEVICE static bool counts_for_absmax(const float (&s)[kMoments]) {
    return fabsf(s[1]) <= 3.40282347e38f;  // false for NaN and +inf
  }

  PAGEDOPT_HOST_DEVICE static float update(float p, float g, float (&s)[kMoments], const Constants& c) {
    return adam_update(p, g, s[0], s[1], c);
  }
};

}  // namespace pagedopt
