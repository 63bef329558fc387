#pragma once
// beta^t for bias corrections, the same float constants on the CPU and the GPU (see pow_step).
// Plain host/device C++: the CPU kernels, the CUDA kernels and a host test
// (tests/test_code_table_host.py) compile it.
#include <cmath>
#include <cstdint>

#include "pagedopt/common.h"

namespace pagedopt {

// IEEE double operations that the compiler may not contract or reassociate.
#if defined(__CUDA_ARCH__)
#define PAGEDOPT_DMUL(a, b) __dmul_rn((a), (b))
#define PAGEDOPT_DADD(a, b) __dadd_rn((a), (b))
#define PAGEDOPT_DSUB(a, b) __dsub_rn((a), (b))
#define PAGEDOPT_DFMA(a, b, c) __fma_rn((a), (b), (c))
#else
// Host builds of this header (tests) must be compiled with -ffp-contract=off.
#define PAGEDOPT_DMUL(a, b) ((a) * (b))
#define PAGEDOPT_DADD(a, b) ((a) + (b))
#define PAGEDOPT_DSUB(a, b) ((a) - (b))
#define PAGEDOPT_DFMA(a, b, c) std::fma((a), (b), (c))
#endif

// ---------------------------------------------------------------------------------------------
// beta^t for the bias corrections.
//
// The CPU kernels compute the bias corrections as 1 - pow(beta, t) in double (glibc pow) and round
// the quotients to float. glibc's pow is within 0.52 ulp, almost always correctly rounded; CUDA's
// pow is within 2 ulp. To make the float constants agree with the CPU's, integer steps use an
// exponentiation by squaring in double-double arithmetic (relative error < 2^-96), so that the
// double result is the correctly rounded one; the float constants derived from it can then only
// differ from the CPU's if glibc misrounds (about 1 in 2500 calls) AND the double quotient lies
// within a few double ulps of a float rounding boundary (at most ~2^-18 even for beta2 = 0.9999,
// t = 1): below 1e-8 per tensor and step. Non-integer, negative or huge t, and |beta| >= 1, use
// the platform pow.
// ---------------------------------------------------------------------------------------------
struct DoubleDouble {
  double hi;
  double lo;
};

PAGEDOPT_HOST_DEVICE DoubleDouble dd_mul(DoubleDouble a, DoubleDouble b) {
  const double p = PAGEDOPT_DMUL(a.hi, b.hi);
  double e = PAGEDOPT_DFMA(a.hi, b.hi, -p);
  e = PAGEDOPT_DFMA(a.hi, b.lo, e);
  e = PAGEDOPT_DFMA(a.lo, b.hi, e);
  const double hi = PAGEDOPT_DADD(p, e);
  const double lo = PAGEDOPT_DSUB(e, PAGEDOPT_DSUB(hi, p));
  return {hi, lo};
}

PAGEDOPT_HOST_DEVICE double pow_step(double x, double t) {
  if (fabs(x) < 1.0 && t >= 0.0 && t <= 2147483647.0 && floor(t) == t) {
    uint32_t n = static_cast<uint32_t>(t);
    DoubleDouble result{1.0, 0.0};
    DoubleDouble base{x, 0.0};
    while (n != 0) {
      if (n & 1u) result = dd_mul(result, base);
      n >>= 1;
      if (n != 0) base = dd_mul(base, base);
    }
    return PAGEDOPT_DADD(result.hi, result.lo);
  }
  return pow(x, t);
}

}  // namespace pagedopt
