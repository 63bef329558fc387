#pragma once
// The hyperparameters of one fused optimizer call, as the op's `float[] hyper` list: each
// algorithm (pagedopt/algorithms/*.h) documents the order of its kHyper values.
#include "pagedopt/common.h"

namespace pagedopt {

constexpr int kMaxHyper = 12;

struct OptimizerHyper {
  double v[kMaxHyper];
};

}  // namespace pagedopt
