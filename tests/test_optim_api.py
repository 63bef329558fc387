"""The optimizer classes behave like torch.optim optimizers and bitsandbytes' classes."""
import inspect
import io

import pytest
import torch

import pagedopt

ALL_CLASSES = [pagedopt.Adam, pagedopt.AdamW, pagedopt.Adam8bit, pagedopt.AdamW8bit, pagedopt.Adam32bit,
               pagedopt.AdamW32bit, pagedopt.PagedAdam, pagedopt.PagedAdamW, pagedopt.PagedAdam8bit,
               pagedopt.PagedAdamW8bit, pagedopt.PagedAdam32bit, pagedopt.PagedAdamW32bit]
EIGHT_BIT = [pagedopt.Adam8bit, pagedopt.AdamW8bit, pagedopt.PagedAdam8bit, pagedopt.PagedAdamW8bit]
BNB_ARGS = ["params", "lr", "betas", "eps", "weight_decay", "amsgrad", "optim_bits", "args", "min_8bit_size",
            "percentile_clipping", "block_wise"]


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 80, generator=g).to(dtype).requires_grad_(True),
            torch.randn(5000, generator=g).to(dtype).requires_grad_(True),
            torch.randn(10, generator=g).to(dtype).requires_grad_(True)]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_signature_matches_bitsandbytes(cls):
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    expected = BNB_ARGS + ([] if cls.__name__.startswith("Paged") else ["is_paged"]) + ["capturable",
                                                                                        "bf16_stochastic_round"]  # pagedopt's
    assert names == expected
    wd = inspect.signature(cls.__init__).parameters["weight_decay"].default
    assert wd == (1e-2 if "AdamW" in cls.__name__ else 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(amsgrad=True), "amsgrad"), (dict(args=object()), "args"), (dict(percentile_clipping=5), "percentile"),
    (dict(block_wise=False), "block_wise"), (dict(optim_bits=16), "optim_bits"), (dict(lr=-1.0), "lr"),
    (dict(betas=(1.0, 0.9)), r"betas\[0\]"), (dict(betas=(0.9, -0.1)), r"betas\[1\]"), (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(min_8bit_size=-5), "min_8bit_size"),
    (dict(lr=float("nan")), "lr")])
def test_unsupported_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pagedopt.AdamW(make_params(), **kwargs)


def test_bad_param_group_is_named():
    params = make_params()
    opt = pagedopt.AdamW8bit(params[:2])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\]"):
        opt.add_param_group({"params": params[2:], "lr": -1})


@pytest.mark.parametrize("bad", ["sparse", "dtype", "shape", "complex", "float64", "device"])
def test_bad_gradient_raises_before_any_state_change(bad):
    params = make_params()
    opt = pagedopt.AdamW8bit(params, min_8bit_size=100)
    set_grads(params, 1)
    opt.step()
    snapshot = [p.detach().clone() for p in params]
    state_snapshot = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    set_grads(params, 2)
    culprit = 2
    p_bad = params[culprit]
    if bad == "sparse":
        p_bad.grad = p_bad.grad.to_sparse()
    elif bad == "dtype":
        if hasattr(p_bad, "grad_dtype"):
            p_bad.grad_dtype = None  # newer torch refuses a mismatched grad unless told
        p_bad.grad = p_bad.grad.half()
    elif bad == "shape":
        p_bad.grad.data = p_bad.grad[:-1].clone()  # autograd would refuse; a hook or bug can do it
    elif bad == "complex":
        z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        opt.add_param_group({"params": [z]})
        z.grad = torch.randn_like(z)
    elif bad == "float64":
        d = torch.randn(3, dtype=torch.float64, requires_grad=True)
        opt.add_param_group({"params": [d]})
        d.grad = torch.randn_like(d)
    elif bad == "device":
        try:
            p_bad.grad.data = torch.empty(p_bad.shape, device="meta")
        except RuntimeError:
            pytest.skip("this torch refuses a gradient on another device outright")
    where = r"param_groups\[1\]\['params'\]\[0\]" if bad in ("complex", "float64") else \
        r"param_groups\[0\]\['params'\]\[2\]"
    with pytest.raises(ValueError, match=where):
        opt.step()
    for p, s in zip(params, snapshot):
        assert torch.equal(p.detach(), s)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_snapshot[id(p)][k]), k


@pytest.mark.parametrize("cls", EIGHT_BIT)
def test_state_layout_and_size(cls):
    params = make_params()
    opt = cls(params)
    set_grads(params, 0)
    opt.step()
    big, small = opt.state[params[1]], opt.state[params[0]]  # 5000 >= 4096 > 64*80? no: 5120
    for p in params:
        s = opt.state[p]
        if p.numel() >= 4096:
            assert set(s) == {"step", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}
            assert s["state1"].dtype == torch.uint8 and s["state1"].shape == p.shape
            assert s["absmax1"].shape == ((p.numel() + 255) // 256,)
        else:
            assert set(s) == {"step", "state1", "state2"}
            assert s["state1"].dtype == torch.float32
    assert big["state1"].dtype == torch.uint8 and small["state1"].dtype == torch.uint8
    assert opt.state[params[2]]["state1"].dtype == torch.float32


@pytest.mark.parametrize("via", ["default", "argument", "param_group"])
def test_min_8bit_size_boundary_is_inclusive(via):
    """A parameter of exactly min_8bit_size elements gets 8-bit states, one element fewer 32-bit,
    whether min_8bit_size is the default (4096), the constructor's, or a param group's."""
    size = {"default": 4096, "argument": 300, "param_group": 500}[via]
    at = torch.randn(size, requires_grad=True)
    below = torch.randn(size - 1, requires_grad=True)
    square = torch.randn(64, 64, requires_grad=True) if via == "default" else None  # 4096 as a matrix
    if via == "default":
        opt = pagedopt.AdamW8bit([at, below, square])
    elif via == "argument":
        opt = pagedopt.AdamW8bit([at, below], min_8bit_size=size)
    else:  # the group's setting wins over the constructor's in both directions
        other_at = torch.randn(size, requires_grad=True)
        opt = pagedopt.AdamW8bit([{"params": [at, below], "min_8bit_size": size},
                                  {"params": [other_at], "min_8bit_size": size + 1}], min_8bit_size=10**6)
    params = [p for group in opt.param_groups for p in group["params"]]
    set_grads(params, 0)
    opt.step()
    assert opt.state[at]["state1"].dtype == torch.uint8 and opt.state[at]["absmax1"].numel() == (size + 255) // 256
    assert opt.state[below]["state1"].dtype == torch.float32 and "absmax1" not in opt.state[below]
    if via == "default":
        assert opt.state[square]["state1"].dtype == torch.uint8
    if via == "param_group":
        assert opt.state[other_at]["state1"].dtype == torch.float32


def test_eight_bit_state_is_about_2_03_bytes_per_param():
    p = torch.randn(1 << 20, requires_grad=True)
    opt = pagedopt.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    per_param = (opt.state_bytes() - 4) / p.numel()  # minus the step counter
    assert per_param == pytest.approx(2 + 8 / 256)


def test_none_grads_are_skipped_and_groups_have_own_lr():
    params = make_params()
    opt = pagedopt.AdamW8bit([{"params": params[:1], "lr": 0.0}, {"params": params[1:], "lr": 1e-2}],
                             min_8bit_size=0)
    before = [p.detach().clone() for p in params]
    set_grads(params, 0)
    params[2].grad = None
    opt.step()
    assert torch.equal(params[0].detach(), before[0] * (1 - 0.0))  # lr=0: no change at all
    assert not torch.equal(params[1].detach(), before[1])
    assert torch.equal(params[2].detach(), before[2]) and len(opt.state[params[2]]) == 0


def test_lr_scheduler_zero_grad_hooks_and_closure():
    params = make_params()
    opt = pagedopt.AdamW8bit(params, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    set_grads(params, 0)
    loss = opt.step(closure=lambda: torch.tensor(3.0))
    assert loss.item() == 3.0 and calls == ["pre", "post"]
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("cls", [pagedopt.AdamW8bit, pagedopt.AdamW, pagedopt.PagedAdamW8bit])
def test_state_dict_round_trip_continues_bit_identically(cls):
    params_a = make_params(0, torch.bfloat16)
    params_b = [p.detach().clone().requires_grad_(True) for p in params_a]
    opt_a = cls(params_a, min_8bit_size=100)
    for s in range(3):
        set_grads(params_a, s)
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    for p, q in zip(params_a, params_b):
        q.data.copy_(p.data)
    opt_b = cls(params_b, min_8bit_size=100)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf))
    for k in opt_a.state[params_a[1]]:
        a, b = opt_a.state[params_a[1]][k], opt_b.state[params_b[1]][k]
        assert a.dtype == b.dtype and torch.equal(a, b), k
    for s in range(3, 6):
        set_grads(params_a, s)
        set_grads(params_b, s)
        opt_a.step()
        opt_b.step()
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)


def test_loads_a_bitsandbytes_style_checkpoint_with_int_step():
    params = make_params()
    opt = pagedopt.AdamW8bit(params, min_8bit_size=100)
    set_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    for s in sd["state"].values():
        s["step"] = 1  # bitsandbytes stores an int
    opt2 = pagedopt.AdamW8bit(params, min_8bit_size=100)
    opt2.load_state_dict(sd)
    assert all(opt2.state[p]["step"].item() == 1.0 for p in params)
    set_grads(params, 1)
    opt2.step()
    assert all(opt2.state[p]["step"].item() == 2.0 for p in params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_params_follow_fp32_params(dtype):
    """bf16/fp16 parameters against fp32 ones given the same (dtype-rounded) gradients. AdamW's states
    do not depend on the parameters, so they are bit for bit the same in both runs (8-bit states for
    the two large parameters, 32-bit for the 10-element one), and so is each step's update; the
    parameters differ only by rounding. Per element, with a = half, b = fp32 parameter:

      |a_t - b_t| <= (1 - lr wd) |a_{t-1} - b_{t-1}| + 2u (|a_{t-1}| + |b_{t-1}| + |a'_t| + |b_t|) + half_ulp_dtype(a_t)

    (fp32 roundings of the decay and the sum, u = 2^-24; then one rounding to the half dtype). Elements
    with |p| small enough that their dtype resolves an update must therefore move: a half parameter
    that is never written back fails."""
    from reference import half_ulp

    p32 = make_params(0)
    ph = [p.detach().to(dtype).requires_grad_(True) for p in p32]
    start32 = [p.detach().double().clone() for p in p32]
    lr, wd = 1e-3, 1e-2
    o32 = pagedopt.AdamW8bit(p32, lr=lr, weight_decay=wd, min_8bit_size=100)
    oh = pagedopt.AdamW8bit(ph, lr=lr, weight_decay=wd, min_8bit_size=100)
    bound = [(a.detach().double() - b.detach().double()).abs() for a, b in zip(ph, p32)]  # rounding at the start
    u = 2.0**-24
    for s in range(5):
        set_grads(p32, s)
        for a, b in zip(ph, p32):
            a.grad = b.grad.to(dtype)
            b.grad = a.grad.float()  # the same gradients
        prev = [(a.detach().double().abs(), b.detach().double().abs()) for a, b in zip(ph, p32)]
        o32.step()
        oh.step()
        for i, (a, b) in enumerate(zip(ph, p32)):
            ad, bd = a.detach().double(), b.detach().double()
            fp32 = 2 * u * (prev[i][0] + prev[i][1] + 2 * ad.abs() + bd.abs())
            bound[i] = (1 - lr * wd) * bound[i] + fp32 + half_ulp(ad.abs() + fp32, dtype)
            for k, x in o32.state[b].items():
                assert torch.equal(x, oh.state[a][k]), k
    for a, b, e, b0 in zip(ph, p32, bound, start32):
        assert a.dtype == dtype
        # bounded by the half dtype's rounding of each element over 5 steps, derived above
        # (the old, looser check kept as well: atol 0.03 / 5e-3)
        err = (a.detach().double() - b.detach().double()).abs()
        assert (err <= e).all(), (err - e).max()
        torch.testing.assert_close(a.float(), b, atol=0.03 if dtype == torch.bfloat16 else 5e-3, rtol=0)
        # informative: for many elements the bound is below how far the fp32 parameter moved, so a
        # half parameter left unchanged fails (about 11% of the large ones in bf16, 66% in fp16; the
        # 10-element one may have none in bf16: test_32bit_path_matches_float64_adam covers it)
        moved = (b.detach().double() - b0).abs()
        if a.numel() >= 1000:
            assert (e < moved).double().mean() > 0.05, (e < moved).double().mean()


def test_non_contiguous_param_matches_contiguous():
    base = torch.randn(80, 64)
    p_nc = base.clone().t().requires_grad_(True)  # non-contiguous leaf? make it a leaf view via detach
    p_c = base.clone().t().contiguous().requires_grad_(True)
    assert not p_nc.is_contiguous()
    o1 = pagedopt.AdamW8bit([p_nc], min_8bit_size=0)
    o2 = pagedopt.AdamW8bit([p_c], min_8bit_size=0)
    for s in range(3):
        g = torch.randn(64, 80)
        p_nc.grad, p_c.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.equal(p_nc.detach(), p_c.detach())


def test_grad_scaler_skips_steps_with_inf():
    params = make_params()
    opt = pagedopt.AdamW8bit(params, min_8bit_size=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = sum((p.float() ** 2).sum() for p in params)
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"].item() == 1 for p in params)
    # an inf gradient: the step changes neither params nor states, and the step count stays
    before = [p.detach().clone() for p in params]
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    opt.zero_grad()
    loss = sum((p.float() ** 2).sum() for p in params)
    scaler.scale(loss).backward()
    params[1].grad[3] = float("inf")
    scaler.step(opt)
    scaler.update()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, states[id(p)][k]), k


def test_grad_scaler_result_equals_unscaled_step():
    pa, pb = make_params(1), make_params(1)
    oa = pagedopt.AdamW8bit(pa, min_8bit_size=100)
    ob = pagedopt.AdamW8bit(pb, min_8bit_size=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for p in pa:
        p.grad = None
    loss_a = sum((p ** 3).sum() for p in pa)
    scaler.scale(loss_a).backward()
    scaler.step(oa)
    loss_b = sum((p ** 3).sum() for p in pb)
    loss_b.backward()
    ob.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_paged_classes_work_unpaged_on_cpu_and_match():
    pa, pb = make_params(2), make_params(2)
    with pytest.warns(UserWarning, match="not paged"):
        oa = pagedopt.PagedAdamW8bit(pa, min_8bit_size=100)
        set_grads(pa, 0)
        oa.step()
    ob = pagedopt.AdamW8bit(pb, min_8bit_size=100)
    set_grads(pb, 0)
    ob.step()
    for s in range(1, 3):
        set_grads(pa, s)
        set_grads(pb, s)
        oa.step()
        ob.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    oa.page_out()  # a no-op on CPU, but callable
    stats = oa.paging_stats()
    # on the CPU nothing is paged: every state tensor the pager made is ordinary memory
    made = [v for st in oa.state.values() for k, v in st.items() if k in ("state1", "state2", "absmax1", "absmax2")]
    assert stats.paged_tensors == 0 and stats.resident_bytes == 0 and stats.host_bytes == 0, stats
    assert stats.bytes_moved_last_step == 0, stats
    assert stats.unpaged_tensors == len(made) and stats.unpaged_bytes == sum(v.nbytes for v in made), stats


def test_a_checkpoint_codebook_is_used_for_its_parameter_only():
    from pagedopt.quant import dynamic_codebook, quantize_blockwise_reference

    params = [torch.randn(1000, requires_grad=True), torch.randn(1000, requires_grad=True)]
    opt = pagedopt.AdamW8bit(params, min_8bit_size=0)
    set_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    for s in sd["state"].values():  # a fresh state, as at step 0
        for k in ("state1", "state2", "absmax1", "absmax2"):
            s[k] = torch.zeros_like(s[k])
        s["step"] = 0
    linear = torch.linspace(-1, 1, 256)
    sd["state"][0]["qmap1"] = linear
    fresh = [p.detach().clone().requires_grad_(True) for p in params]
    opt2 = pagedopt.AdamW8bit(fresh, min_8bit_size=0)
    opt2.load_state_dict(sd)
    set_grads(fresh, 1)
    opt2.step()
    for p, code in zip(fresh, (linear, dynamic_codebook(True))):
        m = (1 - 0.9) * p.grad  # the first moment after one step from zero
        expected, _ = quantize_blockwise_reference(m, code)
        assert torch.equal(opt2.state[p]["state1"], expected)
    assert torch.equal(opt2.state[fresh[0]]["qmap1"], linear)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_weight_decay_kind_follows_the_class_name(cls):
    """AdamW* decay decoupled (AdamW), Adam* add weight decay to the gradient (L2), as in torch."""
    assert cls.decoupled == cls.__name__.replace("Paged", "").startswith("AdamW")
