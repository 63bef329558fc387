"""torch.compile of code that calls the optimizer.

AdamBase.step() is a clean graph break under torch.compile (its docstring says why): the update
runs eagerly, with the same kernels as an eager step, so parameters and states must be bit-equal
to an eager optimizer given the same gradients. A compiled training function (forward, backward,
step, zero_grad) may compute gradients that differ in rounding from eager forward/backward, so
each compiled step is checked against an eager copy of the optimizer fed the very gradients the
compiled step used; torch.compile(step_fn) with gradients set by hand checks the optimizer alone
over several steps. Also: every op with a fake passes torch.library.opcheck, quantized_step_list_
(whose first argument is a torch.classes.pagedopt.QuantizedStateList) included.
"""
import warnings

import pytest
import torch

import pagedopt
from pagedopt import _ops
from pagedopt.quant import STATE_BLOCK_SIZE, dynamic_codebook

STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged classes on the CPU warn that they work unpaged
        yield
    torch._dynamo.reset()


def make_model(dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    # 64*128 = 8192 weights (8-bit states), the rest small (32-bit states)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model.to(device=device, dtype=dtype)


def assert_same(opt_a, opt_b, params_a, params_b):
    """Parameters and every state tensor bit-equal, and the 8-bit states present."""
    eight_bit = 0
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa, pb)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
        eight_bit += sa["state1"].dtype == torch.uint8
    return eight_bit


def train_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    return loss


compiled_train_step = torch.compile(train_step, backend="inductor")

CLASSES = [
    (pagedopt.AdamW8bit, torch.float32),
    (pagedopt.AdamW32bit, torch.float32),
    (pagedopt.PagedAdamW8bit, torch.float32),
    (pagedopt.Adam8bit, torch.bfloat16),
    (pagedopt.Lion8bit, torch.float32),       # the generic engine (QuantizedStateList)
    (pagedopt.AdEMAMix8bit, torch.bfloat16),
]


def check_compiled_training(cls, dtype, device):
    """A compiled forward/backward/step/zero_grad runs; each step equals an eager step of a copy of
    the optimizer given the same gradients, bit for bit."""
    model = make_model(dtype, device)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_params = [p.detach().clone() for p in model.parameters()]
    ref_opt = cls(ref_params, lr=1e-2, weight_decay=0.1)
    x = torch.randn(16, 64, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))
    for _ in range(STEPS):
        loss = compiled_train_step(model, opt, x)
        assert torch.isfinite(loss)
        for p, r in zip(model.parameters(), ref_params):
            r.grad = p.grad.clone()  # the gradients the compiled step used
        ref_opt.step()
        eight_bit = assert_same(opt, ref_opt, list(model.parameters()), ref_params)
    assert eight_bit == (0 if opt.defaults["optim_bits"] == 32 else 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # forward/backward were compiled
    assert all(float(s["step"]) == STEPS for s in opt.state.values())


def check_compiled_step_fn(cls, dtype, device):
    """torch.compile of a function that calls opt.step(), gradients set by hand: N steps equal N eager
    steps from the same start, bit for bit; and torch.compile(opt.step) too."""
    eager_model, model = make_model(dtype, device), make_model(dtype, device)
    eager_opt = cls(eager_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)

    @torch.compile(backend="inductor")
    def step_fn():
        opt.step()

    compiled_step = torch.compile(opt.step, backend="inductor")
    g = torch.Generator(device).manual_seed(2)
    for i in range(2 * STEPS):
        for pe, p in zip(eager_model.parameters(), model.parameters()):
            pe.grad = torch.randn(p.shape, generator=g, device=device).to(dtype)
            p.grad = pe.grad.clone()
        eager_opt.step()
        (step_fn if i % 2 == 0 else compiled_step)()
        assert_same(eager_opt, opt, list(eager_model.parameters()), list(model.parameters()))


@pytest.mark.parametrize("cls,dtype", CLASSES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_compiled_training_step_cpu(cls, dtype):
    check_compiled_training(cls, dtype, "cpu")


@pytest.mark.parametrize("cls,dtype", CLASSES[:2], ids=lambda v: getattr(v, "__name__", str(v)))
def test_compiled_step_fn_cpu(cls, dtype):
    check_compiled_step_fn(cls, dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("cls,dtype", CLASSES + [(pagedopt.PagedAdamW32bit, torch.float16)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_compiled_training_step_cuda(cls, dtype):
    check_compiled_training(cls, dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("cls,dtype", CLASSES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_compiled_step_fn_cuda(cls, dtype):
    check_compiled_step_fn(cls, dtype, "cuda")


def test_compiled_step_with_closure():
    """opt.step(closure) inside a compiled function: the closure (zero_grad, forward, backward) is traced
    with the caller, the update runs eagerly and equals an eager step on the same gradients."""
    model = make_model()
    opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-2)
    ref_params = [p.detach().clone() for p in model.parameters()]
    ref_opt = pagedopt.AdamW8bit(ref_params, lr=1e-2)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))

    @torch.compile(backend="inductor")
    def run():
        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss
        return opt.step(closure)

    for _ in range(2):
        loss = run()
        assert torch.isfinite(loss)
        for p, r in zip(model.parameters(), ref_params):
            r.grad = p.grad.clone()
        ref_opt.step()
        assert assert_same(opt, ref_opt, list(model.parameters()), ref_params) == 1


# ---------------------------------------------------------------------------------- opcheck
def _state_list_case(device, sizes=(520, 33, 4100)):
    g = torch.Generator().manual_seed(5)
    code1, code2 = dynamic_codebook(True, device), dynamic_codebook(False, device)
    lists = {k: [] for k in ("p", "g", "q1", "q2", "a1", "a2", "steps")}
    for n in sizes:
        blocks = (n + STATE_BLOCK_SIZE - 1) // STATE_BLOCK_SIZE
        lists["p"].append(torch.randn(n, generator=g).to(device))
        lists["g"].append(torch.randn(n, generator=g).to(device))
        lists["q1"].append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device))
        lists["q2"].append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device))
        lists["a1"].append((torch.rand(blocks, generator=g) * 0.1).to(device))
        lists["a2"].append((torch.rand(blocks, generator=g) * 0.01).to(device))
        lists["steps"].append(torch.tensor(3.0, device=device))
    held = torch.classes.pagedopt.QuantizedStateList("adam", lists["q1"] + lists["q2"], lists["a1"] + lists["a2"],
                                                     lists["steps"], [code1, code2])
    return held, lists


ADAMW_HYPER = [1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0]  # lr, beta1, beta2, eps, weight_decay, decoupled


def _opcheck_state_list(device):
    """opcheck's fake-tensor, autograd-registration and AOT-dispatch tests. Its test_schema cannot run
    on an op with a custom-class argument (torch's SchemaInfo raises "Cannot inspect value of type
    Capsule" when it computes aliasing with the object), so the schema part is checked by hand: of the
    arguments only params (Tensor(a!)[]) change, and the held states (inside the object) change."""
    held, lists = _state_list_case(device)
    args = (held, lists["p"], lists["g"], ADAMW_HYPER, None, None)
    torch.library.opcheck(torch.ops.pagedopt.quantized_step_list_, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    before = {k: [t.clone() for t in v] for k, v in lists.items()}
    torch.ops.pagedopt.quantized_step_list_(*args)
    assert all(not torch.equal(a, b) for a, b in zip(before["p"], lists["p"]))      # annotated (a!)
    assert all(torch.equal(a, b) for a, b in zip(before["g"], lists["g"]))          # not annotated
    for k in ("q1", "q2", "a1", "a2"):                                              # held by the object
        assert any(not torch.equal(a, b) for a, b in zip(before[k], lists[k])), k
    assert all(torch.equal(a, b) for a, b in zip(before["steps"], lists["steps"]))  # steps are read only


def test_adam_state_list_has_fake_and_passes_opcheck():
    assert torch._library.fake_class_registry.has_fake_class("__torch__.torch.classes.pagedopt.QuantizedStateList")
    held, lists = _state_list_case("cpu")
    flat = dict(held.__obj_flatten__())
    assert flat["states"][0].data_ptr() == lists["q1"][0].data_ptr()  # the held tensors, not copies
    _opcheck_state_list("cpu")
    # the fake checks the list lengths against the held states
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch._library.fake_class_registry.maybe_to_fake_obj(mode, held)
        params = [mode.from_tensor(p) for p in lists["p"]]
        with pytest.raises(RuntimeError, match="held states"):
            torch.ops.pagedopt.quantized_step_list_(fake, params[:2], params[:2], ADAMW_HYPER, None, None)


def test_eager_held_step_skips_the_fake_object_scan(monkeypatch):
    """An eager step calls quantized_step_list_'s C++ entry point directly (torch's Python entry
    point would first walk all 2 x n list elements looking for fake objects); a fake held object
    (tracing) still goes through torch's entry point and the op's fake."""
    held, lists = _state_list_case("cpu")
    expected_held, expected = _state_list_case("cpu")
    torch.ops.pagedopt.quantized_step_list_(expected_held, expected["p"], expected["g"], ADAMW_HYPER, None, None)

    original = torch._ops._must_dispatch_in_python

    def no_scan(args, kwargs):  # other torchbind ops (the profiler's record_function) may scan theirs
        if any(isinstance(a, (list, tuple)) and len(a) >= 3 for a in args):
            raise AssertionError("torch's Python entry point scanned the tensor lists")
        return original(args, kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch._ops, "_must_dispatch_in_python", no_scan)
        _ops.quantized_step_list_(held, lists["p"], lists["g"], ADAMW_HYPER)
        params = [torch.nn.Parameter(torch.randn(5000)) for _ in range(3)]
        opt = pagedopt.AdamW8bit(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # the optimizers' step takes the direct path
    for k in ("p", "q1", "q2", "a1", "a2"):
        assert all(torch.equal(a, b) for a, b in zip(lists[k], expected[k])), k  # the same op, bit for bit
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch._library.fake_class_registry.maybe_to_fake_obj(mode, held)
        fparams = [mode.from_tensor(p) for p in lists["p"]]
        _ops.quantized_step_list_(fake, fparams, fparams, ADAMW_HYPER)
        with pytest.raises(RuntimeError, match="held states"):
            _ops.quantized_step_list_(fake, fparams[:2], fparams[:2], ADAMW_HYPER)


def test_check_grads_fake_matches_and_passes_opcheck():
    p = [torch.zeros(4, 3), torch.zeros(5, dtype=torch.bfloat16)]
    cases = {
        "contiguous": ([torch.ones(4, 3), torch.ones(5, dtype=torch.bfloat16)], _ops.GRADS_CONTIGUOUS),
        "transposed": ([torch.ones(3, 4).t(), torch.ones(5, dtype=torch.bfloat16)], _ops.GRADS_NOT_CONTIGUOUS),
        "dtype": ([torch.ones(4, 3), torch.ones(5)], 1),
        "shape": ([torch.ones(12), torch.ones(5, dtype=torch.bfloat16)], 0),
    }
    for name, (grads, expected) in cases.items():
        assert _ops.check_grads(p, grads) == expected, name
        with torch._subclasses.FakeTensorMode() as mode:
            assert torch.ops.pagedopt.check_grads([mode.from_tensor(t) for t in p],
                                                  [mode.from_tensor(t) for t in grads]) == expected, name
        torch.library.opcheck(torch.ops.pagedopt.check_grads, (p, grads))


@pytest.mark.cuda
def test_opcheck_cuda_ops():
    _opcheck_state_list("cuda")
    args = ([1000, 3], torch.float32, torch.device("cuda"))
    torch.library.opcheck(torch.ops.pagedopt.managed_empty, args)
    # prefetch_ and advise_preferred_location_ are not opchecked: every opcheck test (the fake one
    # too) runs the op on copies of its inputs in ordinary memory, which these ops refuse by design
    # (seen on the H200); their fakes are plain no-ops in pagedopt/_ops.py.
