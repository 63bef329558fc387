// The one place where every pagedopt operator is declared. Backends (csrc/cpu, csrc/cuda,
// csrc/paging) register implementations with TORCH_LIBRARY_IMPL; Python registers fakes
// in pagedopt/_ops.py.
#include <Python.h>
#include <torch/library.h>

#include "pagedopt/quantized_state_list.h"

extern "C" {
// `import pagedopt._C` loads this library, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(pagedopt, m) {
  // Blockwise quantization: one fp32 absmax per `blocksize` elements, codes index `code`.
  m.def("quantize_blockwise(Tensor x, Tensor code, int blocksize) -> (Tensor, Tensor)");
  m.def(
      "dequantize_blockwise(Tensor codes, Tensor absmax, Tensor code, int blocksize, "
      "ScalarType dtype) -> Tensor");

  // One fused step of the generic quantized-state engine (pagedopt/algorithms.h) over a list of
  // tensors, for `algorithm` ("adam", "lion", "ademamix", ...). `states` holds one list of len(params) tensors
  // per state key (state1, state2), key after key; a key with several moments holds them stacked.
  // 8-bit: uint8 states, `absmax` laid out like `states` and one codebook per key in `qmaps`;
  // 32-bit: float32 states, `absmax` and `qmaps` empty. `hyper`: the algorithm's
  // hyperparameters in its documented order. `steps`: each tensor's step count (already incremented
  // for this step) as a float32 scalar tensor on its device. `scales` (float32, one
  // per parameter): the per-tensor update scales of lars and lamb (see quantized_update_norm_).
  // `lr` (a one-element float32 or float64 tensor on the parameters' device): the learning rate,
  // read by the kernel in place of hyper[0] (every algorithm's first hyperparameter), so that a
  // step captured in a CUDA graph reads the value the tensor holds at each replay (capturable=True).
  // `sr_ids` (one per parameter): bfloat16 parameters are rounded stochastically
  // (pagedopt/stochastic_round.h) with the random bits of (sr_seed, sr_ids[i], steps[i], element
  // index), the index counted from sr_offsets[i] (default 0), the position of params[i]'s first
  // element in its whole parameter when params[i] is a piece of it (or a DTensor's local shard).
  // Parameters of other dtypes are stored rounded to nearest, as without it.
  m.def(
      "quantized_step_(str algorithm, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, "
      "Tensor(c!)[] absmax, Tensor[] steps, Tensor[] qmaps, float[] hyper, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? scales=None, Tensor? lr=None, int[]? sr_ids=None, int[]? sr_offsets=None, "
      "int sr_seed=0) -> ()");

  // The same step with the states, steps and codebooks held by a QuantizedStateList; with `sr_seed`,
  // stochastic rounding with the ids and offsets the list holds (set_sr_ids).
  m.def(
      "quantized_step_list_(__torch__.torch.classes.pagedopt.QuantizedStateList states, Tensor(a!)[] params, "
      "Tensor[] grads, float[] hyper, Tensor? grad_scale, Tensor? found_inf, Tensor? scales=None, "
      "Tensor? lr=None, int? sr_seed=None) -> ()");

  // float32 x rounded to bfloat16 stochastically as quantized_step_ rounds a parameter: element i
  // with the random bits of (seed, id, step, offset + i) (pagedopt/stochastic_round.h). `step`: a
  // float32 one-element tensor on x's device (read there), offset >= 0.
  m.def("stochastic_round_bf16(Tensor x, Tensor step, int seed, int id, int offset=0) -> Tensor");

  // The first pass of the algorithms whose update is scaled per tensor by its norm (lars, lamb):
  // writes into `norms` (float64, one per parameter) the sum of squares of each parameter's update
  // direction, computed from the same inputs as quantized_step_ would, changing nothing else. The
  // optimizer forms each tensor's scale from it and passes the scales to quantized_step_.
  m.def(
      "quantized_update_norm_(str algorithm, Tensor[] params, Tensor[] grads, Tensor[] states, Tensor[] absmax, "
      "Tensor[] steps, Tensor[] qmaps, float[] hyper, Tensor? grad_scale, Tensor(a!) norms, Tensor? lr=None) -> ()");

  // Validation of an optimizer's gradients in one call: the index of the first grads[i] that
  // does not match params[i] (strided layout, same dtype, shape and device, a float32 / bfloat16 /
  // float16 param), else kGradsContiguous (-1) or, when some param or grad is not contiguous,
  // kGradsNotContiguous (-2).
  m.def("check_grads(Tensor[] params, Tensor[] grads) -> int");

  // Unified (managed) memory, CUDA only. `to=None` means host memory.
  m.def("concurrent_managed_access(int device_index) -> bool");
  m.def("managed_empty(int[] size, ScalarType dtype, Device device) -> Tensor");
  m.def("prefetch_(Tensor(a!) t, Device? to) -> ()");
  m.def("advise_preferred_location_(Tensor(a!) t, Device? to) -> ()");
  m.def("is_managed(Tensor t) -> bool");
  m.def("residency(Tensor t) -> int");
  // Copy-engine paging: discard a managed tensor's bytes (their contents become indeterminate and the
  // driver may drop its pages without migrating them), optionally repopulating them at `to`; and
  // exact-size page-locked host memory for the host copies of paged-out or host-resident states.
  m.def("discard_(Tensor(a!) t, Device? to) -> ()");
  m.def("pinned_empty(int[] size, ScalarType dtype) -> Tensor");
  // dst[i] <- src[i] byte for byte (contiguous pairs of equal size, CPU or one CUDA device; GPU copies
  // queued on the current stream): a host-resident group's runs in one call.
  m.def("copy_bytes_(Tensor(a!)[] dst, Tensor[] src) -> ()");
}

// The optimizer steps and the gradient check have no backward: their Autograd key falls through to
// the backend kernel. Without this, torch's autograd fallback runs, a boxed kernel that turns every
// tensor list into IValues and walks each element (about 0.1 us a tensor: with 2000 parameters and
// their four states a step's lists hold 10000 tensors, about 1-2 ms of host time).
TORCH_LIBRARY_IMPL(pagedopt, Autograd, m) {
  for (const char* op : {"quantized_step_", "quantized_step_list_", "quantized_update_norm_", "check_grads",
                         "copy_bytes_"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}
