"""pagedopt.memory.modes: each paging mode's predicted peak, the recommendation, and the CLI's
--modes. Expectations are computed here from the bytes of a small model's tensors (never read back
from the code under test), and the two facts the predictions rest on are checked against real
optimizers on the CPU: what host residency pins and moves each step, and how many gradient bytes
are alive at once when updates run during backward."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import pagedopt
from pagedopt import memory
from pagedopt.memory import modes
from pagedopt.memory.model import Arch, Model, Tensor

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

MIB, GIB = 1 << 20, 1 << 30
# a decoder-like model: one large embedding (8-bit states), matrices above and below min_8bit_size
# (4096), numels that are not multiples of 256 (partial absmax blocks), a norm
SIZES = [("embed", 1000 * 96, True), ("w1", 96 * 300, False), ("w2", 300 * 96, False), ("small", 50 * 60, False),
         ("norm", 96, False)]
ARCH = Arch(hidden=96, layers=2, heads=4, vocab=1000)


def _model() -> Model:
    return Model([Tensor(n, k, embedding=emb) for n, k, emb in SIZES], ARCH, "test", exact=True)


def _states(numel: int) -> int:
    """pagedopt 8-bit Adam states of one tensor: codes of m and v, two fp32 absmax per 256-block and
    the fp32 step; 32-bit (8 bytes/param) under 4096 elements."""
    if numel >= 4096:
        return 2 * numel + 2 * 4 * math.ceil(numel / 256) + 4
    return 8 * numel + 4


def _expected(weights_bytes: int, act: int, buf: int = 256 * MIB, budget: int = None, total: int = None) -> dict:
    """Each mode's (steady peak, first-step peak) from the module's definitions, context included."""
    n = sum(k for _, k, _ in SIZES)
    w = g = n * weights_bytes
    s = sum(_states(k) for _, k, _ in SIZES)
    counters = 4 * len(SIZES)  # the step counters stay on the GPU; the rest is streamed where not kept
    moved = s - counters
    temps = 8 * sum(k for _, k, _ in SIZES if k < 4096) if weights_bytes == 2 else 0  # 32-bit states' upcast
    t = max(act, temps)
    ctx = memory.CUDA_CONTEXT_BYTES
    largest = max(k for _, k, _ in SIZES) * weights_bytes

    def rel(chunk):  # the largest gradient + two chunks' worth of gradients
        return min(g, int(largest + 2 * chunk / (s / n) * weights_bytes))

    def hybrid(kept, grads):
        b = buf if kept < moved else 0  # no device buffer once every state stays
        return (w + grads + counters + kept + b + t + ctx,) * 2  # the first step releases gradients too
    bud = moved // 2 if budget is None else budget
    out = {
        "resident": (w + g + s + t + ctx, w + g + s + t + ctx),
        "resident_released": (w + rel(64 * MIB) + s + t + ctx,) * 2,
        "budget_released": hybrid(min(bud, moved), rel(buf // 4)),
        "budget": hybrid(min(bud, moved), g),
        "host_released": hybrid(0, rel(buf // 4)),
        "host": hybrid(0, g),
        "managed_budget": (w + g + min(bud, s) + t + ctx,) * 2,
        "states": s, "moved": moved,
    }
    if total is not None:
        kept = max(0, min(moved, total - ctx - (w + g + t) - max(total // 20, GIB) - buf))
        out.update(auto_released=hybrid(kept, rel(buf // 4)), auto=hybrid(kept, g), auto_kept=kept)
    return out


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_each_mode_peak(weights, optimizer):
    e = memory.estimate(_model(), optimizer, weights, batch=2, seq=64, gradient_checkpointing=True)
    exp = _expected(memory.DTYPE_BYTES[weights], e.activations)
    preds = memory.predict_modes(e)
    assert [p.mode for p in preds] == [m for m in memory.MODES if not m.startswith("auto")]  # auto: a GPU given
    paged_resident = optimizer.startswith("paged")
    s, moved = exp["states"], exp["moved"]
    for p in preds:
        assert (p.peak, p.first_step_peak) == exp[p.mode], p.mode
        # torch's allocator sees neither the context nor managed memory (paged states)
        managed_on_gpu = {"resident": s if paged_resident else 0, "resident_released": s if paged_resident else 0,
                          "managed_budget": moved // 2}.get(p.mode, 0)
        assert p.allocator_peak == p.peak - memory.CUDA_CONTEXT_BYTES - managed_on_gpu, p.mode
        assert p.worst_peak == max(p.peak, p.first_step_peak)
    by = {p.mode: p for p in preds}
    # host residency: the moments (not the 4-byte step counters) cross the link both ways every step
    # and are pinned (+ one slab); a budget keeps its share on the GPU and moves the rest
    assert (by["host"].link_h2d, by["host"].link_d2h, by["host"].pinned) == (moved, moved, moved + 64 * MIB)
    rest = moved - moved // 2
    assert (by["budget"].link_h2d, by["budget"].pinned, by["budget"].states_on_gpu) == (rest, rest + 64 * MIB,
                                                                                       s - rest)
    assert (by["resident"].link_h2d, by["resident"].pinned) == (0, 0)
    assert by["managed_budget"].link_h2d == by["managed_budget"].pinned == s - moved // 2
    assert "set_pager(residency=\"host\", update_in_backward=True)" in by["host_released"].how
    assert "PagedAdamW8bit" in by["host"].how and "device_budget=" in by["budget"].how


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_auto_keeps_what_the_gpu_has_free(weights):
    e = memory.estimate(_model(), "paged_adamw_8bit", weights, batch=2, seq=64)
    wb = memory.DTYPE_BYTES[weights]
    base = _expected(wb, e.activations)
    needed = base["host"][1] - 256 * MIB  # everything but the states and the device buffer
    # a GPU where part of the states fits beside a 1 GiB margin (5% of it is less), and one where all do
    for total, partly in ((needed + 256 * MIB + GIB + base["moved"] // 3, True), (needed + 2 * GIB + base["moved"], False)):
        exp = _expected(wb, e.activations, total=total)
        by = {p.mode: p for p in memory.predict_modes(e, capacity=total)}
        assert [m for m in memory.MODES if m in by] == list(memory.MODES)
        for mode in ("auto", "auto_released"):
            assert (by[mode].peak, by[mode].first_step_peak) == exp[mode], (mode, total)
        kept = exp["auto_kept"]
        assert memory.modes.auto_resident(e, total) == kept
        assert (0 < kept < base["moved"]) == partly and (kept == base["moved"]) != partly
        assert by["auto"].link_h2d == base["moved"] - kept and (by["auto"].device_buffer > 0) == partly


def test_torch_adamw_has_only_the_resident_mode():
    e = memory.estimate(_model(), "adamw_torch_fused", "bf16", batch=1, seq=64)
    (p,) = memory.predict_modes(e)
    n = sum(k for _, k, _ in SIZES)
    # bf16 weights, gradients and exp_avg/exp_avg_sq (the params' dtype), fp32 steps; fused: no temporaries
    assert e.state_bytes == 2 * 2 * n + 4 * len(SIZES) and e.step_temporaries == 0
    assert p.peak == 2 * n + 2 * n + e.state_bytes + e.activations + memory.CUDA_CONTEXT_BYTES
    foreach = memory.estimate(_model(), "adamw_torch", "bf16", batch=1, seq=64)
    assert foreach.step_temporaries == 2 * n  # one state-sized list (sqrt of exp_avg_sq)


def test_budget_and_buffer_arguments():
    e = memory.estimate(_model(), "paged_adamw_8bit", "fp32", batch=1, seq=64)
    exp = _expected(4, e.activations, buf=1 * MIB, budget=10_000)
    by = {p.mode: p for p in memory.predict_modes(e, device_buffer="1MiB", budget=10_000)}
    for mode in ("host", "host_released", "budget", "budget_released", "managed_budget"):
        assert (by[mode].peak, by[mode].first_step_peak) == exp[mode], mode
    assert "device_budget='10000'" in by["budget"].how
    with pytest.raises(ValueError, match="budget"):
        memory.predict_modes(e, budget="lots")


def _capacity_between(lo: int, hi: int, margin: float) -> int:
    """A capacity whose margin-reduced size lies between two peaks."""
    return int((lo + hi) / 2 / (1 - margin))


def test_recommendation_picks_the_fastest_mode_that_fits():
    e = memory.estimate(memory.model_from_config("llama2-7b", use_transformers=False), "paged_adamw_8bit", "fp32",
                        batch=1, seq=512, gradient_checkpointing=True)
    by = {p.mode: p for p in memory.predict_modes(e)}
    m = 0.1
    r = memory.recommend(e, 10 * by["resident"].worst_peak, m)
    assert r.mode == "resident" and r.alternatives == ["resident_released", "budget_released", "budget",
                                                       "host_released", "host"]
    # resident does not fit, host does: with gradient clipping or GradScaler (no released gradients)
    # the largest budget that fits
    cap = _capacity_between(by["host"].worst_peak, by["resident"].worst_peak, m)
    r = memory.recommend(e, cap, m, release_ok=False)
    budget = memory.largest_budget(e, cap, m)
    assert budget > 0 and r.mode == "budget" and "auto" in r.reason and r.alternatives == ["host"]
    assert r.how.endswith(f"set_pager(device_budget='{budget >> 30}GiB')")
    more = next(p for p in memory.predict_modes(e, budget=budget + GIB) if p.mode == "budget")
    assert r.prediction.fits(cap, m) and not more.fits(cap, m)  # the largest whole GiB
    assert not by["resident"].fits(cap, m)
    # released gradients (every step's, the first one's too) save more than host residency: states
    # resident with released gradients fit there
    assert by["resident_released"].worst_peak < by["host"].worst_peak
    assert memory.recommend(e, cap, m).mode == "resident_released"
    # room for the host modes and no more: no budget (a budget of 0 is host residency)
    tight = int(by["host"].worst_peak / (1 - m)) + 1
    assert memory.largest_budget(e, tight, m) == 0
    assert memory.recommend(e, tight, m, release_ok=False).mode == "host"
    # room for host states with released gradients only
    tighter = _capacity_between(by["host_released"].worst_peak, by["resident_released"].worst_peak, m)
    assert memory.recommend(e, tighter, m).mode == "host_released"
    assert memory.recommend(e, tighter, m, release_ok=False).mode is None


def test_recommendation_when_nothing_fits():
    e = memory.estimate(memory.model_from_config("llama2-13b", use_transformers=False), "paged_adamw_8bit", "fp32",
                        batch=1, seq=512, gradient_checkpointing=True)
    bf16 = {p.mode: p for p in memory.predict_modes(memory.modes.with_weights(e, "bf16"))}
    host = next(p for p in memory.predict_modes(e) if p.mode == "host")
    m = 0.1
    host_released = next(p for p in memory.predict_modes(e) if p.mode == "host_released")
    cap = _capacity_between(bf16["host_released"].worst_peak, host_released.worst_peak, m)
    assert not host.fits(cap, m) and not host_released.fits(cap, m)
    r = memory.recommend(e, cap, m)
    assert r.mode is None and r.prediction is None and "nothing fits" in r.reason
    assert "with bf16 parameters host_released fits" in r.reason
    r = memory.recommend(e, int(bf16["host"].worst_peak * 0.5), m)
    assert r.mode is None and "bf16" not in r.reason
    t = memory.estimate(e.model, "adamw_torch", "bf16", batch=1, seq=512, gradient_checkpointing=True)
    r = memory.recommend(t, GIB, m)
    assert r.mode is None and "paged_adamw_8bit" in r.reason


def test_fits_margin_boundary():
    e = memory.estimate(_model(), "paged_adamw_8bit", "fp32", batch=1, seq=64)
    p = memory.predict_modes(e)[0]
    cap = p.worst_peak * 4  # exactly 25% margin left at this capacity
    assert p.fits(cap, 0.75) and not p.fits(cap - 4, 0.75)


def test_constants_match_the_library():
    from pagedopt.optim import residency
    from pagedopt.optim.backward_updates import BackwardUpdates
    from pagedopt.paging import host_resident

    assert modes.DEVICE_BUFFER_BYTES == host_resident.DEFAULT_DEVICE_BUFFER
    assert modes.HOST_SLAB_BYTES == host_resident.HOST_SLAB_BYTES
    assert modes.CHUNKS_PER_BUFFER == BackwardUpdates.chunks_per_buffer
    assert memory.PAGED_CHUNK_BYTES == residency.CHUNK_BYTES


def _tiny_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(700, 96), torch.nn.Linear(96, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 96), torch.nn.Linear(96, 700))


def _loss(net):
    ids = torch.randint(0, 700, (4, 16), generator=torch.Generator().manual_seed(3))
    return torch.nn.functional.cross_entropy(net(ids).reshape(-1, 700), ids.reshape(-1))


def _two_paged_steps(**pager):
    """A tiny net and its PagedAdamW8bit with ``set_pager(**pager)``, after two steps."""
    net = _tiny_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = pagedopt.PagedAdamW8bit(net.parameters(), lr=1e-3)
    opt.set_pager(**pager)
    for _ in range(2):
        _loss(net).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def test_host_residency_moves_and_pins_the_predicted_states():
    """A real PagedAdamW8bit with host-resident states (CPU: the same pass, plain copies): the bytes it
    copies in and back each step are the predicted link bytes, and what it keeps on the host is no
    more than the predicted pinned bytes."""
    net, opt = _two_paged_steps(residency="host")
    stats = opt.paging_stats()
    e = memory.estimate(Model(memory.tensors_from_module(net), ARCH, "net", True), "paged_adamw_8bit", "fp32")
    host = next(p for p in memory.predict_modes(e) if p.mode == "host")
    moments = sum(_states(p.numel()) - 4 for p in net.parameters())  # the fp32 step counters stay apart
    assert stats.page_in_bytes_last_step == stats.page_out_bytes_last_step == host.link_h2d == moments
    assert moments <= stats.host_bytes <= host.pinned


def test_a_budget_keeps_about_its_bytes_and_moves_the_rest():
    """A real PagedAdamW8bit with device_budget= (hybrid): the states kept are at most the budget and
    short of it by less than one state tensor (they are placed whole, first come first kept); the
    bytes moved each way are the rest, as predicted up to that shortfall."""
    budget = 150_000
    net, opt = _two_paged_steps(device_budget=budget)
    stats = opt.paging_stats()
    e = memory.estimate(Model(memory.tensors_from_module(net), ARCH, "net", True), "paged_adamw_8bit", "fp32")
    pred = next(p for p in memory.predict_modes(e, budget=budget) if p.mode == "budget")
    moments = sum(_states(p.numel()) - 4 for p in net.parameters())
    largest_state = max(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert budget - largest_state < stats.resident_bytes <= budget
    assert stats.page_in_bytes_last_step == stats.page_out_bytes_last_step == moments - stats.resident_bytes
    assert pred.link_h2d == moments - budget <= stats.page_in_bytes_last_step < pred.link_h2d + largest_state


def test_released_gradients_bound_a_real_backward():
    """Updates during backward with host states (a 64 KiB buffer: 16 KiB chunks): the gradient bytes
    alive at once, counted by a hook that runs before the optimizer's, stay under the prediction; in the
    first step too (updated in chunks as the gradients arrive, its gradients released)."""
    net = _tiny_net()
    params = list(net.parameters())
    live, peaks = [0], []

    def count(p):
        live[0] = max(live[0], sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))
    for p in params:
        p.register_post_accumulate_grad_hook(count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = pagedopt.PagedAdamW8bit(params, lr=1e-3)
    opt.set_pager(residency="host", device_buffer=64 << 10, update_in_backward=True)
    for _ in range(3):
        live[0] = 0
        _loss(net).backward()
        opt.step()
        opt.zero_grad()
        peaks.append(live[0])
    e = memory.estimate(Model(memory.tensors_from_module(net), ARCH, "net", True), "paged_adamw_8bit", "fp32")
    pred = next(p for p in memory.predict_modes(e, device_buffer=64 << 10) if p.mode == "host_released")
    assert 0 < max(peaks) <= pred.gradients < e.gradients


def test_cli_modes_table_and_json(capsys):
    assert memory.main(["--config", "llama2-7b", "--no-transformers", "--weights", "fp32", "--gradient-checkpointing",
                        "--seq", "512", "--modes", "--gpu", "64"]) == 0
    text = capsys.readouterr().out
    for mode in memory.MODES:
        assert f"  {mode} " in text, mode
    # states resident with released gradients fit (the first step releases them too)
    assert "recommended: PagedAdamW8bit(params, ...); opt.set_pager(update_in_backward=True)" in text
    assert memory.main(["--config", "llama2-7b", "--no-transformers", "--weights", "fp32", "--gradient-checkpointing",
                        "--seq", "512", "--modes", "--gpu", "64", "--json", "--no-release"]) == 0
    doc = json.loads(capsys.readouterr().out)
    e = memory.estimate(memory.model_from_config("llama2-7b", use_transformers=False), "paged_adamw_8bit", "fp32",
                        seq=512, gradient_checkpointing=True)
    cap = int(64 * GIB)
    assert doc["recommendation"]["mode"] == memory.recommend(e, cap, release_ok=False).mode == "budget"
    budget = memory.largest_budget(e, cap)
    assert [m["peak"] for m in doc["modes"]] == [p.peak for p in memory.predict_modes(e, budget=budget, capacity=cap)]
    for bad in (["--budget", "lots"], ["--margin", "1.5"], ["--device-buffer", "x"]):
        with pytest.raises(SystemExit):
            memory.main(["--params", "1e9", "--modes", *bad])


def test_weight_casts_under_autocast():
    """fp32 weights under bf16 autocast: a matmul saves its weight's bf16 copy for backward; with
    checkpointing one decoder layer's copies (and lm_head's) are alive at once, without it all."""
    cfg = memory.PRESETS["llama2-7b"]
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    layer = 4 * h * h + 3 * h * inter  # q, k, v, o (32 heads of 128, no GQA) and gate, up, down
    m = memory.model_from_config("llama2-7b", use_transformers=False)
    kw = dict(seq=512, act_dtype="bf16")
    assert memory.estimate(m, "adamw_8bit", "fp32", gradient_checkpointing=True, **kw).weight_casts == \
        2 * (layer + vocab * h)
    plain = memory.estimate(m, "adamw_8bit", "fp32", **kw)
    assert plain.weight_casts == 2 * (layers * layer + vocab * h)
    assert plain.forward_backward == (plain.context + plain.weights + plain.gradients + plain.states_gpu
                                      + plain.activations + plain.weight_casts)
    # no casts: bf16 weights, fp32 activations (no autocast), or unknown shapes
    assert memory.estimate(m, "adamw_8bit", "bf16", **kw).weight_casts == 0
    assert memory.estimate(m, "adamw_8bit", "fp32", seq=512).weight_casts == 0
    assert memory.estimate(memory.model_from_params(7e9), "adamw_8bit", "fp32", **kw).weight_casts == 0
