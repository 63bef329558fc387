"""The float64 oracles of reference_family2.py and their fp32 rounding bounds against
torch.optim.SGD / RMSprop / Adagrad (tests/FAMILY2_SEMANTICS.md: pagedopt follows torch's
semantics). Pure torch, no pagedopt: these run always."""
import pytest
import torch

from reference_family2 import F64, oracle_run, sgd_step, step_bound, torch_run, trajectory_bound

ORACLE_CASES = [
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1, nesterov=False)),
    ("sgd", dict(lr=0.05, momentum=0.8, dampening=0.0, weight_decay=0.1, nesterov=True)),
    ("sgd", dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False)),
    ("rmsprop", dict(lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.1)),
    ("rmsprop", dict(lr=0.01, alpha=0.0, eps=1e-8, weight_decay=0.0)),
    ("rmsprop", dict(lr=0.01, alpha=0.5, eps=1e-3, weight_decay=0.1)),
    ("adagrad", dict(lr=0.01, eps=1e-10, weight_decay=0.1)),
    ("adagrad", dict(lr=0.1, eps=1e-2, weight_decay=0.0)),
]


@pytest.mark.parametrize("algo, hp", ORACLE_CASES)
def test_oracle_matches_torch_float64(algo, hp):
    """20 chained float64 steps of the oracle and of torch.optim from the same start: both are
    within the float64 trajectory bound (reference_family2.trajectory_bound with r = 2^-53) of the
    exact run, so within twice it of each other, parameter and state. The bound functions' own
    values are the oracle's, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(3000, generator=gen, dtype=torch.float64)
    grads = [torch.randn(3000, generator=gen, dtype=torch.float64) * 0.1 for _ in range(20)]
    ours, theirs = oracle_run(algo, hp, p0, grads), torch_run(algo, hp, p0, grads, torch.float64)
    bound = trajectory_bound(algo, p0, grads, hp, r=F64)
    for t, ((pa, sa), (pb, sb), (pr, sr, pe, se, _)) in enumerate(zip(ours, theirs, bound), 1):
        assert torch.equal(pa, pr) and (sr is None or torch.equal(sa, sr))
        assert ((pa - pb).abs() <= 2 * pe).all(), (t, ((pa - pb).abs() - 2 * pe).max())
        if sb is not None:
            assert ((sa - sb).abs() <= 2 * se).all(), t
    # informative: the float64 bound is far below the smallest step taken, so it pins the formula
    assert (bound[-1][2] < 1e-9 * (ours[-1][0] - ours[-2][0]).abs().max()).all()


@pytest.mark.parametrize("algo, hp", ORACLE_CASES)
def test_fp32_bound_holds_for_torch_fp32(algo, hp):
    """The fp32 rounding bounds hold for a real fp32 implementation: torch.optim in float32, 10
    steps, within trajectory_bound(r = 2^-24) of the float64 oracle after every step (the oracle's
    own float64 rounding, ~2^-29 of it, is inside the margins). Ill-conditioned elements (bound =
    cap) must be none here: the gradients keep |g + wd p| well away from 0 relative to its error."""
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(3000, generator=gen)
    grads = [torch.randn(3000, generator=gen) * 0.1 for _ in range(10)]
    theirs = torch_run(algo, hp, p0, grads, torch.float32)
    for t, ((pb, sb), (pr, sr, pe, se, loose)) in enumerate(zip(theirs, trajectory_bound(algo, p0, grads, hp)), 1):
        assert ((pb - pr).abs() <= pe).all(), (t, ((pb - pr).abs() - pe).max())
        if sb is not None:
            assert ((sb - sr).abs() <= se).all(), t
        assert int(loose.sum()) == 0


def test_bounds_reject_the_bitsandbytes_deviations():
    """The one-step fp32 bounds are far tighter than what bitsandbytes does differently
    (FAMILY2_SEMANTICS.md): SGD without dampening, without nesterov; RMSprop / Adagrad with eps
    inside the sqrt, with the raw gradient in the update (CUDA 8-bit kernels), with decoupled
    decay. Each alternative's parameter falls outside the bound for most elements."""
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(2000, generator=gen), torch.randn(2000, generator=gen) * 0.1
    buf = torch.randn(2000, generator=gen, dtype=torch.float64) * 0.1
    v = torch.rand(2000, generator=gen, dtype=torch.float64) * 0.01
    pd = p.double()

    def outside(ref_bound, alt):
        return ((alt - ref_bound[0]).abs() > ref_bound[2]).double().mean().item()

    b = step_bound("sgd", p, g, buf, 2, dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1, nesterov=False))
    assert outside(b, sgd_step(p, g, buf, 2, 0.1, 0.9, 0.0, 0.1, False)[0]) > 0.99
    b = step_bound("sgd", p, g, buf, 2, dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True))
    assert outside(b, sgd_step(p, g, buf, 2, 0.1, 0.9, 0.0, 0.1, False)[0]) > 0.99
    b = step_bound("sgd", p, g, buf, 1, dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1, nesterov=False))
    assert outside(b, pd - 0.1 * 0.5 * (g.double() + 0.1 * pd)) > 0.99  # dampening applied on step 1
    for algo, state, hp in [("rmsprop", v, dict(lr=0.01, alpha=0.9, eps=1e-3, weight_decay=0.1)),
                            ("adagrad", v, dict(lr=0.01, eps=1e-3, weight_decay=0.1))]:
        b = step_bound(algo, p, g, state, 2, hp)
        gw = g.double() + 0.1 * pd
        new_v = b[1]
        assert outside(b, pd - 0.01 * gw / (new_v + hp["eps"]).sqrt()) > 0.9  # eps inside the sqrt
        assert outside(b, pd - 0.01 * g.double() / (new_v.sqrt() + hp["eps"])) > 0.99  # raw g in the update
        v_dec = (hp.get("alpha", 1.0) * state + (1 - hp.get("alpha", 0.0)) * g.double() ** 2)
        assert outside(b, pd * (1 - 0.01 * 0.1) - 0.01 * g.double() / (v_dec.sqrt() + hp["eps"])) > 0.99
