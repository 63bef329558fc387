"""bf16_stochastic_round=True on the optimizer classes: in every signature; a bf16 model whose
updates are below bf16's resolution tracks an fp32 run with it and stands still without it (round
to nearest); a resumed run is bit for bit the uninterrupted one (the seed in the state dict); the
same bits whichever way a step is cut or run (fast step, ordinary step, host-resident pieces,
updates during backward); ignored for fp32 and fp16 parameters; a group setting, checked like the
others (a refused step or checkpoint changes nothing), switched on mid-run; the Trainer's
optim_args. On CUDA (@pytest.mark.cuda): CPU and GPU bit for bit for the algorithms whose update
is exact, the same paths, and captured steps. The rounding itself: tests/test_bf16_sr_rounding.py."""
from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import pagedopt
from pagedopt import _ops
from pagedopt.optim import base as optim_base

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

ALL = sorted(name for name in pagedopt.__all__ if isinstance(getattr(pagedopt, name), type)
             and issubclass(getattr(pagedopt, name), pagedopt.optim.base.QuantizedOptimizer)
             and hasattr(getattr(pagedopt, name), "algorithm"))  # the public classes, not the base
MOMENTUM = {"momentum": 0.9}


def kwargs_for(name: str) -> dict:
    return {**(MOMENTUM if name.startswith(("SGD", "LARS")) else {}), **({"lr": 1e-3} if "SGD" in name or "LARS" in name else {})}


@pytest.mark.parametrize("name", ALL)
def test_every_class_takes_the_argument(name):
    cls = getattr(pagedopt, name)
    parameter = inspect.signature(cls.__init__).parameters["bf16_stochastic_round"]
    assert parameter.default is False and list(inspect.signature(cls.__init__).parameters)[-1] == "bf16_stochastic_round"
    opt = cls([torch.nn.Parameter(torch.randn(10))], bf16_stochastic_round=True, **kwargs_for(name))
    assert opt.param_groups[0]["bf16_stochastic_round"] is True and opt.param_groups[0]["bf16_sr_seed"] == 0


# ---------------------------------------------------------------------------------- tracking
TRACKING = [("AdamW", {}), ("AdamW8bit", {}), ("Lion8bit", {}), ("SGD", {"momentum": 0.0}),
            ("SGD8bit", {"momentum": 0.9})]


@pytest.mark.parametrize("name, kw", TRACKING)
def test_bf16_training_tracks_fp32_with_stochastic_rounding_and_stalls_without(name, kw):
    """4096 weights in [1, 1.5) (bf16 spacing 2^-7 = 0.0078) pulled toward targets 0.05 higher
    (loss 0.5 ||w - w*||^2), with steps of about 1e-4 (Adam, Lion: lr; SGD: lr times a gradient of
    about 0.05): under half a spacing, so round to nearest never moves a weight, the classic failure.
    After 300 steps the fp32 run has moved its mean by d (about 0.03). Stochastic rounding moves
    bf16 weights by their fp32 update in expectation: its mean differs from the fp32 run's by
    rounding noise only, whose variance per weight and step is at most spacing * |update| = 7.8e-7,
    so after 300 steps about sqrt(300 * 7.8e-7) = 0.015 per weight and 0.015 / sqrt(4096) = 2.4e-4
    on the mean. The bound, d / 10 (about 0.003, 12 of those standard deviations), fails round to
    nearest by a factor of 10. The loss: the noise adds at most 0.5 * 4096 * 300 * 7.8e-7 = 0.48 to
    the fp32 run's (about 0.8), while round to nearest stays at the initial 5.1, about 4.3 above it:
    stochastic rounding must be within 0.3 of that gap (1.3), round to nearest is the whole gap."""
    g = torch.Generator().manual_seed(0)
    w0 = (1 + 0.5 * torch.rand(4096, generator=g)).bfloat16().float()
    target = w0 + 0.05
    lr = {"SGD": 2e-3, "SGD8bit": 2e-4}.get(name, 1e-4)
    runs = {}
    for label, dtype, sr in (("fp32", torch.float32, False), ("rtn", torch.bfloat16, False), ("sr", torch.bfloat16, True)):
        w = torch.nn.Parameter(w0.clone().to(dtype))
        opt = getattr(pagedopt, name)([w], lr=lr, weight_decay=0.0, min_8bit_size=1, bf16_stochastic_round=sr, **kw)
        for _ in range(300):
            w.grad = (w.detach().float() - target).to(dtype)
            opt.step()
        runs[label] = w.detach().float()
    moved = (runs["fp32"].mean() - w0.mean()).item()
    assert moved > 0.01, moved
    assert torch.equal(runs["rtn"], w0)  # round to nearest: not one weight moved
    assert abs((runs["sr"].mean() - runs["fp32"].mean()).item()) < moved / 10
    loss = {k: 0.5 * (v - target).square().sum().item() for k, v in runs.items()}
    assert abs(loss["sr"] - loss["fp32"]) < 0.3 * abs(loss["rtn"] - loss["fp32"]), loss


# ---------------------------------------------------------------------------------- whose bits
@pytest.mark.parametrize("name, kw", [("SGD8bit", MOMENTUM), ("SGD32bit", MOMENTUM), ("SGD", {"momentum": 0.0}),
                                      ("Lion8bit", {}), ("AdamW8bit", {})])
def test_each_parameter_rounds_with_its_position_and_step(name, kw):
    """Three steps of an optimizer on bf16 parameters (two param groups) beside a twin on their exact
    fp32 copies, resynchronised before each step (the twin's parameters set to the bf16 ones): each
    bf16 parameter is the reference's stochastic rounding (tests/reference_sr.py) of the twin's
    fp32 result, with the id its position among the optimizer's parameters (0 to 3, across the
    groups), the step count 1, 2, 3 and the group's seed (5 and 6)."""
    import reference_sr as ref

    bf16 = _model()
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in bf16]
    opts = [_make(name, ps, bf16_stochastic_round=True, **kw) for ps in (bf16, fp32)]
    for opt in opts:
        opt.param_groups[0]["bf16_sr_seed"], opt.param_groups[1]["bf16_sr_seed"] = 5, 6
    for step in range(1, 4):
        _grads(bf16, step)
        for a, b in zip(bf16, fp32):
            b.data.copy_(a.detach().float())
            b.grad = a.grad.float()
        for opt in opts:
            opt.step()
        for position, (a, b) in enumerate(zip(bf16, fp32)):
            seed = 5 if position < 2 else 6
            expected = ref.stochastic_round(b.detach(), seed, position, step)
            assert torch.equal(ref.bf16_bits(a.detach()), ref.bf16_bits(expected)), (step, position)


# ---------------------------------------------------------------------------------- resume
def _model(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 80), (5000,), (300,), (40, 33)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)


def _make(name, params, **kw):
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
    return getattr(pagedopt, name)(groups, **{"lr": 1e-2, "min_8bit_size": 1000, "bf16_stochastic_round": True,
                                               **kwargs_for(name), **kw})


RESUME = ["AdamW8bit", "AdamW", "PagedAdamW8bit", "Lion8bit", "SGD8bit", "LAMB8bit", "AdEMAMix8bit", "RMSprop8bit", "AdamW4bit"]


@pytest.mark.parametrize("name", RESUME + ["SGD_plain"])
def test_a_resumed_run_is_bit_for_bit_the_uninterrupted_one(name):
    """Three steps, then state_dict (through torch.save) and the parameters; a fresh optimizer
    (made with the default seed 0) loads them and takes three more steps: the parameters and states
    equal those of six uninterrupted steps, bit for bit, with a seed set to 1234 in both groups
    (restored from the checkpoint). A run with another seed ends elsewhere: the seed is used."""
    cls_name, extra = ("SGD", {"momentum": 0.0}) if name == "SGD_plain" else (name, {})

    def seeded(params):
        opt = _make(cls_name, params, **extra)
        for group in opt.param_groups:
            group["bf16_sr_seed"] = 1234
        return opt

    params = _model()
    opt = seeded(params)
    for step in range(6):
        _grads(params, step)
        opt.step()
        if step == 2:
            buffer = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = _make(cls_name, resumed, **extra)
    assert opt2.param_groups[0]["bf16_sr_seed"] == 0
    opt2.load_state_dict(saved["opt"])
    assert [g["bf16_sr_seed"] for g in opt2.param_groups] == [1234, 1234]
    for step in range(3, 6):
        _grads(resumed, step)
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    for a, b in zip(params, resumed):
        for k, v in opt.state[a].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, opt2.state[b][k]), k
    other = _model()
    opt3 = _make(cls_name, other, **extra)  # seed 0
    for step in range(6):
        _grads(other, step)
        opt3.step()
    assert not torch.equal(other[0], params[0])


# ---------------------------------------------------------------------------------- paths
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 200)
        self.b = torch.nn.Linear(200, 96)
        self.c = torch.nn.Linear(96, 16)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x)))))


def _train_net(name, mode, device="cpu", steps=4):
    """``mode``: "fast" (resident, the fast step), "ordinary" (resident, the fast step refused),
    "host:<bytes>" (states in host memory streamed through a device buffer of that many bytes:
    parameters cut into pieces), "backward:<bytes>" (the same, updated during backward)."""
    torch.manual_seed(0)
    net = Net().to(device, torch.bfloat16)
    opt = getattr(pagedopt, name)(net.parameters(), lr=1e-2, min_8bit_size=1000, bf16_stochastic_round=True)
    if mode.startswith(("host", "backward")):
        opt.set_pager(residency="host", device_buffer=int(mode.split(":")[1]), update_in_backward=mode.startswith("back"))
    g = torch.Generator().manual_seed(3)
    with pytest.MonkeyPatch.context() as mp:
        if mode == "ordinary":
            mp.setattr(optim_base, "fast_step", lambda opt, plan: False)
        for _ in range(steps):
            x = torch.randn(8, 24, generator=g).to(device, torch.bfloat16)
            net(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().cpu() for p in net.parameters()]


PAGED = ["PagedAdamW8bit", "PagedAdamW", "PagedLion8bit", "PagedAdEMAMix8bit", "PagedAdamW4bit"]


@pytest.mark.parametrize("name", PAGED)
def test_the_same_bits_on_every_path(name, monkeypatch):
    """The fast step, the ordinary step, host-resident states streamed in pieces (two buffer sizes:
    the 200 x 96 weight's states are cut at different element offsets, except AdEMAMix's stacked
    ones, which are not cut) and updates during backward give the same parameters, bit for bit:
    each element's bits depend on its index in the whole parameter, not on the piece."""
    offsets = []
    real = _ops.quantized_step_

    def spy(*args, **kw):
        offsets.extend(kw.get("sr_offsets") or [])
        return real(*args, **kw)

    monkeypatch.setattr(_ops, "quantized_step_", spy)
    fast = _train_net(name, "fast")
    moments = 1 if "Lion" in name else 3 if "AdEMAMix" in name else 2
    per_element = moments * (1 if "8bit" in name else 0.5 if "4bit" in name else 4)  # state bytes an element
    for mode in ("ordinary", f"host:{int(40000 * per_element)}", f"host:{int(25000 * per_element)}",
                 f"backward:{int(60000 * per_element)}"):
        other = _train_net(name, mode)
        assert all(torch.equal(a, b) for a, b in zip(fast, other)), mode
    assert (max(offsets, default=0) > 0) == ("AdEMAMix" not in name)  # pieces past a parameter's start were updated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW", "SGD_plain", "Lion8bit"])
def test_ignored_for_fp32_and_fp16_parameters(name, dtype):
    cls_name, extra = ("SGD", {"momentum": 0.0}) if name == "SGD_plain" else (name, {})
    results = []
    for sr in (False, True):
        params = _model(dtype)
        opt = _make(cls_name, params, bf16_stochastic_round=sr, **extra)
        for step in range(3):
            _grads(params, step)
            opt.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "SGD_plain", "LAMB8bit"])
def test_switched_on_mid_run(name):
    """A group setting read at every step, whatever the cached plan and fast step hold: an
    optimizer made without it and switched on after a first step (lr 0 and zero gradients: nothing
    moves and the moments stay 0 on either kernel) takes the next steps exactly as one made with it;
    32-bit AdamW then leaves torch's fused kernel for the engine."""
    cls_name, extra = ("SGD", {"momentum": 0.0}) if name == "SGD_plain" else (name, {})
    runs = []
    for on_from_start in (True, False):
        params = _model()
        opt = _make(cls_name, params, bf16_stochastic_round=on_from_start, **extra)
        for group in opt.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for group in opt.param_groups:
            group["lr"], group["bf16_stochastic_round"] = 1e-2, True
        for step in range(1, 4):
            _grads(params, step)
            opt.step()
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    nearest = _model()
    opt = _make(cls_name, nearest, bf16_stochastic_round=False, **extra)
    for step in range(4):
        _grads(nearest, step)
        opt.step()
    assert not torch.equal(nearest[0], runs[0][0])


# ---------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [1, "yes", None, torch.tensor(True)])
def test_bad_flag_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"Invalid argument 'bf16_stochastic_round'"):
        pagedopt.AdamW8bit(_model(), bf16_stochastic_round=value)
    opt = pagedopt.AdamW8bit(_model()[:1])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['bf16_stochastic_round'\]"):
        opt.add_param_group({"params": _model()[1:], "bf16_stochastic_round": value})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("value", [-1, 2**63, 1.0, True, "3"])
def test_bad_seed_refused_at_step_and_load_changing_nothing(value):
    params = _model()
    opt = _make("AdamW8bit", params)
    _grads(params, 0)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["bf16_sr_seed"] = value
    _grads(params, 1)
    with pytest.raises(ValueError, match=r"Invalid param_groups\[1\]\['bf16_sr_seed'\]"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert float(opt.state[params[0]]["step"]) == 1.0
    opt.param_groups[1]["bf16_sr_seed"] = 0
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["bf16_sr_seed"] = value
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['bf16_sr_seed'\]"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == good["param_groups"]


def test_a_checkpoint_without_the_settings_keeps_the_optimizers_own():
    """A checkpoint saved before these settings existed (or by bitsandbytes) lacks both keys: the
    optimizer keeps its own values, as for any key a checkpoint lacks."""
    params = _model()
    opt = _make("AdamW8bit", params)
    opt.param_groups[0]["bf16_sr_seed"] = 99
    _grads(params, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        del group["bf16_stochastic_round"], group["bf16_sr_seed"]
    opt.load_state_dict(sd)
    assert [(g["bf16_stochastic_round"], g["bf16_sr_seed"]) for g in opt.param_groups] == [(True, 99), (True, 0)]


def test_trainer_optim_args_take_the_flag():
    from pagedopt.integrations import transformers as hf

    assert hf.parse_optim_args("pagedopt_adamw_32bit", "bf16_stochastic_round=true") == {"bf16_stochastic_round": True}
    args = type("Args", (), dict(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                 adam_epsilon=1e-8, optim_args="bf16_stochastic_round=yes,min_8bit_size=16"))()
    cls, kwargs = hf.optimizer_cls_and_kwargs("pagedopt_paged_adamw_8bit", args)
    assert kwargs["bf16_stochastic_round"] is True
    assert cls([torch.nn.Parameter(torch.randn(4))], **kwargs).param_groups[0]["bf16_stochastic_round"] is True
    with pytest.raises(ValueError, match="bf16_stochastic_round"):
        hf.parse_optim_args("pagedopt_lion_8bit", "bf16_stochastic_round=maybe")


# ---------------------------------------------------------------------------------- FSDP2
def _fsdp_sr_scenario(rank, world, device, names):
    """FSDP2 (Shard(0) of every parameter: runs of whole rows) on bf16 parameters with stochastic
    rounding is bit for bit the unsharded run: each local shard draws the bits of its elements'
    indices in the whole parameter (sharding.rounding_place's offset). The model's shards are whole
    256-element blocks (8-bit states as the unsharded ones) and its biases split at offsets 16, 32
    and 64. Shardings that are not runs of rows number their shards instead."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from pagedopt.optim.sharding import rounding_place

    for name in names:
        torch.manual_seed(1)
        reference = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 128),
                                        torch.nn.Tanh(), torch.nn.Linear(128, 32)).to(device, torch.bfloat16)
        model = copy.deepcopy(reference)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        runs = []
        for m in (model, reference):
            opt = getattr(pagedopt, name)(m.parameters(), lr=1e-2, bf16_stochastic_round=True)
            for i in range(4):
                x = torch.randn(32, 128, generator=torch.Generator().manual_seed(7 + i)).to(device, torch.bfloat16)
                opt.zero_grad(set_to_none=True)
                m(x).float().square().mean().backward()
                opt.step()
            runs.append(opt)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.full_tensor(), q), name
        assert [rounding_place(p)[1] for p in model.parameters()] == [rank * n for n in (4096, 32, 4096, 64, 2048, 16)]
    mesh = init_device_mesh(device.type, (world,))
    t = torch.randn(8, 8)
    assert rounding_place(distribute_tensor(t, mesh, [Shard(1)])) == (rank, 0)
    assert rounding_place(distribute_tensor(t, mesh, [Replicate()])) == (0, 0)
    assert rounding_place(distribute_tensor(t, mesh, [Shard(0)])) == (0, rank * 32)


def test_fsdp2_shards_round_as_the_unsharded_run_gloo():
    from distributed_helpers import _launch

    _launch(_fsdp_sr_scenario, 2, "gloo", ("AdamW8bit", "AdamW32bit"))


# ---------------------------------------------------------------------------------- CUDA
def _run_on(device, name, steps=4, **kw):
    params = [torch.nn.Parameter(p.detach().to(device)) for p in _model()]
    opt = _make(name, params, **kw)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["SGD8bit", "Lion8bit", "Lion32bit", "SGD32bit"])
def test_cpu_and_cuda_are_bit_for_bit(name):
    """SGD with momentum and Lion use only correctly rounded operations: the GPU's fp32 result is the
    CPU's, so with the same random bits its bf16 parameters are the CPU's, bit for bit."""
    cpu = _run_on("cpu", name)
    gpu = _run_on("cuda", name)
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))


@pytest.mark.cuda
@pytest.mark.parametrize("name", PAGED)
def test_the_same_bits_on_every_path_cuda(name):
    from pagedopt import paging

    if paging.paging_unavailable_reason("cuda:0") is not None:
        pytest.skip(paging.paging_unavailable_reason("cuda:0"))
    fast = _train_net(name, "fast", "cuda")
    moments = 1 if "Lion" in name else 3 if "AdEMAMix" in name else 2
    per_element = moments * (1 if "8bit" in name else 4)
    for mode in ("ordinary", f"host:{40000 * per_element}", f"backward:{60000 * per_element}"):
        other = _train_net(name, mode, "cuda")
        assert all(torch.equal(a, b) for a, b in zip(fast, other)), mode


@pytest.mark.cuda
@pytest.mark.parametrize("name, kw", [("AdamW8bit", {}), ("AdamW32bit", {}), ("SGD", {"momentum": 0.0}),
                                      ("LAMB8bit", {}), ("PagedAdamW8bit", {})])
def test_captured_steps_round_as_eager_steps(name, kw):
    """Each replay reads the step counter on the GPU, so its bits are the eager step's of that count."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    shapes = [(96, 130), (5000,), (300,)]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    grads = [[torch.randn(s, generator=g).bfloat16().cuda() for s in shapes] for _ in range(5)]
    results = []
    for captured in (False, True):
        params = [torch.nn.Parameter(t.cuda()) for t in init]
        opt = getattr(pagedopt, name)(params, lr=torch.tensor(1e-2, device="cuda"), capturable=True,
                                      bf16_stochastic_round=True, **kw)
        for p, gr in zip(params, grads[0]):
            p.grad = gr.clone()
        opt.step()
        if captured:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                opt.step()
        for k in range(1, 5):
            for p, gr in zip(params, grads[k]):
                p.grad.copy_(gr)
            graph.replay() if captured else opt.step()
        torch.cuda.synchronize()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))
