"""The generic quantized-state engine (quantized_step_, csrc/include/pagedopt/algorithms.h) as the
optimizers call it: argument checks that name the argument and change nothing, GradScaler's
found_inf and grad_scale, and checkpoints of the Lion / AdEMAMix state layouts refused when a key
or shape is foreign to the algorithm."""
import copy
import inspect

import pytest
import torch

import pagedopt
from pagedopt import _ops
from pagedopt.quant import dynamic_codebook



def lion_state(n, gen, eight_bit=True):
    blocks = (n + 255) // 256
    if eight_bit:
        return dict(p=torch.randn(n, generator=gen), g=torch.randn(n, generator=gen),
                    s=torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                    a=torch.rand(blocks, generator=gen) + 0.1, step=torch.tensor(3.0))
    return dict(p=torch.randn(n, generator=gen), g=torch.randn(n, generator=gen), s=torch.randn(n, generator=gen),
                step=torch.tensor(3.0))


def run_lion(ts, hyper=(1e-3, 0.9, 0.99, 0.1), eight_bit=True, **kw):
    qmaps = [dynamic_codebook(True)] if eight_bit else []
    _ops.quantized_step_("lion", [t["p"] for t in ts], [t["g"] for t in ts], [[t["s"] for t in ts]],
                         [[t["a"] for t in ts]] if eight_bit else [], [t["step"] for t in ts], qmaps, list(hyper), **kw)


def snapshot(ts):
    return [{k: v.clone() for k, v in t.items()} for t in ts]


def assert_unchanged(ts, before):
    for t, b in zip(ts, before):
        for k in t:
            assert torch.equal(t[k], b[k]), k


@pytest.mark.parametrize("bad, message", [
    ("algorithm", "unknown algorithm 'adamax'"),
    ("hyper", "hyper must hold 4 values"),
    ("state_len", "state1[1] has 299 elements, expected 1 x 300"),
    ("state_too_big", "state1[1] has 600 elements, expected 1 x 300"),
    ("absmax_len", "absmax1[0] must have 4 elements"),
    ("mixed_width", "state1[1] must be"),
    ("grad_shape", "grads[1] has shape"),
    ("qmap", "qmap1 must have 256 entries"),
    ("grad_strided", "grads[1] must be contiguous and on cpu"),
    ("param_strided", "params[1] must be contiguous"),
    ("state_strided", "state1[1] must be contiguous and on cpu"),
])
def test_bad_arguments_name_the_argument_and_change_nothing(bad, message):
    gen = torch.Generator().manual_seed(1)
    ts = [lion_state(n, gen) for n in (1000, 300)]
    algorithm, hyper, qmaps = "lion", [1e-3, 0.9, 0.99, 0.1], [dynamic_codebook(True)]
    if bad == "algorithm":
        algorithm = "adamax"
    elif bad == "hyper":
        hyper = hyper[:3]
    elif bad == "state_len":
        ts[1]["s"] = ts[1]["s"][:299].clone()
    elif bad == "state_too_big":
        ts[1]["s"] = torch.randint(0, 256, (600,), generator=gen, dtype=torch.uint8)
    elif bad == "absmax_len":
        ts[0]["a"] = ts[0]["a"][:3].clone()
    elif bad == "mixed_width":
        ts[1]["s"] = torch.randn(300, generator=gen)
    elif bad == "grad_shape":
        ts[1]["g"] = ts[1]["g"].reshape(3, 100)
    elif bad == "qmap":
        qmaps = [dynamic_codebook(True)[:255].clone()]
    elif bad in ("grad_strided", "param_strided", "state_strided"):
        # every other element of a tensor twice as long: the same shape, values and dtype, a stride
        # of 2 (the op called directly, not through an optimizer, which makes contiguous copies)
        key = {"grad_strided": "g", "param_strided": "p", "state_strided": "s"}[bad]
        wide = torch.empty(600, dtype=ts[1][key].dtype)
        wide[::2] = ts[1][key]
        ts[1][key] = wide[::2]
    before = snapshot(ts)
    with pytest.raises((RuntimeError, ValueError), match=message.replace("[", r"\[").replace("]", r"\]")):
        _ops.quantized_step_(algorithm, [t["p"] for t in ts], [t["g"] for t in ts], [[t["s"] for t in ts]],
                             [[t["a"] for t in ts]], [t["step"] for t in ts], qmaps, hyper)
    assert_unchanged(ts, before)


@pytest.mark.parametrize("eight_bit", [True, False])
def test_found_inf_changes_nothing_and_grad_scale_divides(eight_bit):
    gen = torch.Generator().manual_seed(2)
    ts = [lion_state(n, gen, eight_bit) for n in (1000, 300)]
    before = snapshot(ts)
    run_lion(ts, eight_bit=eight_bit, found_inf=torch.tensor(1.0))
    assert_unchanged(ts, before)
    # gradients times 2^10 with grad_scale 2^10 step exactly as the unscaled ones (g * (1 / 2^10) is exact)
    scaled = snapshot(ts)
    for t in scaled:
        t["g"] *= 1024.0
    run_lion(ts, eight_bit=eight_bit)
    run_lion(scaled, eight_bit=eight_bit, grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    for t, u in zip(ts, scaled):
        for k in ("p", "s") + (("a",) if eight_bit else ()):
            assert torch.equal(t[k], u[k]), k
    assert not torch.equal(ts[0]["p"], before[0]["p"])  # the step moved the parameters


def trained(cls, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(40, 30))]
    opt = cls(params, min_8bit_size=100, **kw)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


@pytest.mark.parametrize("cls, corrupt, message", [
    (pagedopt.Lion8bit, lambda s: s.update(state2=s["state1"].clone()), "'state2' is not a state of lion"),
    (pagedopt.Lion8bit, lambda s: s.update(absmax2=s["absmax1"].clone()), "'absmax2' is not a state of lion"),
    (pagedopt.AdEMAMix8bit, lambda s: s.update(absmax1=s["absmax1"][0].clone()), "'absmax1' has shape"),
    (pagedopt.AdEMAMix8bit, lambda s: s.update(state1=s["state1"][0].clone()), "'state1' has shape"),
    (pagedopt.AdEMAMix32bit, lambda s: s.update(state1=s["state1"].reshape(-1).clone()), "'state1' has shape"),
    (pagedopt.AdEMAMix8bit, lambda s: s.pop("state2"), "has no 'state2'"),
])
def test_checkpoint_foreign_to_the_algorithm_is_refused(cls, corrupt, message):
    params, opt = trained(cls)
    sd = copy.deepcopy(opt.state_dict())
    corrupt(sd["state"][0])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for key, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][key][k]) if isinstance(v, torch.Tensor) else v == after["state"][key][k]


@pytest.mark.parametrize("kwargs, message", [
    (dict(betas=(0.9, 0.999)), r"betas.*three floats"),
    (dict(t_alpha=-5), "t_alpha"),
    (dict(t_beta3=0), "t_beta3"),
    (dict(alpha=float("nan")), "alpha"),
])
def test_ademamix_refuses_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pagedopt.AdEMAMix8bit([torch.nn.Parameter(torch.randn(10))], **kwargs)


def test_lion_group_hyperparameters_are_checked_on_add():
    opt = pagedopt.Lion8bit([torch.nn.Parameter(torch.randn(10))])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(10))], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 1


def test_an_element_whose_second_moment_overflows_counts_for_no_absmax():
    """One gradient of 1e30 in a block: its nu overflows to inf while its m1 (1e29) and m2 stay
    finite. It must count for none of the block's absmaxes, so the other 255 elements keep their
    resolution (absmax1 is their own largest |m1|) and absmax2 stays finite."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(512))
    opt = pagedopt.AdEMAMix8bit([p], min_8bit_size=1)
    g = torch.randn(512)
    g[7] = 1e30
    p.grad = g.clone()
    opt.step()
    st = opt.state[p]
    others = torch.ones(512, dtype=torch.bool)
    others[7] = False
    m1 = (1 - 0.9) * g  # the first step's m1 from zero moments (float32 rounding: within 2^-23 relative)
    expected = m1[:256][others[:256]].abs().max()
    assert torch.isfinite(st["absmax2"]).all() and torch.isfinite(st["absmax1"]).all()
    assert torch.allclose(st["absmax1"][0, 0], expected, rtol=2.0**-22), (st["absmax1"][0, 0], expected)
    zero = int((st["qmap1"] == 0).nonzero()[0])
    assert (st["state1"][0, :256][others[:256]] != zero).float().mean() > 0.9  # not flattened to the code of 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_sgd_follows_grad_scaler_and_torch(dtype):
    """Plain SGD (momentum 0, no state): a step GradScaler skips (found_inf = 1) leaves the
    parameters and the step count as they were; a step with grad_scale = 2^10 over gradients
    scaled by 2^10 equals torch.optim.SGD on the unscaled gradients, bit for bit in fp32 (the same
    two fp32 operations; x * 2^-10 is exact), and, for bf16, torch's step done in fp32 and rounded."""
    torch.manual_seed(4)
    p0 = torch.randn(300).to(dtype)
    p = torch.nn.Parameter(p0.clone())
    opt = pagedopt.SGD8bit([p], lr=0.1, weight_decay=0.01)
    g = torch.randn(300).to(dtype)
    p.grad = g * 1024
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    opt.step()
    assert torch.equal(p.detach(), p0) and opt.state[p]["step"].item() == 0
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    ref = torch.nn.Parameter(p0.float().clone())
    ref.grad = g.float()
    torch.optim.SGD([ref], lr=0.1, weight_decay=0.01).step()
    assert torch.equal(p.detach(), ref.detach().to(dtype))
    assert set(opt.state[p]) == {"step"} and opt.state[p]["step"].item() == 1


def _ademamix_case(device, sizes=(520, 33, 4100)):
    g = torch.Generator().manual_seed(6)
    lists = {k: [] for k in ("p", "g", "s1", "s2", "a1", "a2", "steps")}
    for n in sizes:
        blocks = (n + 255) // 256
        lists["p"].append(torch.randn(n, generator=g).to(device))
        lists["g"].append(torch.randn(n, generator=g).to(device))
        lists["s1"].append(torch.randint(0, 256, (2, n), generator=g, dtype=torch.uint8).to(device))
        lists["s2"].append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device))
        lists["a1"].append((torch.rand(2, blocks, generator=g) * 0.1).to(device))
        lists["a2"].append((torch.rand(blocks, generator=g) * 0.01).to(device))
        lists["steps"].append(torch.tensor(3.0, device=device))
    qmaps = [dynamic_codebook(True, device), dynamic_codebook(False, device)]
    hyper = [1e-3, 0.9, 0.999, 0.9999, 5.0, 1e-8, 0.01, 0.0, 0.0]
    return lists, qmaps, hyper


def test_quantized_step_ops_have_fakes_and_pass_opcheck():
    """quantized_step_ passes opcheck (schema, fake, autograd registration, AOT dispatch);
    quantized_step_list_ the tests its custom-class argument allows (see test_compile.py's
    _opcheck_state_list), with its effects checked by hand: params change, grads and steps do not,
    the held states do."""
    lists, qmaps, hyper = _ademamix_case("cpu")
    args = ("ademamix", lists["p"], lists["g"], lists["s1"] + lists["s2"], lists["a1"] + lists["a2"], lists["steps"],
            qmaps, hyper, None, None)
    torch.library.opcheck(torch.ops.pagedopt.quantized_step_, args)
    assert torch._library.fake_class_registry.has_fake_class("__torch__.torch.classes.pagedopt.QuantizedStateList")
    held = torch.classes.pagedopt.QuantizedStateList("ademamix", lists["s1"] + lists["s2"], lists["a1"] + lists["a2"],
                                                     lists["steps"], qmaps)
    assert held.size() == 3
    largs = (held, lists["p"], lists["g"], hyper, None, None)
    torch.library.opcheck(torch.ops.pagedopt.quantized_step_list_, largs,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    # effects, on a fresh case (opcheck ran the op on the held states above)
    lists, qmaps, hyper = _ademamix_case("cpu")
    held = torch.classes.pagedopt.QuantizedStateList("ademamix", lists["s1"] + lists["s2"], lists["a1"] + lists["a2"],
                                                     lists["steps"], qmaps)
    before = {k: [t.clone() for t in v] for k, v in lists.items()}
    torch.ops.pagedopt.quantized_step_list_(held, lists["p"], lists["g"], hyper, None, None)
    assert all(not torch.equal(a, b) for a, b in zip(before["p"], lists["p"]))
    assert all(torch.equal(a, b) for a, b in zip(before["g"], lists["g"]))
    assert all(torch.equal(a, b) for a, b in zip(before["steps"], lists["steps"]))
    for k in ("s1", "s2", "a1", "a2"):
        assert any(not torch.equal(a, b) for a, b in zip(before[k], lists[k])), k
    # the list op is the plain op, bit for bit
    again, _, _ = _ademamix_case("cpu")
    torch.ops.pagedopt.quantized_step_("ademamix", again["p"], again["g"], again["s1"] + again["s2"],
                                       again["a1"] + again["a2"], again["steps"], qmaps, hyper, None, None)
    for k in ("p", "s1", "s2", "a1", "a2"):
        assert all(torch.equal(a, b) for a, b in zip(again[k], lists[k])), k


@pytest.mark.parametrize("t_alpha, t_beta3", [(3, 20), (20, 3)])
def test_ademamix_warmups_of_different_lengths(t_alpha, t_beta3):
    """t_alpha and t_beta3 of different lengths (equal ones would hide a mix-up): each of six
    steps of AdEMAMix32bit against the float64 oracle started from the optimizer's own previous
    states. fp32 rounding: the moments within 4 U of their terms' size, the parameter within
    8 U of |p| plus 8 U of lr * the update's terms (a few roundings each, U = 2^-24); the
    schedules' effect per step is orders of magnitude above that."""
    from reference_family import ademamix_schedule, ademamix_step_reference, ademamix_update

    U = 2.0**-24
    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.randn(700))
    hp = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.1)
    opt = pagedopt.AdEMAMix32bit([p], t_alpha=t_alpha, t_beta3=t_beta3, **hp)
    m1, m2, nu = torch.zeros(700), torch.zeros(700), torch.zeros(700)
    for step in range(1, 7):
        g = torch.randn(700)
        p_old = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        ref_p, ref_m1, ref_m2, ref_nu = ademamix_step_reference(
            p_old, g, m1, m2, nu, step, hp["lr"], *hp["betas"], hp["alpha"], hp["eps"], hp["weight_decay"],
            t_alpha, t_beta3)
        st = opt.state[p]
        m1, m2, nu = st["state1"][0].clone(), st["state1"][1].clone(), st["state2"].clone()
        _, beta3_t = ademamix_schedule(step, hp["alpha"], 0.9, 0.9999, t_alpha, t_beta3)
        terms1 = 0.9 * ref_m1.abs() + g.double().abs()
        terms2 = beta3_t * ref_m2.abs() + g.double().abs()
        assert ((m1.double() - ref_m1).abs() <= 4 * U * terms1).all()
        assert ((m2.double() - ref_m2).abs() <= 4 * U * terms2).all()
        assert ((nu.double() - ref_nu).abs() <= 4 * U * (ref_nu + g.double() ** 2)).all()
        alpha_t, _ = ademamix_schedule(step, hp["alpha"], 0.9, 0.9999, t_alpha, t_beta3)
        _, size = ademamix_update(ref_m1, ref_m2, ref_nu, step, 0.9, 0.999, alpha_t, hp["eps"])
        bound = 8 * U * (p_old.double().abs() + hp["lr"] * size)
        assert ((p.detach().double() - ref_p).abs() <= bound).all(), ((p.detach().double() - ref_p).abs() - bound).max()


ENGINE_CLASSES = ["Lion", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit", "AdEMAMix",
                  "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit", "SGD",
                  "SGD8bit", "SGD32bit", "RMSprop", "RMSprop8bit", "RMSprop32bit", "Adagrad", "Adagrad8bit",
                  "Adagrad32bit"]


def _engine_optimizer(name, params):
    import warnings

    kw = dict(lr=1e-2, min_8bit_size=256)
    if name.startswith("SGD"):
        kw["momentum"] = 0.9
    if name in ("Lion", "PagedLion", "AdEMAMix", "PagedAdEMAMix", "SGD", "RMSprop", "Adagrad"):
        kw["optim_bits"] = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Paged* on the CPU: unpaged, with a warning
        return getattr(pagedopt, name)(params, **kw)


@pytest.mark.parametrize("name", ENGINE_CLASSES)
def test_copies_and_pickles_step_like_the_original(name):
    """deepcopy and a pickle round trip after two steps: the copies own their states (a step of
    one changes nothing in the other) and step exactly like the original."""
    import io
    import pickle
    import warnings

    torch.manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(30, 20))]
    opt = _engine_optimizer(name, params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    eight_bit = not name.endswith("32bit")
    assert (opt.state[params[0]]["state1"].dtype == torch.uint8) == eight_bit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = copy.deepcopy({"p": params, "o": opt})
        buf = io.BytesIO()
        pickle.dump({"p": params, "o": opt}, buf)
        buf.seek(0)
        pickled = pickle.load(buf)
    grads = [torch.randn_like(p) for p in params]
    for ps, o in ((params, opt), (twin["p"], twin["o"]), (pickled["p"], pickled["o"])):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        o.step()
    for ps, o in ((twin["p"], twin["o"]), (pickled["p"], pickled["o"])):
        for a, b in zip(params, ps):
            assert torch.equal(a, b)
            for k, v in opt.state[a].items():
                assert torch.equal(v, o.state[b][k]), k
                assert v.data_ptr() != o.state[b][k].data_ptr() or k.startswith("qmap"), k


@pytest.mark.parametrize("name", ["Lion8bit", "AdEMAMix8bit", "SGD8bit", "RMSprop8bit", "Adagrad8bit"])
def test_global_optim_manager_override_keeps_a_parameter_32bit(name):
    """bitsandbytes' GlobalOptimManager: an override of optim_bits=32 for one parameter gives it
    32-bit states while its neighbour of the same group stays 8-bit."""
    manager = pagedopt.GlobalOptimManager.get_instance()
    manager.initialize()
    try:
        params = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(600))]
        manager.override_config(params[1], "optim_bits", 32)
        opt = _engine_optimizer(name, params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert opt.state[params[0]]["state1"].dtype == torch.uint8
        assert opt.state[params[1]]["state1"].dtype == torch.float32
    finally:
        manager.initialize()


@pytest.mark.parametrize("name", ["Lion8bit", "AdEMAMix8bit", "AdEMAMix32bit", "SGD8bit"])
def test_export_to_torch_refuses_other_optimizers_clearly(name):
    params = [torch.nn.Parameter(torch.randn(600))]
    opt = _engine_optimizer(name, params)
    params[0].grad = torch.randn(600)
    opt.step()
    with pytest.raises(ValueError, match="exports Adam/AdamW checkpoints"):
        pagedopt.convert.to_torch_state_dict(opt)
    with pytest.raises(ValueError, match=r"'state'\[0\] (has no 'state2'|has a state1 shaped unlike)"):
        pagedopt.convert.to_torch_state_dict(opt.state_dict())


# the fixed-width classes that take optim_bits (bitsandbytes' Adam family; its other fixed-width
# classes have no such argument)
FIXED_WIDTH = ["Adam8bit", "Adam32bit", "AdamW8bit", "AdamW32bit", "PagedAdam8bit", "PagedAdam32bit",
               "PagedAdamW8bit", "PagedAdamW32bit"]


@pytest.mark.parametrize("name", FIXED_WIDTH)
def test_fixed_width_classes_refuse_another_optim_bits(name):
    """bitsandbytes' *8bit / *32bit classes take optim_bits and ignore it; ours accept the default
    (32) and their own width, and refuse any other value with a ValueError naming the class,
    rather than silently run at a width the caller did not ask for."""
    import warnings

    cls = getattr(pagedopt, name)
    width = 8 if name.endswith("8bit") else 32
    kw = {}
    assert "optim_bits" in inspect.signature(cls).parameters
    for bits in (4, 16, 8 if width == 32 else 64):
        with pytest.raises(ValueError, match=f"optim_bits={bits} is not valid for {name}"):
            cls([torch.nn.Parameter(torch.randn(600))], optim_bits=bits, **kw)
    for bits in (32, width):
        p = torch.nn.Parameter(torch.randn(600))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls([p], optim_bits=bits, min_8bit_size=256, **kw)
        assert opt.defaults["optim_bits"] == width
        p.grad = torch.randn(600)
        opt.step()
        assert opt.state[p]["state1"].dtype == (torch.uint8 if width == 8 else torch.float32)


def test_an_empty_step_is_a_no_op_and_a_half_empty_one_is_refused():
    """Every list empty: nothing to update on any device (the op itself, with no tensor argument,
    could not be dispatched: the device run of 2026-12-07 found it); a call with parameters but no
    gradients still reaches the op's checks."""
    from pagedopt import _ops

    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0]
    assert _ops.quantized_step_("adam", [], [], [[], []], [], [], [], hyper) is None
    p = torch.randn(300)
    with pytest.raises((RuntimeError, ValueError)):
        _ops.quantized_step_("adam", [p], [], [[torch.zeros(300)], [torch.zeros(300)]], [],
                             [torch.zeros(())], [], hyper)
