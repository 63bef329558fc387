#pragma once
// The square root and division of the optimizers' parameter updates: on the GPU its fast
// approximate instructions, on the CPU IEEE operations (see adam_update.h for what that costs in
// agreement between the backends: the states stay bit for bit equal, the parameters agree to
// within 2^-20 of the update).
#include <cmath>

#include "pagedopt/common.h"

namespace pagedopt {

// sqrt(x) and a / b: on the GPU its fast approximations (sqrt.approx, div.approx; within 2 ulp,
// inputs and results below 2^-126 flushed to zero), on the CPU IEEE operations.
PAGEDOPT_HOST_DEVICE float approx_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return std::sqrt(x);
#endif
}

PAGEDOPT_HOST_DEVICE float approx_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a / b;
#endif
}

}  // namespace pagedopt
