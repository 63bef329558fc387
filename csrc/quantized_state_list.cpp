// QuantizedStateList::gather_grads (csrc/include/pagedopt/quantized_state_list.h): reads the held
// parameters from their Python objects, so it is compiled here, with torch's Python headers, and
// not in the header that nvcc-compiled and backend files include.
#include <torch/csrc/autograd/python_variable.h>

#include "pagedopt/quantized_state_list.h"

namespace pagedopt {

bool QuantizedStateList::gather_grads() {
  release();
  const size_t n = held_pyobjs.size();
  if (n == 0 || n != steps.size()) return false;
  gathered_params.reserve(n);
  gathered_grads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* obj = static_cast<PyObject*>(held_pyobjs[i]);
    if (!THPVariable_Check(obj)) {
      release();
      return false;
    }
    const at::Tensor& p = THPVariable_Unpack(obj);
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != p.scalar_type() || g.device() != p.device() ||
        g.sizes() != p.sizes() || !g.is_contiguous() || !p.is_contiguous()) {
      release();
      return false;
    }
    gathered_params.push_back(p);
    gathered_grads.push_back(g);
  }
  return true;
}

}  // namespace pagedopt
