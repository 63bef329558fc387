"""capturable=True on a GPU: steps captured with torch.cuda.graph and replayed, bit for bit against
the same steps run eagerly; a scheduler's lr change seen by the replays; GradScaler's skipped step
inside the graph; a whole training step (forward, backward, step) captured; resident paged states
captured; and the refusals (paged out, host-resident, no warm-up) leaving everything unchanged.
The CPU side (arguments, tensor lr, the refusal logic): tests/test_capturable.py."""
from __future__ import annotations

import copy

import pytest
import torch

import pagedopt

pytestmark = pytest.mark.cuda

DEV = "cuda"


@pytest.fixture(autouse=True)
def _no_stray_frees_during_capture():
    """Optimizers of earlier tests that only the garbage collector frees give their paged (managed)
    states back with cudaFree, which invalidates a capture it lands in: collect them first."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    yield

# (class, keyword arguments): every algorithm, 8-bit and 32-bit, paged and not, the stateless SGD
CASES = [
    ("AdamW8bit", {}), ("Adam8bit", {}), ("AdamW32bit", {}), ("PagedAdamW8bit", {}), ("PagedAdamW32bit", {}),
    ("Lion8bit", {}), ("Lion32bit", {}), ("AdEMAMix8bit", {}), ("AdEMAMix32bit", {}),
    ("SGD8bit", {"momentum": 0.9}), ("SGD", {"momentum": 0.0}), ("RMSprop8bit", {}), ("Adagrad8bit", {}),
    ("LARS8bit", {"momentum": 0.9}), ("LAMB8bit", {}), ("LAMB32bit", {}),
    ("AdamW4bit", {}), ("PagedAdamW4bit", {}), ("Lion4bit", {}), ("AdEMAMix", {"optim_bits": 4}),
    ("LAMB", {"optim_bits": 4}),
]


def _params(dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    # 8-bit states (>= 4096 elements, a ragged last block) and one 32-bit state (under min_8bit_size)
    shapes = [(96, 130), (5000,), (300,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, device=DEV).to(dtype)) for s in shapes]


def _grad_sequence(params, steps, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, device=DEV).to(p.dtype) for p in params] for _ in range(steps)]


def _snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        st = opt.state[p]
        out += [st[k].detach().clone() for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"tensor {i} differs"


LRS = [1e-3, 5e-4, 2.5e-4, 2e-3, 1e-3]  # what a scheduler writes into the lr tensor before each step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, kw", CASES)
def test_replayed_step_is_bit_for_bit_the_eager_step(name, kw, dtype):
    cls = getattr(pagedopt, name)
    grads = _grad_sequence(_params(dtype), len(LRS))

    ref_params = _params(dtype)
    ref_lr = torch.tensor(LRS[0], device=DEV)
    ref = cls(ref_params, lr=ref_lr, capturable=True, **kw)
    for k, lr in enumerate(LRS):
        ref_lr.fill_(lr)
        for p, g in zip(ref_params, grads[k]):
            p.grad = g.clone()
        ref.step()

    params = _params(dtype)
    lr_t = torch.tensor(LRS[0], device=DEV)
    opt = cls(params, lr=lr_t, capturable=True, **kw)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()  # the graph's static gradients
    opt.step()  # eager warm-up: makes the states and the step plan
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(1, len(LRS)):
        lr_t.fill_(LRS[k])
        for p, g in zip(params, grads[k]):
            p.grad.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    _assert_same(_snapshot(ref, ref_params), _snapshot(opt, params))
    assert float(opt.state[params[0]]["step"]) == len(LRS)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(DEV)


def _batches(n, seed=2):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(32, 64, generator=g, device=DEV), torch.randn(32, 64, generator=g, device=DEV))
            for _ in range(n)]


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "Lion8bit"])
def test_a_whole_training_step_captured_trains_as_eager_steps_do(name):
    cls = getattr(pagedopt, name)
    batches = _batches(6)
    loss_fn = torch.nn.MSELoss()

    ref_model = _mlp()
    ref = cls(ref_model.parameters(), lr=torch.tensor(1e-3, device=DEV), capturable=True, min_8bit_size=1024)
    for x, y in batches:
        loss_fn(ref_model(x), y).backward()
        ref.step()
        ref.zero_grad(set_to_none=True)

    model = _mlp()
    opt = cls(model.parameters(), lr=torch.tensor(1e-3, device=DEV), capturable=True, min_8bit_size=1024)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's recipe does
        loss_fn(model(static_x), static_y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_fn(model(static_x), static_y).backward()
        opt.step()
    for x, y in batches[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _assert_same(_snapshot(ref, list(ref_model.parameters())), _snapshot(opt, list(model.parameters())))


def test_grad_scaler_inside_the_graph_skips_the_non_finite_step():
    batches = _batches(5)
    batches[2] = (torch.full_like(batches[2][0], float("inf")), batches[2][1])  # non-finite gradients
    loss_fn = torch.nn.MSELoss()
    scale = 2.0 ** 10

    # eager: a fresh scaler per step (the scale a graph has is the one at capture: update() runs outside)
    ref_model = _mlp()
    ref = pagedopt.AdamW8bit(ref_model.parameters(), lr=torch.tensor(1e-3, device=DEV), capturable=True,
                             min_8bit_size=1024)
    for x, y in batches:
        scaler = torch.amp.GradScaler(DEV, init_scale=scale, growth_interval=1 << 30)
        scaler.scale(loss_fn(ref_model(x), y)).backward()
        scaler.step(ref)
        ref.zero_grad(set_to_none=True)

    model = _mlp()
    opt = pagedopt.AdamW8bit(model.parameters(), lr=torch.tensor(1e-3, device=DEV), capturable=True,
                             min_8bit_size=1024)
    scaler = torch.amp.GradScaler(DEV, init_scale=scale, growth_interval=1 << 30)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    scaler.scale(loss_fn(model(static_x), static_y)).backward()
    scaler.step(opt)  # eager warm-up
    scaler.update()
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaler.scale(loss_fn(model(static_x), static_y)).backward()
        scaler.step(opt)
    counts = []
    for x, y in batches[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        counts.append(float(opt.state[next(iter(model.parameters()))]["step"]))
    assert counts == [2.0, 2.0, 3.0, 4.0]  # the non-finite step was skipped inside the graph
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _assert_same(_snapshot(ref, list(ref_model.parameters())), _snapshot(opt, list(model.parameters())))


def _warm(name="PagedAdamW8bit", **kw):
    params = _params(torch.float32)
    opt = getattr(pagedopt, name)(params, lr=torch.tensor(1e-3, device=DEV), capturable=True, **kw)
    for p, g in zip(params, _grad_sequence(params, 1)[0]):
        p.grad = g
    opt.step()
    return opt, params


def _refused_capture(opt, params, before, match):
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=match):
        with torch.cuda.graph(graph):
            opt.step()
    if opt._pager is not None:
        opt.settle()  # paged-out or host-resident states readable
    torch.cuda.synchronize()
    _assert_same(before, _snapshot(opt, params))


def test_capture_of_paged_out_states_is_refused_and_changes_nothing():
    opt, params = _warm()
    before = _snapshot(opt, params)  # while resident: after page_out() the managed pages hold no bytes
    opt.page_out()
    _refused_capture(opt, params, before, r"while paged states are not all resident")
    opt.step()  # eager: pages them in; then the capture works
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    torch.cuda.synchronize()
    assert float(opt.state[params[0]]["step"]) == 3.0


def test_capture_of_host_resident_states_is_refused_and_changes_nothing():
    params = _params(torch.float32)
    opt = pagedopt.PagedAdamW8bit(params, lr=torch.tensor(1e-3, device=DEV), capturable=True)
    opt.set_pager(residency="host", device_buffer="4MiB")
    for p, g in zip(params, _grad_sequence(params, 1)[0]):
        p.grad = g
    opt.step()
    opt.settle()
    _refused_capture(opt, params, _snapshot(opt, params), r"host-resident states")


def test_capture_before_a_warm_up_is_refused_and_makes_no_state():
    params = _params(torch.float32)
    opt = pagedopt.AdamW8bit(params, lr=torch.tensor(1e-3, device=DEV), capturable=True)
    for p, g in zip(params, _grad_sequence(params, 1)[0]):
        p.grad = g
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"before its states exist"):
        with torch.cuda.graph(graph):
            opt.step()
    assert len(opt.state) == 0


def test_a_captured_step_survives_a_checkpoint_round_trip_of_its_optimizer(tmp_path):
    opt, params = _warm("AdamW8bit")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    torch.cuda.synchronize()
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    other = pagedopt.AdamW8bit(params, lr=torch.tensor(5e-4, device=DEV), capturable=True)
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"].device.type == "cuda" and float(other.param_groups[0]["lr"]) == float(
        torch.tensor(1e-3))
    copy.deepcopy(other)
    for key in ("state1", "state2", "absmax1", "absmax2", "step"):
        assert torch.equal(other.state[params[0]][key], opt.state[params[0]][key])
