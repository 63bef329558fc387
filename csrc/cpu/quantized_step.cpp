// CPU kernel of the generic quantized-state engine: one fused step of any algorithm of
// pagedopt/algorithms.h over a list of tensors, 8-bit or 4-bit (blockwise codes) or 32-bit states.
// One pass per block (256 elements; 128 for 4-bit states): dequantize the block's moments, run the
// algorithm's update on each element, then requantize with the block's new absmax. The block loop
// is one template over the width (StateBits); 4-bit codes are packed two a byte (pagedopt/four_bit.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "pagedopt/algorithms.h"
#include "pagedopt/checks.h"
#include "pagedopt/codebook.h"
#include "pagedopt/four_bit.h"
#include "pagedopt/quantized_state_list.h"
#include "pagedopt/stochastic_round.h"

namespace pagedopt {
namespace {

// One tensor's moments: moment j's codes (or floats) and, 8-bit and 4-bit, its absmax and codebook.
template <int kMoments>
struct MomentPointers {
  void* data[kMoments];
  float* absmax[kMoments];
  const float* code[kMoments];
};

// Element i's moments (of block b): dequantized codes, or the 32-bit values.
template <int M, StateBits kBits>
inline void load_moments(const MomentPointers<M>& mp, int64_t i, int64_t b, float (&s)[M]) {
  for (int k = 0; k < M; ++k) {
    const auto* q = static_cast<const uint8_t*>(mp.data[k]);
    if constexpr (kBits == StateBits::k8) {
      s[k] = dequantize_value(mp.code[k], q[i], mp.absmax[k][b]);
    } else if constexpr (kBits == StateBits::k4) {
      s[k] = dequantize_value(mp.code[k], nibble_at(q, i), mp.absmax[k][b]);
    } else {
      s[k] = static_cast<const float*>(mp.data[k])[i];
    }
  }
}

// Block [lo, lo + len) of a moment, quantized with `inv` (the reciprocal of its new absmax) into
// its codes: one byte per value (8-bit) or two (4-bit: lo is even, so the block's bytes are its own).
template <StateBits kBits>
inline void store_codes(uint8_t* q, const float* code, const float* values, int64_t lo, int64_t len, float inv) {
  if constexpr (kBits == StateBits::k4) {
    for (int64_t j = 0; j < len; j += 2) {
      const uint8_t even = quantize_value4(code, values[j], inv);
      const uint8_t odd = j + 1 < len ? quantize_value4(code, values[j + 1], inv) : 0;  // an odd n's padding: 0
      q[(lo + j) >> 1] = pack_nibbles(even, odd);
    }
  } else {
    for (int64_t j = 0; j < len; ++j) q[lo + j] = quantize_value(code, values[j], inv);
  }
}

// One tensor's stochastic rounding (pagedopt/stochastic_round.h): its stream at this step and the
// index of its first element in the whole parameter.
struct SrTensor {
  uint64_t stream;
  int64_t offset;
};

// Element i's new value as a parameter of type T: bf16 rounded stochastically when `sr` is given,
// else rounded to nearest even (c10's conversion).
template <typename T>
inline T param_value(float x, const SrTensor* sr, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (sr != nullptr) {
      const uint32_t r = sr_bits(sr->stream, static_cast<uint64_t>(sr->offset + i));
      return c10::BFloat16(round_bf16_stochastic(x, r), c10::BFloat16::from_bits());
    }
  }
  return static_cast<T>(x);
}

template <typename Algo, typename scalar_t, StateBits kBits>
void step_tensor(scalar_t* p, const scalar_t* g, int64_t n, const MomentPointers<Algo::kMoments>& mp,
                 const typename Algo::Constants& c, float inv_scale, const SrTensor* sr) {
  constexpr int M = Algo::kMoments;
  constexpr bool kQuantized = kBits != StateBits::k32;
  constexpr int64_t kBlockSize = state_block_size(kBits);
  const int64_t blocks = ceil_div(n, kBlockSize);
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float moments[M][kBlockSize];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kBlockSize;
      const int64_t len = std::min<int64_t>(kBlockSize, n - lo);
      float new_absmax[M] = {};
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = lo + j;
        float s[M];
        load_moments<M, kBits>(mp, i, b, s);
        const float gf = static_cast<float>(g[i]) * inv_scale;
        p[i] = param_value<scalar_t>(Algo::update(static_cast<float>(p[i]), gf, s, c), sr, i);
        if (kQuantized) {
          const bool counts = element_counts_for_absmax<Algo>(s);
          for (int k = 0; k < M; ++k) {
            moments[k][j] = s[k];
            if (counts) new_absmax[k] = std::max(new_absmax[k], std::fabs(s[k]));
          }
        } else {
          for (int k = 0; k < M; ++k) static_cast<float*>(mp.data[k])[i] = s[k];
        }
      }
      if (kQuantized) {
        for (int k = 0; k < M; ++k) {
          const float inv = absmax_reciprocal(new_absmax[k]);
          store_codes<kBits>(static_cast<uint8_t*>(mp.data[k]), mp.code[k], moments[k], lo, len, inv);
          mp.absmax[k][b] = new_absmax[k];
        }
      }
    }
  });
}

// The sum of squares of the update directions of one tensor (Algo::direction), in double; nothing
// is written. Blocks are summed in order, so the result does not depend on the thread count.
template <typename Algo, typename scalar_t, StateBits kBits>
double update_norm_tensor(const scalar_t* p, const scalar_t* g, int64_t n, const MomentPointers<Algo::kMoments>& mp,
                          const typename Algo::Constants& c, float inv_scale) {
  constexpr int M = Algo::kMoments;
  constexpr int64_t kBlockSize = state_block_size(kBits);
  const int64_t blocks = ceil_div(n, kBlockSize);
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kBlockSize;
      const int64_t len = std::min<int64_t>(kBlockSize, n - lo);
      double sum = 0.0;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = lo + j;
        float s[M];
        load_moments<M, kBits>(mp, i, b, s);
        const double u = Algo::direction(static_cast<float>(p[i]), static_cast<float>(g[i]) * inv_scale, s, c);
        sum += u * u;
      }
      partial[static_cast<size_t>(b)] = sum;
    }
  });
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

// The moment pointers of params[i] (see quantized_step_'s layout of `states` and `absmax`).
template <typename Algo>
MomentPointers<Algo::kMoments> moment_pointers(at::TensorList states, at::TensorList absmax, at::TensorList qmaps,
                                               size_t n, size_t i, int64_t numel, StateBits bits) {
  MomentPointers<Algo::kMoments> mp{};
  const int64_t blocks = ceil_div(numel, state_block_size(bits));
  const int64_t moment_numel = bits == StateBits::k4 ? packed_bytes(numel) : numel;
  for (int j = 0; j < Algo::kMoments; ++j) {
    const size_t key = static_cast<size_t>(Algo::key_of(j));
    const int64_t stack = Algo::stack_of(j);
    const at::Tensor& s = states[key * n + i];
    mp.data[j] = static_cast<uint8_t*>(s.data_ptr()) + stack * moment_numel * s.element_size();
    if (bits != StateBits::k32) {
      mp.absmax[j] = absmax[key * n + i].data_ptr<float>() + stack * blocks;
      mp.code[j] = qmaps[key].data_ptr<float>();
    }
  }
  return mp;
}

// The step for the algorithm `name` of pagedopt/algorithms.h, on arguments that passed
// check_quantized_step (`bits` as it returned it).
void quantized_step_cpu_unchecked(const std::string& name, at::TensorList params, at::TensorList grads,
                                  at::TensorList states, at::TensorList absmax, at::TensorList steps,
                                  at::TensorList qmaps, c10::ArrayRef<double> hyper, StateBits bits,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& scales, const SrArgs& sr) {
  if (found_inf.has_value() && found_inf->item<float>() != 0.0f) return;
  with_algorithm(name, [&](auto algo) {
    using Algo = decltype(algo);
    constexpr int M = Algo::kMoments;
    // g * (1 / grad_scale): exact for GradScaler's power-of-two scales, as the CUDA kernel does it.
    const float inv_scale = grad_scale.has_value() ? 1.0f / grad_scale->item<float>() : 1.0f;
    OptimizerHyper h{};
    std::copy(hyper.begin(), hyper.end(), h.v);
    const size_t n = params.size();
    for (size_t i = 0; i < n; ++i) {
      const int64_t numel = params[i].numel();
      if (numel == 0) continue;
      const MomentPointers<M> mp = moment_pointers<Algo>(states, absmax, qmaps, n, i, numel, bits);
      const float step = steps[i].item<float>();
      auto c = Algo::constants(h, static_cast<double>(step));
      if constexpr (has_update_norm<Algo>::value) {
        if (scales.has_value()) c.update_scale = scales->data_ptr<float>()[i];
      }
      // bf16 parameters only: the others are stored rounded to nearest, as without it
      const SrTensor sr_tensor{sr.on ? sr_stream(sr.key(i), step) : 0, sr.on ? sr.offset(i) : 0};
      const SrTensor* sr_i = sr.on && params[i].scalar_type() == at::kBFloat16 ? &sr_tensor : nullptr;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[i].scalar_type(), "quantized_step_cpu", [&] {
        auto* p = params[i].data_ptr<scalar_t>();
        const auto* g = grads[i].data_ptr<scalar_t>();
        if (bits == StateBits::k8) {
          step_tensor<Algo, scalar_t, StateBits::k8>(p, g, numel, mp, c, inv_scale, sr_i);
        } else if (bits == StateBits::k4) {
          step_tensor<Algo, scalar_t, StateBits::k4>(p, g, numel, mp, c, inv_scale, sr_i);
        } else {
          step_tensor<Algo, scalar_t, StateBits::k32>(p, g, numel, mp, c, inv_scale, sr_i);
        }
      });
    }
  });
}

// hyper with hyper[0] (every algorithm's lr) read from the `lr` tensor, when there is one.
std::vector<double> hyper_with_lr(c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& lr) {
  std::vector<double> h(hyper.begin(), hyper.end());
  if (lr.has_value() && !h.empty()) h[0] = lr->item<double>();
  return h;
}

void quantized_step_cpu(c10::string_view algorithm, at::TensorList params, at::TensorList grads,
                        at::TensorList states, at::TensorList absmax, at::TensorList steps, at::TensorList qmaps,
                        c10::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& lr, at::OptionalIntArrayRef sr_ids,
                        at::OptionalIntArrayRef sr_offsets, int64_t sr_seed) {
  const std::string name(algorithm);
  const StateBits bits =
      check_quantized_step(name, params, grads, states, absmax, steps, qmaps, hyper, grad_scale, found_inf, scales);
  check_lr_tensor(lr, params, "quantized_step_");
  const SrArgs sr = check_stochastic_round(sr_ids, sr_offsets, sr_seed, params.size(), "quantized_step_");
  quantized_step_cpu_unchecked(name, params, grads, states, absmax, steps, qmaps, hyper_with_lr(hyper, lr), bits,
                               grad_scale, found_inf, scales, sr);
}

void quantized_update_norm_cpu(c10::string_view algorithm, at::TensorList params, at::TensorList grads,
                               at::TensorList states, at::TensorList absmax, at::TensorList steps,
                               at::TensorList qmaps, c10::ArrayRef<double> hyper,
                               const std::optional<at::Tensor>& grad_scale, const at::Tensor& norms,
                               const std::optional<at::Tensor>& lr) {
  const std::string name(algorithm);
  const StateBits bits = check_quantized_step(name, params, grads, states, absmax, steps, qmaps, hyper, grad_scale,
                                              std::nullopt, norms, "norms", at::kDouble);
  check_lr_tensor(lr, params, "quantized_update_norm_");
  const float inv_scale = grad_scale.has_value() ? 1.0f / grad_scale->item<float>() : 1.0f;
  OptimizerHyper h{};
  const std::vector<double> hyper_lr = hyper_with_lr(hyper, lr);
  std::copy(hyper_lr.begin(), hyper_lr.end(), h.v);
  double* out = norms.data_ptr<double>();
  with_algorithm(name, [&](auto algo) {
    using Algo = decltype(algo);
    if constexpr (has_update_norm<Algo>::value) {
      const size_t n = params.size();
      for (size_t i = 0; i < n; ++i) {
        const int64_t numel = params[i].numel();
        out[i] = 0.0;
        if (numel == 0) continue;
        const auto mp = moment_pointers<Algo>(states, absmax, qmaps, n, i, numel, bits);
        const auto c = Algo::constants(h, static_cast<double>(steps[i].item<float>()));
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[i].scalar_type(), "quantized_update_norm_cpu",
                                        [&] {
          const auto* p = params[i].data_ptr<scalar_t>();
          const auto* g = grads[i].data_ptr<scalar_t>();
          out[i] = bits == StateBits::k8   ? update_norm_tensor<Algo, scalar_t, StateBits::k8>(p, g, numel, mp, c, inv_scale)
                   : bits == StateBits::k4 ? update_norm_tensor<Algo, scalar_t, StateBits::k4>(p, g, numel, mp, c, inv_scale)
                                           : update_norm_tensor<Algo, scalar_t, StateBits::k32>(p, g, numel, mp, c, inv_scale);
        });
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedopt, CPU, m) {
  m.impl("quantized_step_", &quantized_step_cpu);
  m.impl("quantized_step_list_", &quantized_step_list<quantized_step_cpu>);
  m.impl("quantized_update_norm_", &quantized_update_norm_cpu);
}

}  // namespace pagedopt
