// CPU blockwise quantize / dequantize: 8-bit codes (a 256-entry code) or 4-bit codes packed two a
// byte (a 16-entry code, pagedopt/four_bit.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "pagedopt/checks.h"
#include "pagedopt/codebook.h"
#include "pagedopt/four_bit.h"
#include "pagedopt/stochastic_round.h"

namespace pagedopt {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x_in, const at::Tensor& code,
                                                          int64_t blocksize) {
  const bool four_bit = check_quantize_args(x_in, code, blocksize) == StateBits::k4;
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  at::Tensor codes = four_bit ? at::empty({packed_bytes(n)}, x.options().dtype(at::kByte))
                              : at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({blocks}, x.options().dtype(at::kFloat));
  const float* cb = code.data_ptr<float>();
  uint8_t* q = codes.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_blockwise_cpu", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t lo = b * blocksize;
        const int64_t hi = std::min(n, lo + blocksize);
        float m = 0.0f;
        for (int64_t i = lo; i < hi; ++i) m = std::max(m, finite_abs(static_cast<float>(xs[i])));
        am[b] = m;
        const float inv = absmax_reciprocal(m);
        if (four_bit) {  // lo is even (blocksize is): the block's bytes are its own
          for (int64_t i = lo; i < hi; i += 2) {
            const uint8_t even = quantize_value4(cb, static_cast<float>(xs[i]), inv);
            const uint8_t odd = i + 1 < hi ? quantize_value4(cb, static_cast<float>(xs[i + 1]), inv) : 0;
            q[i >> 1] = pack_nibbles(even, odd);
          }
        } else {
          for (int64_t i = lo; i < hi; ++i) q[i] = quantize_value(cb, static_cast<float>(xs[i]), inv);
        }
      }
    });
  });
  return {codes, absmax};
}

at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes_in, const at::Tensor& absmax_in, const at::Tensor& code,
                                    int64_t blocksize, at::ScalarType dtype) {
  const bool four_bit = check_dequantize_args(codes_in, absmax_in, code, blocksize, dtype) == StateBits::k4;
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor absmax = absmax_in.contiguous();
  const int64_t n = four_bit ? 2 * codes.numel() : codes.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  at::Tensor out = four_bit ? at::empty({n}, codes.options().dtype(dtype))
                            : at::empty(codes.sizes(), codes.options().dtype(dtype));
  const float* cb = code.data_ptr<float>();
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float* am = absmax.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_blockwise_cpu", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t lo = b * blocksize;
        const int64_t hi = std::min(n, lo + blocksize);
        for (int64_t i = lo; i < hi; ++i) {
          o[i] = static_cast<scalar_t>(dequantize_value(cb, four_bit ? nibble_at(q, i) : q[i], am[b]));
        }
      }
    });
  });
  return out;
}

// x rounded to bfloat16 stochastically (pagedopt/stochastic_round.h), element i with the bits of
// index offset + i of parameter `id` at step `step`.
at::Tensor stochastic_round_bf16_cpu(const at::Tensor& x_in, const at::Tensor& step, int64_t seed, int64_t id,
                                     int64_t offset) {
  check_stochastic_round_bf16_args(x_in, step, offset);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const int64_t n = x.numel();
  const uint64_t stream = sr_stream(sr_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(id)), step.item<float>());
  const float* xs = x.data_ptr<float>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      o[i] = round_bf16_stochastic(xs[i], sr_bits(stream, static_cast<uint64_t>(offset + i)));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cpu);
  m.impl("dequantize_blockwise", &dequantize_blockwise_cpu);
  m.impl("stochastic_round_bf16", &stochastic_round_bf16_cpu);
}

}  // namespace pagedopt
