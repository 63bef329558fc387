"""A stateful property test of checkpoints: an optimizer is stepped, saved and reloaded into a
new optimizer (through torch.save / torch.load(weights_only=True)), has its hyperparameters
changed and param groups added, in any order, and after every rule it equals a pure-torch
reference of the same algorithm that keeps its own state per parameter across all rules.

The reference never calls pagedopt's ops: 8-bit states follow tests/reference.py's
adam8bit_step_reference (pagedopt/adam_update.h's operation order in torch ops), 32-bit states a
float32 torch-ops Adam/AdamW (decoupled decay for the AdamW classes, L2 for the Adam ones).

Tolerances (after a step; every other rule changes no number, so the optimizer must then equal
the reference exactly):

* 8-bit, from tests/test_adam_engine.py (the CPU op against the same reference, one step from
  the same state): absmax within rtol 1e-6; parameters within one ulp of their dtype; all codes but
  max(2, n // 500) equal, the others ties within fp32 rounding, i.e. neighbouring codes.
* 32-bit (torch's fused kernel against the float32 torch ops here): the same formula in a
  possibly different association, each side rounding each operation to within u = 2^-24 relative
  of its result. With G = |g| + wd |p| for L2 decay (g + wd p may cancel, its rounding is u G),
  |g| otherwise: m = beta1 m + (1 - beta1) g within 4u (beta1 |m| + (1 - beta1) G) per side,
  8u for both; v (g^2 carries 2 G of g's rounding, then the square, the product and the sum
  round) within 12u (beta2 v + (1 - beta2) G^2). The update lr / bc1 * m / denom then moves by
  the error of m over denom plus |m| over denom^2 times denom's error
  (err_v / (2 sqrt(v) sqrt(bc2))), doubled for second-order terms, plus its own ~6 roundings
  and the decay and the subtraction (2u |p| per side): 2^-20 = 16u (|p| + |update|). A
  parameter in bf16/fp16 is rounded from the fp32 result: one more ulp of its dtype.

Permitted differences could compound over steps (a tie resolved the other way changes the next
steps' inputs), so after each step, once the check passed, the reference takes over the
optimizer's values; on CPU they are bit for bit the reference's in practice, so this changes
nothing unless a permitted tie occurred.
"""
import io
import math
import warnings

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import pagedopt

# paged classes off CUDA work unpaged and say so once per device; that is not under test here
pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
from pagedopt.quant import STATE_BLOCK_SIZE, dynamic_codebook, second_moment_codebook

from reference import adam8bit_step_reference

VARIANTS = {
    "AdamW8bit": (pagedopt.AdamW8bit, {}),
    "Adam8bit": (pagedopt.Adam8bit, {}),
    "AdamW-bits8": (pagedopt.AdamW, {"optim_bits": 8}),
    "PagedAdam-bits8": (pagedopt.PagedAdam, {"optim_bits": 8}),
    "PagedAdamW8bit": (pagedopt.PagedAdamW8bit, {}),
    "AdamW32bit": (pagedopt.AdamW32bit, {}),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_8BIT = 256
SIZES = [300, 700, 40]  # two above MIN_8BIT (one ends in a partial block), one below
HYPER = ("lr", "betas", "eps", "weight_decay", "optim_bits", "min_8bit_size")
U = 2.0 ** -24
MAX_PARAMS = 7

CODE1, CODE2 = dynamic_codebook(True), second_moment_codebook()


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """One unit in the last place of dtype at |x| (double)."""
    x = x.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(x))) * 2.0 ** -MANTISSA[dtype]


def adam32_step_reference(p, g, m, v, step, lr, beta1, beta2, eps, wd, decoupled):
    """torch.optim.Adam/AdamW's update in float32 torch ops. Returns p (p.dtype), m, v and the
    tolerances of p, m, v against torch's fused kernel (see the module docstring)."""
    pf = p.float().clone()
    gf = g.float()
    if decoupled:
        pf = pf * (1 - lr * wd)
    elif wd != 0:
        gf = gf + wd * pf
    m_new = m * beta1 + (1 - beta1) * gf
    v_new = v * beta2 + (1 - beta2) * gf * gf
    step_size = lr / (1 - beta1**step)
    denom = v_new.sqrt() / math.sqrt(1 - beta2**step) + eps
    upd = step_size * m_new / denom
    pf = pf - upd
    G = (g.float().abs() + wd * p.float().abs()) if (wd != 0 and not decoupled) else g.float().abs()
    tol_m = 8 * U * (beta1 * m.abs() + (1 - beta1) * G).double()
    tol_v = 12 * U * (beta2 * v + (1 - beta2) * G * G).double()
    sqrt_v = v_new.double().sqrt().clamp_min(1e-30)
    tol_denom = tol_v / (2 * sqrt_v * math.sqrt(1 - beta2**step))
    d = denom.double()
    tol_p = (2.0**-20 * (pf.abs() + upd.abs()).double()
             + 2 * step_size * (tol_m / d + m_new.double().abs() * tol_denom / (d * d)))
    if p.dtype != torch.float32:  # rounded to the parameter's dtype from the fp32 result
        tol_p = tol_p + ulp(pf, p.dtype)
    return pf.to(p.dtype), m_new, v_new, tol_p, tol_m, tol_v


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.opt = None

    # ------------------------------------------------------------------ set-up
    @initialize(variant=st.sampled_from(list(VARIANTS)), seed=st.integers(0, 2**31 - 1),
                dtypes=st.lists(st.sampled_from(DTYPES), min_size=len(SIZES), max_size=len(SIZES)))
    def start(self, variant, seed, dtypes):
        self.variant = variant
        self.cls, self.extra = VARIANTS[variant]
        self.decoupled = self.cls.decoupled
        self.gen = torch.Generator().manual_seed(seed)
        self.params = []
        self.ref_p = []      # the reference's own copy of each parameter
        self.ref_state = {}  # parameter index -> the reference's state
        hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, min_8bit_size=MIN_8BIT)
        idx = [self._new_param(n, dt) for n, dt in zip(SIZES, dtypes)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paged classes warn that they work unpaged on the CPU
            self.opt = self.cls([self.params[i] for i in idx], **hyper, **self.extra)
        self.ref_groups = [{"idx": idx, **{k: self.opt.param_groups[0][k] for k in HYPER}}]
        assert self.ref_groups[0]["optim_bits"] == (32 if variant == "AdamW32bit" else 8)
        self.check_exact()

    def _new_param(self, n, dtype) -> int:
        p = torch.randn(n, generator=self.gen).to(dtype).requires_grad_(True)
        self.params.append(p)
        self.ref_p.append(p.detach().clone())
        return len(self.params) - 1

    def _random_grad(self, p):
        return (torch.randn(p.shape, generator=self.gen) * torch.exp(torch.randn(p.shape, generator=self.gen))).to(p.dtype)

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def step(self, data):
        """New random gradients (some None), then a step."""
        none = data.draw(st.lists(st.booleans(), min_size=len(self.params), max_size=len(self.params)))
        for p, is_none in zip(self.params, none):
            p.grad = None if is_none else self._random_grad(p)
        self._step()

    @rule()
    def step_again(self):
        """A step with the gradients as they are (as after set_some_grads_none)."""
        self._step()

    @rule(data=st.data())
    def set_some_grads_none(self, data):
        none = data.draw(st.lists(st.booleans(), min_size=len(self.params), max_size=len(self.params)))
        for p, is_none in zip(self.params, none):
            if is_none:
                p.grad = None
        self.check_exact()

    @rule()
    def save_and_load_into_new_optimizer(self):
        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
        # the new optimizer starts from other hyperparameters: the checkpoint must bring its own
        groups = [{"params": [self.params[i] for i in g["idx"]]} for g in self.ref_groups]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = self.cls(groups, lr=0.5, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.25,
                           min_8bit_size=MIN_8BIT, **self.extra)
        new.load_state_dict(sd)
        self.opt = new
        self.check_exact()

    @rule(data=st.data(), lr=st.sampled_from([1e-4, 3e-3, 2e-2]))
    def change_lr(self, data, lr):
        gi = data.draw(st.integers(0, len(self.ref_groups) - 1))
        self.opt.param_groups[gi]["lr"] = lr
        self.ref_groups[gi]["lr"] = lr
        self.check_exact()

    @rule(data=st.data(), betas=st.sampled_from([(0.8, 0.95), (0.0, 0.99), (0.95, 0.999)]))
    def change_betas(self, data, betas):
        gi = data.draw(st.integers(0, len(self.ref_groups) - 1))
        self.opt.param_groups[gi]["betas"] = betas
        self.ref_groups[gi]["betas"] = betas
        self.check_exact()

    @precondition(lambda self: len(self.params) + 2 <= MAX_PARAMS)
    @rule(sizes=st.lists(st.sampled_from([40, 300, 700, 513]), min_size=1, max_size=2),
          dtype=st.sampled_from(DTYPES), lr=st.sampled_from([1e-3, 5e-3]), wd=st.sampled_from([0.0, 0.05]))
    def add_param_group(self, sizes, dtype, lr, wd):
        idx = [self._new_param(n, dtype) for n in sizes]
        self.opt.add_param_group({"params": [self.params[i] for i in idx], "lr": lr, "weight_decay": wd})
        g = self.opt.param_groups[-1]
        # the new group takes the optimizer's defaults for what it does not set
        assert g["betas"] == self.opt.defaults["betas"] and g["min_8bit_size"] == self.opt.defaults["min_8bit_size"]
        self.ref_groups.append({"idx": idx, **{k: g[k] for k in HYPER}})
        self.check_exact()

    # ------------------------------------------------------------------ the reference step
    def _step(self):
        grads = [None if p.grad is None else p.grad.clone() for p in self.params]
        self.opt.step()
        tolerances = {}
        for group in self.ref_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for i in group["idx"]:
                g = grads[i]
                if g is None:
                    continue
                p = self.ref_p[i]
                r = self.ref_state.get(i)
                if r is None:
                    eight = group["optim_bits"] == 8 and p.numel() >= group["min_8bit_size"]
                    blocks = (p.numel() + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
                    if eight:
                        r = {"state1": torch.zeros(p.shape, dtype=torch.uint8),
                             "state2": torch.zeros(p.shape, dtype=torch.uint8),
                             "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks)}
                    else:
                        r = {"state1": torch.zeros(p.shape), "state2": torch.zeros(p.shape)}
                    r["step"] = 0
                    self.ref_state[i] = r
                r["step"] += 1
                if r["state1"].dtype == torch.uint8:
                    out = adam8bit_step_reference(p, g, r["state1"], r["state2"], r["absmax1"], r["absmax2"],
                                                  r["step"], CODE1, CODE2, lr, beta1, beta2, eps, wd, self.decoupled)
                    self.ref_p[i] = out[0]
                    r.update(state1=out[1], state2=out[2], absmax1=out[3], absmax2=out[4])
                    tolerances[i] = None
                else:
                    pn, m, v, tol_p, tol_m, tol_v = adam32_step_reference(
                        p, g, r["state1"], r["state2"], r["step"], lr, beta1, beta2, eps, wd, self.decoupled)
                    self.ref_p[i] = pn
                    r.update(state1=m, state2=v)
                    tolerances[i] = (tol_p, tol_m, tol_v)
        self.check_after_step(tolerances)

    # ------------------------------------------------------------------ checks
    def _common_checks(self):
        opt = self.opt
        assert len(opt.param_groups) == len(self.ref_groups)
        for g, rg in zip(opt.param_groups, self.ref_groups):
            assert [id(p) for p in g["params"]] == [id(self.params[i]) for i in rg["idx"]]
            for k in HYPER:
                a, b = g[k], rg[k]
                assert (tuple(a) == tuple(b)) if k == "betas" else a == b, (k, a, b)
        with_state = sorted(i for i, p in enumerate(self.params) if len(opt.state.get(p, {})) > 0)
        assert with_state == sorted(self.ref_state), (with_state, sorted(self.ref_state))
        for i, r in self.ref_state.items():
            s = opt.state[self.params[i]]
            assert sorted(k for k in s if k not in ("qmap1", "qmap2")) == sorted(r), (i, sorted(s))
            assert float(s["step"]) == r["step"], (i, float(s["step"]), r["step"])
            if r["state1"].dtype == torch.uint8:
                assert torch.equal(s["qmap1"].cpu(), CODE1) and torch.equal(s["qmap2"].cpu(), CODE2)
            for k in ("state1", "state2", "absmax1", "absmax2"):
                if k in r:
                    assert s[k].dtype == r[k].dtype and s[k].shape == r[k].shape, (i, k, s[k].dtype, s[k].shape)

    def check_exact(self):
        """No arithmetic since the last check: everything equals the reference bit for bit."""
        self._common_checks()
        for i, p in enumerate(self.params):
            assert p.dtype == self.ref_p[i].dtype and torch.equal(p.detach(), self.ref_p[i]), f"param {i}"
        for i, r in self.ref_state.items():
            s = self.opt.state[self.params[i]]
            for k, v in r.items():
                if k != "step":
                    assert torch.equal(s[k], v), f"param {i}: {k}"

    def check_after_step(self, tolerances):
        self._common_checks()
        for i, p in enumerate(self.params):
            got, ref = p.detach(), self.ref_p[i]
            assert got.dtype == ref.dtype
            if i not in tolerances:  # no gradient: untouched
                assert torch.equal(got, ref), f"param {i} changed without a gradient"
            elif tolerances[i] is None:  # 8-bit
                err = (got.double() - ref.double()).abs()
                assert (err <= ulp(ref, ref.dtype)).all(), f"param {i}: {err.max().item()}"
            else:
                tol_p = tolerances[i][0]
                err = (got.double() - ref.double()).abs()
                assert (err <= tol_p).all(), f"param {i}: {(err - tol_p).max().item()}"
        for i, r in self.ref_state.items():
            s = self.opt.state[self.params[i]]
            if i not in tolerances:
                for k, v in r.items():
                    if k != "step":
                        assert torch.equal(s[k], v), f"param {i}: {k} changed without a gradient"
            elif tolerances[i] is None:
                for k in ("absmax1", "absmax2"):
                    torch.testing.assert_close(s[k], r[k], rtol=1e-6, atol=0, msg=f"param {i}: {k}")
                for k in ("state1", "state2"):
                    diff = (s[k].int() - r[k].int()).abs()
                    assert diff.max() <= 1, f"param {i}: {k} differs by more than one code"
                    assert (diff != 0).sum() <= max(2, diff.numel() // 500), f"param {i}: {k}: {(diff != 0).sum()}"
            else:
                _, tol_m, tol_v = tolerances[i]
                for k, tol in (("state1", tol_m), ("state2", tol_v)):
                    err = (s[k].double() - r[k].double()).abs()
                    assert (err <= tol).all(), f"param {i}: {k}: {(err - tol).max().item()}"
        # the reference takes over the optimizer's values (see the module docstring)
        for i, p in enumerate(self.params):
            self.ref_p[i] = p.detach().clone()
        for i, r in self.ref_state.items():
            s = self.opt.state[self.params[i]]
            for k in r:
                if k != "step":
                    r[k] = s[k].detach().clone()


# stateful_step_count: rules per run; with the "ci" profile (15 runs, conftest.py) this keeps the
# file well under a minute on two cores
CheckpointMachine.TestCase.settings = settings(stateful_step_count=50)
TestCheckpoints = CheckpointMachine.TestCase
