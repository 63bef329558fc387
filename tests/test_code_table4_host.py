"""The host/device-portable half of csrc/cuda/code_table4.cuh (the 4-bit step kernel's search
table), compiled with the host compiler: no GPU needed, so this runs in CI too.

fast_nearest_code4(table, s, inv) against nearest_code4(code, s * inv): every 4099th float bit
pattern as s with inv = 1 (all of them with PAGEDOPT_BIG_TESTS=1), values around every threshold,
every code and every bucket edge, random (s, inv) pairs over 80 binades, the special values (NaN of
either sign, +-inf, inv = 0, subnormals, values beyond the codebook), for the three 4-bit maps the
optimizers use (which must fit the table) and for random sorted codebooks (those that fit must be
exact; some must fit, some must not). A codebook with two thresholds in one bucket, an unsorted one
and one with a non-finite entry must never be taken for the table search."""
from pagedopt import quant

from host_check import run_host_check

_HOST_CHECK = r"""
#include "code_table4.cuh"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
using namespace pagedopt;
using namespace pagedopt::cuda_detail;

static bool build(const float* code, CodeTable4& t) {
  bool ok = true;
  for (int i = 0; i < 16; ++i) ok = ok && codebook4_entry_ok(code, i);
  for (uint32_t e = 0; e < kBucketEntries4; ++e) {
    t.entry[e] = ok ? bucket4_entry(code, e) : kBadEntry;
    ok = ok && t.entry[e] != kBadEntry;
  }
  return ok;
}

static long unsigned_checked = 0;

// The search with sign, and (for a codebook4_unsigned codebook) the one without, whose saturation
// may give either zero.
static long check(const float* code, const CodeTable4& t, float s, float inv) {
  const uint32_t want = nearest_code4(code, s * inv);
  long bad = fast_nearest_code4(t.entry, s, inv) != want;
  if (codebook4_unsigned(code)) {
    bad += fast_nearest_code4_unsigned(t.entry, s, inv, false) != want;
    bad += fast_nearest_code4_unsigned(t.entry, s, inv, true) != want;
    ++unsigned_checked;
  }
  return bad;
}

// The smallest key whose code is >= j (binary search over all keys).
static uint32_t threshold_key(const float* code, uint32_t j) {
  uint32_t lo = 0x007fffffu, hi = 0xff800000u;  // key(-inf), key(+inf)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (code_rank4(code, mid) >= j) hi = mid; else lo = mid;
  }
  return hi;
}

static long check_codebook(const float* code, uint64_t step, std::mt19937& rng, bool& fits) {
  static CodeTable4 t;
  fits = build(code, t);
  if (!fits) return 0;
  long bad = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += step) bad += check(code, t, bits_f32((uint32_t)u), 1.0f);
  std::vector<uint32_t> keys;
  for (uint32_t j = 1; j < 16; ++j) keys.push_back(threshold_key(code, j));
  for (int i = 0; i < 16; ++i) keys.push_back(float_key(code[i]));
  for (uint32_t b = 0; b <= kBucketTop4 + 1; ++b) {
    keys.push_back(float_key(bits_f32(b << kLowBits4)));
    keys.push_back(float_key(-bits_f32(b << kLowBits4)));
  }
  for (uint32_t k : keys) for (int d = -3; d <= 3; ++d) bad += check(code, t, key_float(k + d), 1.0f);
  // (s, inv) pairs as the kernel forms them: inv = 1 / absmax or 0, |s| up to about absmax
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int i = 0; i < 300000; ++i) {
    const int e = (int)(rng() % 80) - 40;
    const float absmax = std::ldexp(0.5f + 0.5f * std::fabs(unit(rng)), e);
    const float inv = i % 97 == 0 ? 0.0f : absmax_reciprocal(absmax);
    const float s = std::ldexp(unit(rng), e - (int)(rng() % 12));
    bad += check(code, t, s, inv);
    bad += check(code, t, i % 2 ? absmax : -absmax, inv);  // the block's absmax itself
  }
  const float inf = bits_f32(0x7f800000u);
  const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu};
  const float specials[] = {inf, -inf, 0.0f, -0.0f, 1e-45f, -1e-45f, 1.17549435e-38f, -1.17549435e-38f,
                            3e29f, -3e29f, 1.0f, -1.0f, 0.99999994f, -0.99999994f, 1.0000001f, -1.0000001f};
  const float invs[] = {0.0f, 1.0f, 3.5e-3f, 2.5e30f, 8.5e37f, 1e-30f};
  for (float inv : invs) {
    for (float s : specials) bad += check(code, t, s, inv);
    for (uint32_t n : nans) bad += check(code, t, bits_f32(n), inv);
  }
  return bad;
}

static bool load(const char* path, float* code) {
  FILE* in = fopen(path, "rb");
  const bool ok = in && fread(code, sizeof(float), 16, in) == 16;
  if (in) fclose(in);
  return ok;
}

int main(int argc, char** argv) {
  const uint64_t step = strtoull(argv[1], nullptr, 10);
  long bad = 0, maps_unfit = 0, random_fit = 0, random_unfit = 0, wrongly_fit = 0;
  std::mt19937 rng(4321);
  for (int f = 2; f < argc; ++f) {  // the optimizers' 4-bit codebooks, as float32 bytes
    float code[16];
    if (!load(argv[f], code)) return 2;
    bool fits = false;
    bad += check_codebook(code, step, rng, fits);
    maps_unfit += !fits;
    // the signed maps (m's: they hold -1) are not unsigned; the others (v's) take the search without sign
    wrongly_fit += codebook4_unsigned(code) != (code[0] >= 0.0f);
  }
  for (int trial = 0; trial < 60; ++trial) {  // random sorted codebooks: those that fit must be exact
    float code[16];
    for (int i = 0; i < 16; ++i) {
      const float u = std::uniform_real_distribution<float>(-1, 1)(rng);
      code[i] = trial % 2 ? u : std::ldexp(u, -(int)(rng() % 30));
    }
    if (trial % 5 == 4) for (int i = 0; i < 16; ++i) code[i] = std::ldexp((float)((int)(rng() % 9) - 4), -3);
    if (trial % 7 == 6) code[15] = 1.5f;  // a code beyond 1: a threshold in the top bucket, which cannot hold one
    if (trial % 3 == 2) for (int i = 0; i < 16; ++i) code[i] = std::fabs(code[i]);  // without negative codes
    if (trial % 9 == 8) code[0] = code[1] = 0.0f;  // +0 takes code 1, x < 0 code 0: not unsigned
    if (trial % 9 == 5) code[0] = -0.5f;  // one negative code: not unsigned
    std::sort(code, code + 16);
    bool fits = false;
    bad += check_codebook(code, step * 97 + 1, rng, fits);
    random_fit += fits;
    random_unfit += !fits;
  }
  static CodeTable4 t;
  {  // two thresholds in the bucket [0.5, 0.5 + 2^-6): must not fit
    float code[16];
    if (!load(argv[2], code)) return 2;
    code[7] = 0.5f; code[8] = 0.5001f; code[9] = 0.5002f;
    std::sort(code, code + 16);
    wrongly_fit += build(code, t);
  }
  for (int f = 2; f < argc; ++f) {  // unsorted (one adjacent pair swapped), or a non-finite entry
    float base[16];
    if (!load(argv[f], base)) return 2;
    for (int i = 0; i + 1 < 16; ++i) {
      float code[16];
      std::copy(base, base + 16, code);
      std::swap(code[i], code[i + 1]);
      wrongly_fit += build(code, t);
    }
    float code[16];
    std::copy(base, base + 16, code);
    code[15] = bits_f32(0x7f800000u);
    wrongly_fit += build(code, t);
  }
  {  // equal zero codes (the search without sign would give x < 0 the code of +0), or one
     // negative code (x < 0 may be nearer code 1 than code 0): signed searches
    float code[16];
    for (int i = 0; i < 16; ++i) code[i] = i < 2 ? 0.0f : i / 16.0f;
    wrongly_fit += codebook4_unsigned(code);
    code[0] = -0.5f;
    code[1] = 1.0f / 16;
    wrongly_fit += codebook4_unsigned(code);
  }
  printf("search_mismatches=%ld maps_unfit=%ld random_fit=%ld random_unfit=%ld wrongly_fit=%ld unsigned_checked=%ld\n",
         bad, maps_unfit, random_fit, random_unfit, wrongly_fit, unsigned_checked);
  return bad == 0 && maps_unfit == 0 && random_fit > 0 && wrongly_fit == 0 && unsigned_checked > 1000000 ? 0 : 1;
}
"""


def test_host_build_of_the_four_bit_search_table(tmp_path):
    out = run_host_check(tmp_path, "host_check4", _HOST_CHECK,
                         (quant.normal_codebook_4bit(), quant.dynamic_codebook_4bit(True),
                          quant.dynamic_codebook_4bit(False), quant.linear_codebook_4bit_no_zero()))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "random_unfit=0 " not in out.stdout, "every random codebook fit the table: the fallback check saw none"
