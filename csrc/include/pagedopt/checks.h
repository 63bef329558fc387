#pragma once
// Argument checks shared by the CPU and CUDA host code. Every message names the offending
// argument (and list index), and all checks run before any tensor is written.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <utility>

#include "pagedopt/common.h"
#include "pagedopt/four_bit.h"
#include "pagedopt/stochastic_round.h"

namespace pagedopt {

inline bool is_supported_param_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A codebook of 256 entries (8-bit codes) or 16 (4-bit codes); returns which.
inline StateBits check_codebook(const at::Tensor& code, const char* name, const at::Device& device) {
  TORCH_CHECK(code.scalar_type() == at::kFloat, name, " must be float32, got ", code.scalar_type());
  TORCH_CHECK(code.numel() == kCodebookSize || code.numel() == kCodebookSize4, name, " must have ", kCodebookSize,
              " entries (8-bit codes) or ", kCodebookSize4, " (4-bit codes), got ", code.numel());
  TORCH_CHECK(code.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(code.device() == device, name, " is on ", code.device(), " but the data is on ", device);
  return code.numel() == kCodebookSize4 ? StateBits::k4 : StateBits::k8;
}

inline void check_blocksize(int64_t blocksize) {
  TORCH_CHECK(blocksize > 0 && blocksize % 32 == 0 && blocksize <= 4096,
              "blocksize must be a positive multiple of 32 and at most 4096, got ", blocksize);
}

// Returns the width of the codes: 8-bit (a 256-entry code: one byte per value, shaped like x) or
// 4-bit (a 16-entry code: two values per byte, pagedopt/four_bit.h, a 1-D tensor of ceil(n / 2)
// bytes). Any blocksize check_blocksize accepts (all even, so a byte never spans two blocks).
inline StateBits check_quantize_args(const at::Tensor& x, const at::Tensor& code, int64_t blocksize) {
  check_blocksize(blocksize);
  TORCH_CHECK(is_supported_param_dtype(x.scalar_type()), "quantize_blockwise: x has unsupported dtype ",
              x.scalar_type(), " (float32, bfloat16, float16 are supported)");
  return check_codebook(code, "code", x.device());
}

// 4-bit codes (a 16-entry code) dequantize to 2 * codes.numel() values, 1-D: for an odd number of
// values the caller drops the last one (its code is the padding nibble 0).
inline StateBits check_dequantize_args(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
                                  int64_t blocksize, at::ScalarType dtype) {
  check_blocksize(blocksize);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "dequantize_blockwise: codes must be uint8, got ",
              codes.scalar_type());
  TORCH_CHECK(absmax.scalar_type() == at::kFloat, "dequantize_blockwise: absmax must be float32, got ",
              absmax.scalar_type());
  TORCH_CHECK(is_supported_param_dtype(dtype), "dequantize_blockwise: unsupported output dtype ", dtype);
  const StateBits bits = check_codebook(code, "code", codes.device());
  TORCH_CHECK(absmax.device() == codes.device(), "dequantize_blockwise: absmax is on ", absmax.device(),
              " but codes are on ", codes.device());
  const int64_t values = bits == StateBits::k4 ? 2 * codes.numel() : codes.numel();
  const int64_t blocks = ceil_div(values, blocksize);
  TORCH_CHECK(absmax.numel() == blocks, "dequantize_blockwise: absmax must have ", blocks, " elements for ",
              values, " codes in blocks of ", blocksize, ", got ", absmax.numel());
  return bits;
}

// The arguments of quantized_step_ (see csrc/pagedopt.cpp) for an algorithm with `keys` state keys,
// key k holding stacks[k] moments per parameter. Returns the width of the states: 8-bit (uint8 codes
// with absmax and 256-entry codebooks), 4-bit (uint8, two codes a byte, pagedopt/four_bit.h, with
// 16-entry codebooks: the codebooks' size decides) or 32-bit (float32, absmax and qmaps empty).
// Every key of one call has the same width.
inline StateBits check_quantized_step_args(int keys, const int* stacks, int hyper_count, at::TensorList params,
                                      at::TensorList grads, at::TensorList states, at::TensorList absmax,
                                      at::TensorList steps, at::TensorList qmaps, c10::ArrayRef<double> hyper,
                                      const std::optional<at::Tensor>& grad_scale,
                                      const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  const size_t k = static_cast<size_t>(keys);
  TORCH_CHECK(hyper.size() == static_cast<size_t>(hyper_count), "quantized_step_: hyper must hold ", hyper_count,
              " values for this algorithm, got ", hyper.size());
  TORCH_CHECK(grads.size() == n && steps.size() == n && states.size() == k * n,
              "quantized_step_: expected ", n, " grads, ", n, " steps and ", k, " x ", n,
              " states (one list per state key, key after key); got grads=", grads.size(), " steps=", steps.size(),
              " states=", states.size());
  const bool quantized = n > 0 && states[0].scalar_type() == at::kByte;  // 8-bit or 4-bit
  if (quantized) {
    TORCH_CHECK(absmax.size() == k * n && qmaps.size() == k, "quantized_step_: 8-bit and 4-bit states need ", k,
                " x ", n, " absmax tensors and ", k, " codebooks; got absmax=", absmax.size(),
                " qmaps=", qmaps.size());
  } else {
    TORCH_CHECK(absmax.empty() && qmaps.empty(),
                "quantized_step_: 32-bit states take no absmax and no codebooks; got absmax=", absmax.size(),
                " qmaps=", qmaps.size());
  }
  if (n == 0) return StateBits::k32;
  const at::Device device = params[0].device();
  StateBits bits = quantized ? StateBits::k8 : StateBits::k32;
  for (size_t key = 0; quantized && key < k; ++key) {
    const std::string name = "qmap" + std::to_string(key + 1);
    const StateBits key_bits = check_codebook(qmaps[key], name.c_str(), device);
    if (key == 0) bits = key_bits;
    TORCH_CHECK(key_bits == bits, "quantized_step_: ", name, " has ", qmaps[key].numel(), " entries (",
                static_cast<int>(key_bits), "-bit states) but qmap1 has ", qmaps[0].numel(), " (",
                static_cast<int>(bits), "-bit states): the state keys of one call must share one width");
  }
  const bool four_bit = bits == StateBits::k4;
  const int64_t block = state_block_size(bits);
  const at::ScalarType state_dtype = quantized ? at::kByte : at::kFloat;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    TORCH_CHECK(p.device() == device, "params[", i, "] is on ", p.device(), ", params[0] on ", device);
    TORCH_CHECK(is_supported_param_dtype(p.scalar_type()), "params[", i, "] has unsupported dtype ",
                p.scalar_type(), " (float32, bfloat16, float16 are supported)");
    TORCH_CHECK(p.is_contiguous(), "params[", i, "] must be contiguous");
    TORCH_CHECK(g.layout() == at::kStrided, "grads[", i, "] is sparse; sparse gradients are not supported");
    TORCH_CHECK(g.scalar_type() == p.scalar_type(), "grads[", i, "] has dtype ", g.scalar_type(), " but params[",
                i, "] has dtype ", p.scalar_type());
    TORCH_CHECK(g.sizes() == p.sizes(), "grads[", i, "] has shape ", g.sizes(), " but params[", i, "] has shape ",
                p.sizes());
    TORCH_CHECK(g.device() == device && g.is_contiguous(), "grads[", i, "] must be contiguous and on ", device);
    const int64_t numel = p.numel();
    const int64_t blocks = ceil_div(numel, block);
    const int64_t moment_numel = four_bit ? packed_bytes(numel) : numel;
    for (size_t key = 0; key < k; ++key) {
      const at::Tensor& s = states[key * n + i];
      TORCH_CHECK(s.scalar_type() == state_dtype, "state", key + 1, "[", i, "] must be ", state_dtype,
                  " (the states of one call share one width), got ", s.scalar_type());
      TORCH_CHECK(s.numel() == stacks[key] * moment_numel, "state", key + 1, "[", i, "] has ", s.numel(),
                  " elements, expected ", stacks[key], " x ", moment_numel,
                  four_bit ? " (4-bit states: ceil(n / 2) bytes per moment)" : "");
      TORCH_CHECK(s.is_contiguous() && s.device() == device, "state", key + 1, "[", i,
                  "] must be contiguous and on ", device);
      if (quantized) {
        const at::Tensor& a = absmax[key * n + i];
        TORCH_CHECK(a.scalar_type() == at::kFloat, "absmax", key + 1, "[", i, "] must be float32, got ",
                    a.scalar_type());
        TORCH_CHECK(a.numel() == stacks[key] * blocks, "absmax", key + 1, "[", i, "] must have ",
                    stacks[key] * blocks, " elements (", stacks[key], " x one per ", block, "), got ",
                    a.numel());
        TORCH_CHECK(a.is_contiguous() && a.device() == device, "absmax", key + 1, "[", i,
                    "] must be contiguous and on ", device);
      }
    }
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == device,
                "steps[", i, "] must be a float32 tensor with one element on ", device);
  }
  for (const auto& [t, name] : {std::pair<const std::optional<at::Tensor>&, const char*>{grad_scale, "grad_scale"},
                                {found_inf, "found_inf"}}) {
    if (t.has_value()) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, name,
                  " must be a float32 tensor with one element");
      TORCH_CHECK(t->device() == device, name, " is on ", t->device(), ", params on ", device);
    }
  }
  return bits;
}

// The `lr` tensor of quantized_step_ / quantized_update_norm_ (capturable steps): one float32 or
// float64 element on the parameters' device.
inline void check_lr_tensor(const std::optional<at::Tensor>& lr, at::TensorList params, const char* op) {
  if (!lr.has_value() || params.empty()) return;
  const at::Tensor& t = *lr;
  TORCH_CHECK_VALUE((t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) && t.numel() == 1, op,
                    ": lr must be a float32 or float64 tensor with one element, got ", t.scalar_type(), " of shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.device() == params[0].device(), op, ": lr is on ", t.device(), ", params on ",
                    params[0].device());
}

// stochastic_round_bf16's arguments (csrc/pagedopt.cpp).
inline void check_stochastic_round_bf16_args(const at::Tensor& x, const at::Tensor& step, int64_t offset) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "stochastic_round_bf16: x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(step.scalar_type() == at::kFloat && step.numel() == 1, "stochastic_round_bf16: step must be a "
                    "float32 tensor with one element, got ", step.scalar_type(), " of shape ", step.sizes());
  TORCH_CHECK_VALUE(step.device() == x.device(), "stochastic_round_bf16: step is on ", step.device(), ", x on ",
                    x.device());
  TORCH_CHECK_VALUE(offset >= 0, "stochastic_round_bf16: offset = ", offset, " must be >= 0");
}

// The stochastic rounding arguments of quantized_step_ (csrc/pagedopt.cpp), checked: on when
// `sr_ids` is given (one id per parameter), `sr_offsets` (optional: zeros) the index of each
// tensor's first element in its whole parameter (>= 0).
struct SrArgs {
  bool on = false;
  uint64_t seed = 0;
  c10::ArrayRef<int64_t> ids;
  c10::ArrayRef<int64_t> offsets;  // empty: every tensor starts its parameter

  uint64_t key(size_t i) const { return sr_key(seed, static_cast<uint64_t>(ids[i])); }
  int64_t offset(size_t i) const { return offsets.empty() ? 0 : offsets[i]; }
};

inline SrArgs check_stochastic_round(at::OptionalIntArrayRef sr_ids, at::OptionalIntArrayRef sr_offsets,
                                     int64_t sr_seed, size_t n, const char* op) {
  SrArgs sr;
  if (!sr_ids.has_value()) {
    TORCH_CHECK_VALUE(!sr_offsets.has_value(), op, ": sr_offsets given without sr_ids");
    return sr;
  }
  TORCH_CHECK_VALUE(sr_ids->size() == n, op, ": sr_ids must hold one id per parameter (", n, "), got ",
                    sr_ids->size());
  if (sr_offsets.has_value()) {
    TORCH_CHECK_VALUE(sr_offsets->size() == n, op, ": sr_offsets must hold one offset per parameter (", n,
                      "), got ", sr_offsets->size());
    for (size_t i = 0; i < n; ++i) {
      const int64_t o = (*sr_offsets)[i];
      TORCH_CHECK_VALUE(o >= 0, op, ": sr_offsets[", i, "] = ", o, " must be >= 0");
    }
    sr.offsets = *sr_offsets;
  }
  sr.on = true;
  sr.seed = static_cast<uint64_t>(sr_seed);
  sr.ids = *sr_ids;
  return sr;
}

}  // namespace pagedopt
