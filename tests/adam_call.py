"""Adam's fused 8-bit step as the tests call it: the generic engine's op quantized_step_ with the
Adam functor (csrc/include/pagedopt/algorithms/adam.h), its hyperparameters passed by name."""
from pagedopt import _ops


def adam_hyper(lr, beta1, beta2, eps, weight_decay, decoupled):
    """Adam's hyper list in the functor's order (Adam::kHyper): lr, beta1, beta2, eps, weight_decay,
    decoupled (1: AdamW's decoupled decay, 0: Adam's L2 decay)."""
    return [float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), 1.0 if decoupled else 0.0]


def adam8bit_step(params, grads, state1, state2, absmax1, absmax2, steps, code1, code2, *, lr, beta1, beta2, eps,
                  weight_decay, decoupled, grad_scale=None, found_inf=None):
    """One fused 8-bit Adam/AdamW step over lists of tensors: quantized_step_("adam", ...) with
    state1 (m, signed codebook code1) and state2 (v, unsigned codebook code2) as its two keys."""
    eight_bit = len(params) > 0  # empty lists: nothing to update, no width to check codebooks against
    _ops.quantized_step_("adam", list(params), list(grads), [list(state1), list(state2)],
                         [list(absmax1), list(absmax2)] if eight_bit else [], list(steps),
                         [code1, code2] if eight_bit else [],
                         adam_hyper(lr, beta1, beta2, eps, weight_decay, decoupled),
                         grad_scale=grad_scale, found_inf=found_inf)
