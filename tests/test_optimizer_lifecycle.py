"""What users do to an optimizer besides stepping it, compared with torch.optim.AdamW where torch
defines the behaviour: invalid param groups, state reset by hand, tensor swapping, per-parameter
settings through GlobalOptimManager."""
import copy

import pytest
import torch

import pagedopt
from pagedopt import GlobalOptimManager

CLASSES = [pagedopt.AdamW8bit, pagedopt.AdamW32bit, pagedopt.Adam8bit, pagedopt.PagedAdamW8bit]


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # 700 elements: 8-bit with min_8bit_size=256; 100: 32-bit
    return [torch.randn(7, 100, generator=g).to(dtype).requires_grad_(True),
            torch.randn(100, generator=g).to(dtype).requires_grad_(True)]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(opt, params, seeds):
    for s in seeds:
        set_grads(params, s)
        opt.step()


def snapshot(opt):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in opt.state.values()]


def assert_same(a_params, b_params, a_opt=None, b_opt=None):
    for a, b in zip(a_params, b_params):
        assert torch.equal(a, b)
    if a_opt is not None:
        for pa, pb in zip(a_params, b_params):
            sa, sb = a_opt.state[pa], b_opt.state[pb]
            assert sa.keys() == sb.keys()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(autouse=True)
def fresh_manager():
    GlobalOptimManager.get_instance().initialize()
    yield
    GlobalOptimManager.get_instance().initialize()


# ------------------------------------------------------------------ add_param_group
@pytest.mark.parametrize("bad", [dict(betas=(1.2, 0.9)), dict(lr=-1.0), dict(eps=float("nan")),
                                 dict(optim_bits=7), dict(min_8bit_size=-1), dict(weight_decay=-1.0)])
def test_refused_param_group_is_not_added(bad):
    params = make_params()
    extra = [torch.randn(300, requires_grad=True)]
    opt = pagedopt.AdamW8bit(params, min_8bit_size=256)
    run(opt, params, [0])
    key = next(iter(bad))
    with pytest.raises(ValueError, match=rf"param_groups\[1\]\['{key}'\]"):
        opt.add_param_group({"params": extra, **bad})
    assert len(opt.param_groups) == 1
    extra[0].grad = torch.randn(300)
    run(opt, params, [1])  # steps, and the refused group's parameter is not updated
    assert extra[0] not in opt.state


# ------------------------------------------------------------------ state reset by hand
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("how", ["assign_empty", "clear_table", "clear_param_state", "pop"])
def test_state_reset_by_hand_restarts_like_a_fresh_optimizer(cls, how):
    """torch re-initialises a state that was reset by hand; the cached step plan must not keep
    the old moments. After the reset, steps equal those of a fresh optimizer from the same
    parameters (bit for bit: same kernels, same inputs)."""
    params = make_params()
    opt = cls(params, min_8bit_size=256)
    run(opt, params, [0, 1])
    if how == "assign_empty":
        for p in params:
            opt.state[p] = {}
    elif how == "clear_table":
        opt.state.clear()
    elif how == "clear_param_state":
        for p in params:
            opt.state[p].clear()
    else:
        for p in params:
            opt.state.pop(p)
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    fresh = cls(twin, min_8bit_size=256)
    run(opt, params, [2, 3])
    run(fresh, twin, [2, 3])
    assert_same(params, twin, opt, fresh)


def test_state_tensor_replaced_by_hand_is_used():
    params = make_params()
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    opt = pagedopt.AdamW32bit(params)
    ref = pagedopt.AdamW32bit(twin)
    run(opt, params, [0])
    run(ref, twin, [0])
    for p, q in zip(params, twin):  # new tensors with new values, in both
        opt.state[p]["state1"] = torch.full_like(opt.state[p]["state1"], 0.5)
        ref.state[q]["state1"].fill_(0.5)
    run(opt, params, [1])
    run(ref, twin, [1])
    assert_same(params, twin, opt, ref)


# ------------------------------------------------------------------ tensor swapping
@pytest.mark.parametrize("cls", CLASSES)
def test_module_tensor_swapping_after_a_step(cls):
    """With swapping on, model.load_state_dict and model.to(dtype) swap each parameter's tensor in
    place (torch.utils.swap_tensors needs the optimizer to hold no extra reference); the optimizer
    then steps the swapped tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 4))
    opt = cls(model.parameters(), min_8bit_size=256)
    x = torch.randn(8, 40)
    model(x).square().mean().backward()
    opt.step()
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        target = {k: v + 1 for k, v in model.state_dict().items()}
        model.load_state_dict(target)
        for k, v in model.state_dict().items():
            assert torch.equal(v, target[k])
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        model.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# ------------------------------------------------------------------ deepcopy
@pytest.mark.parametrize("cls", CLASSES)
def test_deepcopy_steps_like_the_original(cls):
    params = make_params()
    opt = cls(params, min_8bit_size=256)
    run(opt, params, [0])
    copy_opt = copy.deepcopy(opt)
    copy_params = [p for g in copy_opt.param_groups for p in g["params"]]
    assert all(c is not p for c, p in zip(copy_params, params))
    run(opt, params, [1, 2])
    run(copy_opt, copy_params, [1, 2])
    assert_same(params, copy_params, opt, copy_opt)


# ------------------------------------------------------------------ GlobalOptimManager
def test_manager_is_a_singleton():
    with pytest.raises(RuntimeError, match="get_instance"):
        GlobalOptimManager()
    assert GlobalOptimManager.get_instance() is GlobalOptimManager.get_instance()


@pytest.mark.parametrize("form", ["key_value", "dict", "module"])
def test_override_gives_a_parameter_32bit_states(form):
    params = make_params()
    mng = GlobalOptimManager.get_instance()
    if form == "key_value":
        mng.override_config(params[0], "optim_bits", 32)
    elif form == "dict":
        mng.override_config([params[0]], key_value_dict={"optim_bits": 32})
    else:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(params[0].detach())
        params[0] = module.weight
        mng.register_module_override(module, "weight", {"optim_bits": 32})
    opt = pagedopt.AdamW8bit(params, min_8bit_size=50)
    run(opt, params, [0])
    assert opt.state[params[0]]["state1"].dtype == torch.float32
    assert opt.state[params[1]]["state1"].dtype == torch.uint8  # 100 >= 50, no override


def test_override_by_index_survives_replacing_the_parameters():
    """register_parameters before the parameters are replaced (as model.to(device) may do): the
    override follows the (group, index) position."""
    params = make_params()
    mng = GlobalOptimManager.get_instance()
    mng.register_parameters(params)            # nothing overridden yet: records nothing
    mng.override_config(params[0], "optim_bits", 32)
    mng.register_parameters(params)
    moved = [p.detach().clone().requires_grad_(True) for p in params]
    opt = pagedopt.AdamW8bit(moved, min_8bit_size=50)
    run(opt, moved, [0])
    assert opt.state[moved[0]]["state1"].dtype == torch.float32
    assert opt.state[moved[1]]["state1"].dtype == torch.uint8


def test_override_of_lr_changes_only_that_parameter():
    params = make_params()
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    GlobalOptimManager.get_instance().override_config(params[1], "lr", 0.0)
    opt = pagedopt.AdamW32bit(params, lr=1e-2, weight_decay=0.0)
    ref = pagedopt.AdamW32bit(twin, lr=1e-2, weight_decay=0.0)
    start = params[1].detach().clone()
    run(opt, params, [0])
    run(ref, twin, [0])
    assert torch.equal(params[0], twin[0])
    assert torch.equal(params[1], start)          # lr 0: no movement
    assert not torch.equal(twin[1], start)


def test_bad_override_is_refused_by_name():
    params = make_params()
    mng = GlobalOptimManager.get_instance()
    with pytest.raises(ValueError, match="'percentile'"):
        mng.override_config(params[0], "percentile", 5)
    mng.override_config(params[0], "optim_bits", 16)
    opt = pagedopt.AdamW8bit(params)
    set_grads(params, 0)
    with pytest.raises(ValueError, match=r"param_groups\[0\].*params\[0\].*'optim_bits'"):
        opt.step()


def test_overridden_32bit_state_round_trips_through_a_checkpoint():
    """A 32-bit state in a group that says 8-bit (and the reverse) keeps its width when loaded
    into an optimizer without the override."""
    import io

    params = make_params()
    GlobalOptimManager.get_instance().override_config(params[0], "optim_bits", 32)
    opt = pagedopt.AdamW8bit(params, min_8bit_size=50)
    run(opt, params, [0])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    GlobalOptimManager.get_instance().initialize()
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    opt2 = pagedopt.AdamW8bit(twin, min_8bit_size=50)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.state[twin[0]]["state1"].dtype == torch.float32
    run(opt, params, [1])
    run(opt2, twin, [1])
    assert_same(params, twin, opt, opt2)


def test_override_does_not_pass_to_a_tensor_that_reuses_a_freed_id():
    """Overrides are found by id(); once the overridden tensor is freed, a new tensor given the same
    id must not inherit its override. The id's reuse is made certain by registering the override
    under the new tensor's id with the (dead) weak reference of a freed tensor, which is what
    CPython's id reuse leaves behind."""
    import gc
    import weakref

    mng = GlobalOptimManager.get_instance()
    freed = torch.randn(300, requires_grad=True)
    mng.override_config(freed, "optim_bits", 32)
    dead = mng._pid_refs[id(freed)]
    q = torch.randn(300, requires_grad=True)
    mng.pid2config[id(q)] = mng.pid2config.pop(id(freed))
    mng._pid_refs[id(q)] = mng._pid_refs.pop(id(freed))
    del freed
    gc.collect()
    assert isinstance(dead, weakref.ref) and dead() is None
    opt = pagedopt.AdamW8bit([q], min_8bit_size=256)
    q.grad = torch.randn(300)
    opt.step()
    assert opt.state[q]["state1"].dtype == torch.uint8
    # and a live override still applies
    mng.override_config(q, "optim_bits", 32)
    opt2 = pagedopt.AdamW8bit([q], min_8bit_size=256)
    opt2.step()
    assert opt2.state[q]["state1"].dtype == torch.float32


def test_set_pager_takes_a_budget_or_a_pager_before_the_first_step():
    """A paged optimizer takes a device budget ("4GiB", bytes) or a PageManager of its own before it
    holds states; its stats report the budget, copies keep it, and every misuse is a ValueError
    that changes nothing."""
    import copy
    import warnings

    from pagedopt.paging import PageManager

    warnings.simplefilter("ignore")  # paged classes on the CPU work unpaged and warn
    params = [torch.nn.Parameter(torch.randn(5000))]
    opt = pagedopt.PagedAdamW8bit(params)
    with pytest.raises(ValueError, match="device_budget must be"):
        opt.set_pager(device_budget="4 parsecs")
    with pytest.raises(ValueError, match="exactly one"):
        opt.set_pager()
    with pytest.raises(ValueError, match="must be a pagedopt.PageManager"):
        opt.set_pager(pager=object())
    opt.set_pager(device_budget="3MiB")
    assert opt.paging_stats().budget_bytes == 3 * 2**20
    mine = PageManager(budget_bytes=12345)
    opt.set_pager(mine)
    params[0].grad = torch.randn(5000)
    opt.step()
    assert opt._pager is mine and opt.paging_stats().budget_bytes == 12345
    assert copy.deepcopy(opt).paging_stats().budget_bytes == 12345
    with pytest.raises(ValueError, match="already holds states"):
        opt.set_pager(device_budget=1 << 30)
    assert opt._pager is mine
    with pytest.raises(ValueError, match="is not a paged optimizer"):
        pagedopt.Lion8bit(params).set_pager(device_budget="1GiB")
