"""4-bit optimizer states (``optim_bits=4``, ``AdamW4bit``, ``PagedAdamW4bit``, ``Lion4bit``, ...) at
the optimizer's level: the state layout and its bytes, every way through a step (resident, fast
step, host-resident streaming in pieces, hybrid, updates during backward) bit for bit the same,
checkpoints (``torch.save`` / ``torch.load(weights_only=True)``, exact resume, refused loads that
change nothing), torch Adam checkpoints read into 4-bit states, and the loss of a small problem
against fp32 AdamW. The kernels themselves are held to a pure-torch reference in the engine's
tests (test_four_bit_engine.py)."""
from __future__ import annotations

import copy
import inspect
import io
import math

import pytest
import torch

import pagedopt
from pagedopt.optim.state_format import CODES4
from pagedopt.quant import linear_codebook_4bit_no_zero, normal_codebook_4bit

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FOUR_BIT = ["Adam4bit", "AdamW4bit", "PagedAdam4bit", "PagedAdamW4bit", "Lion4bit", "PagedLion4bit"]


def _params(device, seed=0):
    """A large contiguous parameter (cut into pieces when streamed: odd rows of an even width), an
    odd-sized one (its last byte holds one code), a non-contiguous one, and one under
    min_8bit_size (32-bit states)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 514), (20001,), (300, 40), (20,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    ps.append(torch.nn.Parameter(torch.randn(80, 48, generator=g).to(device).t()))  # non-contiguous
    return ps


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) * (1 + step) for p in params]


def _run(name, device, steps=4, pager_args=None, seed=0, **kwargs):
    params = _params(device, seed)
    opt = getattr(pagedopt, name)(params, lr=1e-2, min_8bit_size=1024, **kwargs)
    if pager_args is not None:
        opt.set_pager(**pager_args)
    for s in range(steps):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        opt.step()
    return params, opt


def _assert_same(a_params, a_opt, b_params, b_opt):
    for i, (p, q) in enumerate(zip(a_params, b_params)):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"param {i}"
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.cpu(), sb[k].cpu()), (i, k)


# ---------------------------------------------------------------- classes and names
@pytest.mark.parametrize("name", FOUR_BIT)
def test_four_bit_classes_keep_their_family_signature(name):
    cls = getattr(pagedopt, name)
    eight = getattr(pagedopt, name.replace("4bit", "8bit"))
    assert inspect.signature(cls) == inspect.signature(eight)
    assert name in pagedopt.__all__
    p = torch.nn.Parameter(torch.randn(4096))
    assert cls([p]).param_groups[0]["optim_bits"] == 4
    assert cls([p]).is_paged == name.startswith("Paged")


def test_a_four_bit_class_refuses_another_width():
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match="optim_bits=8 is not valid for AdamW4bit"):
        pagedopt.AdamW4bit([p], optim_bits=8)
    with pytest.raises(ValueError, match=r"optim_bits.*must be 4, 8 or 32"):
        pagedopt.AdamW([p], optim_bits=2)


def test_trainer_names_of_the_four_bit_classes():
    from pagedopt.integrations.transformers import NAMES

    assert NAMES["pagedopt_adamw_4bit"].cls is pagedopt.AdamW4bit
    assert NAMES["pagedopt_paged_adamw_4bit"].cls is pagedopt.PagedAdamW4bit
    assert all(NAMES[n].bits == 4 for n in NAMES if n.endswith("_4bit"))


# ---------------------------------------------------------------- layout and bytes
@pytest.mark.parametrize("device", DEVICES)
def test_four_bit_state_layout(device):
    params, opt = _run("AdamW4bit", device, steps=1)
    big, odd, small = params[0], params[1], params[3]
    st = opt.state[big]
    n = big.numel()
    assert st["state1"].dtype == torch.uint8 and tuple(st["state1"].shape) == (96, 257)  # rows of 514 halved
    assert tuple(st["absmax1"].shape) == (math.ceil(n / 128),)
    assert torch.equal(st["qmap1"].cpu(), normal_codebook_4bit())
    assert torch.equal(st["qmap2"].cpu(), linear_codebook_4bit_no_zero())
    assert tuple(opt.state[odd]["state2"].shape) == (10001,)  # ceil(20001 / 2), flat
    assert tuple(opt.state[params[2]]["state1"].shape) == (300, 20)
    assert opt.state[small]["state1"].dtype == torch.float32  # under min_8bit_size
    # an odd size's last byte holds one code: its high nibble stays 0
    assert int(opt.state[odd]["state1"][-1]) >> 4 == 0


def test_ademamix_stacked_moments_in_four_bits():
    p = torch.nn.Parameter(torch.randn(3000))
    opt = pagedopt.AdEMAMix([p], optim_bits=4, min_8bit_size=1024)
    p.grad = torch.randn(3000)
    opt.step()
    assert tuple(opt.state[p]["state1"].shape) == (2, 1500)
    assert tuple(opt.state[p]["absmax1"].shape) == (2, math.ceil(3000 / 128))


def test_state_bytes_per_parameter_of_large_tensors():
    # Adam keeps two moments: 2 x (1/2 byte of code + 4 bytes of absmax per 128 elements)
    # = 1.0625 bytes a parameter; the bound is 1.07. Counted from the live tensors.
    p = torch.nn.Parameter(torch.randn(1 << 20))
    opt = pagedopt.AdamW4bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    moments = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k.startswith(("state", "absmax")))
    assert moments / p.numel() == pytest.approx(1.0625)
    assert pagedopt.optim.base.optimizer_state_bytes(opt) / p.numel() <= 1.07


def test_estimator_counts_the_live_bytes():
    from pagedopt.memory.estimator import state_bytes_of_tensor

    for numel in (4096, 5001, 1 << 20):
        p = torch.nn.Parameter(torch.randn(numel))
        opt = pagedopt.AdamW4bit([p])
        p.grad = torch.randn_like(p)
        opt.step()
        live = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "qmap1" and k != "qmap2")
        assert state_bytes_of_tensor(numel, "adamw_4bit", 4) == (live, True)


# ---------------------------------------------------------------- every path, bit for bit
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["AdamW4bit", "Lion4bit"])
def test_fast_and_ordinary_steps_agree(device, name):
    """The fast step (states held in C++) from the second step on against a step that rebuilds
    its plan each time (a state change forces the ordinary path)."""
    a_params, a_opt = _run(name, device)
    b_params = _params(device)
    b_opt = getattr(pagedopt, name)(b_params, lr=1e-2, min_8bit_size=1024)
    for s in range(4):
        for p, g in zip(b_params, _grads(b_params, s)):
            p.grad = g
        b_opt.step()
        b_opt.state.version += 1  # a changed table: the next step plans again
    _assert_same(a_params, a_opt, b_params, b_opt)


PAGERS = [dict(residency="host", device_buffer=1 << 20),        # streamed, the large state in pieces
          dict(residency="host", device_buffer=48 << 10),            # every large state in pieces
          dict(device_budget=40_000),                            # hybrid: part resident, part streamed
          dict(residency="auto")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pager", PAGERS, ids=["host", "host_pieces", "hybrid", "auto"])
def test_paged_residencies_step_as_resident(device, pager):
    if device == "cuda":
        from pagedopt import paging

        if paging.paging_unavailable_reason("cuda:0") is not None:
            pytest.skip("no paging on this device")
    a_params, a_opt = _run("AdamW4bit", device)
    b_params, b_opt = _run("PagedAdamW4bit", device, pager_args=pager)
    _assert_same(a_params, a_opt, b_params, b_opt)


def test_streamed_pieces_cut_the_packed_codes_at_whole_blocks():
    """With a buffer far smaller than the large state, its pieces are flat ranges of whole 128
    blocks: bytes [a/2, b/2) of the codes and absmax [a/128, b/128). A cut off by one byte or block
    would update the wrong codes and the results would differ from the resident step."""
    from pagedopt.optim.residency import pieces

    params, opt = _run("PagedAdamW4bit", "cpu", steps=1, pager_args=dict(residency="host", device_buffer=1 << 20))
    for big in params[:2]:  # an even and an odd number of elements
        state = opt.state[big]
        cut = pieces(0, big, state, ("state1", "state2", "absmax1", "absmax2"), 8 << 10, True)
        assert len(cut) > 2 and cut[-1].end == big.numel()
        for piece in cut:
            a, b = piece.start, piece.end
            assert a % 1024 == 0
            assert piece.by_key["state1"].numel() == math.ceil(b / 2) - a // 2
            assert piece.by_key["absmax1"].numel() == math.ceil(b / 128) - a // 128
            assert piece.by_key["state1"].data_ptr() == state["state1"].data_ptr() + a // 2
            assert piece.by_key["absmax2"].data_ptr() == state["absmax2"].data_ptr() + 4 * (a // 128)
    # a buffer of 48 KiB streams chunks of 16 KiB: both large parameters go in pieces
    a_params, a_opt = _run("AdamW4bit", "cpu")
    b_params, b_opt = _run("PagedAdamW4bit", "cpu", pager_args=dict(residency="host", device_buffer=48 << 10))
    _assert_same(a_params, a_opt, b_params, b_opt)


@pytest.mark.parametrize("device", DEVICES)
def test_updates_during_backward_as_after_it(device):
    def run(update_in_backward):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64)).to(device)
        opt = pagedopt.PagedAdamW4bit(model.parameters(), lr=1e-2, min_8bit_size=1024)
        opt.set_pager(residency="host", update_in_backward=update_in_backward)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(8, 64, generator=g).to(device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters()), opt

    if device == "cuda":
        from pagedopt import paging

        if paging.paging_unavailable_reason("cuda:0") is not None:
            pytest.skip("no paging on this device")
    _assert_same(*run(False), *run(True))


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FOUR_BIT)
def test_checkpoint_round_trip_and_exact_resume(device, name):
    params, opt = _run(name, device, steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True, map_location=device)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b_opt = getattr(pagedopt, name)(b_params, lr=1e-2, min_8bit_size=1024)
    b_opt.load_state_dict(saved)
    _assert_same(params, opt, b_params, b_opt)
    for s in (2, 3):
        for p, q, g in zip(params, b_params, _grads(params, s)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        b_opt.step()
    _assert_same(params, opt, b_params, b_opt)


def _corrupt(sd, key, value):
    sd = copy.deepcopy(sd)
    sd["state"][0][key] = value
    return sd


@pytest.mark.parametrize("what", ["codes_8bit_shape", "qmap_of_8_entries", "absmax_short", "qmap2_256"])
def test_refused_checkpoints_change_nothing(what):
    params, opt = _run("AdamW4bit", "cpu", steps=1)
    sd = opt.state_dict()
    st = sd["state"][0]
    bad = {"codes_8bit_shape": ("state1", torch.zeros(params[0].shape, dtype=torch.uint8)),
           "qmap_of_8_entries": ("qmap1", torch.linspace(-1, 1, 8)),
           "absmax_short": ("absmax2", st["absmax2"][:-1].clone()),
           "qmap2_256": ("qmap2", pagedopt.quant.dynamic_codebook(False))}[what]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"checkpoint refused.*param_groups\[0\]\['params'\]\[0\]"):
        opt.load_state_dict(_corrupt(sd, *bad))
    after = opt.state_dict()
    for k, v in before["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][0][k])), k


def test_torch_adamw_checkpoint_read_into_four_bit_states():
    """torch's exp_avg / exp_avg_sq quantized to 4-bit codes (the maps of AdamW4bit), each value
    within half a code gap of the map around it, times its block's absmax."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4096, generator=g))
    ref = torch.optim.AdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(4096, generator=g)
        ref.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = pagedopt.AdamW4bit([q])
    opt.load_state_dict(ref.state_dict())
    st = opt.state[q]
    assert tuple(st["state1"].shape) == (2048,) and st["qmap1"].numel() == 16
    from pagedopt.quant import dequantize_4bit_reference

    for i, torch_key in ((1, "exp_avg"), (2, "exp_avg_sq")):
        exact = ref.state[p][torch_key]
        code = st[f"qmap{i}"]
        back = dequantize_4bit_reference(st[f"state{i}"], st[f"absmax{i}"], code, 4096)
        absmax = st[f"absmax{i}"].repeat_interleave(128)[:4096]
        x = exact / absmax
        hi = torch.searchsorted(code, x.contiguous()).clamp(1, 15)
        outside = torch.maximum(code[0] - x, x - code[-1]).clamp_min(0)
        bound = torch.maximum((code[hi] - code[hi - 1]) / 2, outside) * absmax
        slack = 4 * torch.finfo(torch.float32).eps * absmax  # rounding of x / absmax, code * absmax, the difference
        assert bool(((back - exact).abs() <= bound + slack).all())


def test_to_torch_state_dict_of_four_bit_states():
    params, opt = _run("AdamW4bit", "cpu", steps=2)
    exported = pagedopt.convert.to_torch_state_dict(opt)
    for i, p in enumerate(params):
        assert exported["state"][i]["exp_avg"].shape == p.shape
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params])
    ref.load_state_dict(exported)


# ---------------------------------------------------------------- what it is for
def test_four_bit_adamw_trains_like_fp32_adamw():
    """A small regression trained 300 steps: the 4-bit states' final loss within 10% of fp32
    AdamW's (their per-element rounding is up to half a 4-bit code gap, about 6% of absmax for v;
    a wrong map or nibble order makes the loss stall or diverge far beyond that)."""
    def train(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
        opt = make(model.parameters())
        g = torch.Generator().manual_seed(5)
        w = torch.randn(32, 1, generator=g)
        for _ in range(300):
            x = torch.randn(64, 32, generator=g)
            loss = (model(x) - torch.sin(x @ w)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            return float((model(x) - torch.sin(x @ w)).square().mean())

    fp32 = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    four = train(lambda ps: pagedopt.AdamW4bit(ps, lr=3e-3, min_8bit_size=0))
    assert four < fp32 * 1.10, (four, fp32)


@pytest.mark.parametrize("peer, ours", [("AdamW4bit", "AdamW4bit"), ("AdamW8bit", "AdamW8bit")])
def test_torchao_low_bit_checkpoint_read(peer, ours):
    """torchao's AdamW4bit / AdamW8bit state dicts (saved with torch.save, read back with
    weights_only=True) load into pagedopt's class of the same width: each moment dequantized by
    torchao, then quantized to pagedopt's codes. Each value is within half a code gap of
    pagedopt's map (times its block's absmax) of torchao's value, and the resumed run trains."""
    torchao_optim = pytest.importorskip("torchao.optim")
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=g))
    ref = getattr(torchao_optim, peer)([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn(64, 64, generator=g)
        ref.step()
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(p.detach().clone())
    opt = getattr(pagedopt, ours)([q], lr=1e-3)
    opt.load_state_dict(saved)
    back = pagedopt.convert.to_torch_state_dict(opt)["state"][0]
    fmt = CODES4 if "4bit" in ours else pagedopt.optim.state_format.CODES8
    st = opt.state[q]
    for i, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
        exact = saved["state"][0][key].dequantize().reshape(-1)
        code = st[f"qmap{i}"]
        absmax = st[f"absmax{i}"].repeat_interleave(fmt.block)[:exact.numel()]
        x = exact / absmax
        hi = torch.searchsorted(code, x.contiguous()).clamp(1, code.numel() - 1)
        outside = torch.maximum(code[0] - x, x - code[-1]).clamp_min(0)
        bound = torch.maximum((code[hi] - code[hi - 1]) / 2, outside) * absmax
        # + 4 ulps of absmax: the rounding of x / absmax, of code * absmax and of the difference
        slack = 4 * torch.finfo(torch.float32).eps * absmax
        assert bool(((back[key].reshape(-1) - exact).abs() <= bound + slack).all()), key
    before = q.detach().clone()
    q.grad = torch.randn(64, 64, generator=g)
    opt.step()
    assert not torch.equal(before, q) and bool(torch.isfinite(q).all())
