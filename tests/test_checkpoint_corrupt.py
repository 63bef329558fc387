"""A corrupted checkpoint is refused with a ValueError naming the place, and changes nothing.

Each kind of corruption, in each of its variants (CASES), is a test case of its own, so every one
runs whatever hypothesis draws; hypothesis picks the parameter, position and bad value. All run
in this process: a checkpoint must never crash it (a 60-element state1 for a 73-element
parameter once aborted it with 'double free or corruption'). After a refusal, every state
tensor (object, dtype, values), the set of states and every group value are as before, and the
next step gives bit for bit what an untouched twin of the optimizer gives.
"""
import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedopt
from pagedopt.convert import to_torch_state_dict

# (shape, dtype, group); with min_8bit_size=100: 8-bit states for 300 and 600 elements, 32-bit
# for 73 and 50. State ids follow state_dict(): 0, 1 in group 0, then 2, 3 in group 1.
PARAMS = [((73,), torch.float32, 0), ((300,), torch.float32, 0), ((20, 30), torch.bfloat16, 1),
          ((50,), torch.bfloat16, 1)]
WHERE = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
EIGHT_BIT = (1, 2)
KEYS_8 = ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")
KEYS_32 = ("state1", "state2")
BNB_QUANT = "__bnb_optimizer_quant_state__"
STRUCTURAL = None  # a structural refusal: a ValueError, place not prescribed by the spec


def build(seeds):
    """An AdamW8bit over PARAMS in two groups, stepped once per seed (deterministic)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(dtype).requires_grad_(True) for shape, dtype, _ in PARAMS]
    opt = pagedopt.AdamW8bit([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], min_8bit_size=100)
    for seed in seeds:
        step(opt, params, seed)
    return params, opt


def step(opt, params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


_SOURCE = {}


def source_checkpoint():
    """A valid checkpoint, of other states than the optimizer it is loaded into."""
    if not _SOURCE:
        _SOURCE["sd"] = copy.deepcopy(build(range(100, 103))[1].state_dict())
    return copy.deepcopy(_SOURCE["sd"])


def loc(k):
    gi, pi = WHERE[k]
    return f"param_groups[{gi}]['params'][{pi}]"


def resized(t, n):
    """t's values, repeated or cut to n elements (same dtype)."""
    flat = t.reshape(-1)
    return flat.repeat(n // flat.numel() + 1)[:n].clone()


def new_value(t, changes):
    """A copy of t with the entries {index: value} set (never in place: codebooks are shared)."""
    t = t.clone()
    for i, v in changes.items():
        t[i] = v
    return t


def numel_other_than(n):
    return st.one_of(st.sampled_from([n - 13, n + 1, 1]), st.integers(1, 3 * n)).filter(lambda m: m != n)


# Each corruption c_<kind>(sd, data, variant) edits sd in place and returns (place, keys): the
# message must contain place and one of the quoted keys (several only where the spec leaves open
# which one a message names), or STRUCTURAL. Every (kind, variant) is a test case of its own.
def any_state(data):
    return data.draw(st.sampled_from(sorted(WHERE)))


def c_state_numel(sd, data, name):
    k = any_state(data)
    t = sd["state"][k][name]
    sd["state"][k][name] = resized(t, data.draw(numel_other_than(t.numel())))
    return loc(k), [name]


def c_state_shape(sd, data, name):  # same number of elements, another shape
    k = any_state(data)
    t = sd["state"][k][name]
    n = t.numel()
    shapes = [(n, 1), (1, n)] + ([(n,)] if t.dim() != 1 else []) + ([t.shape[::-1]] if t.dim() == 2 else [])
    sd["state"][k][name] = t.reshape(data.draw(st.sampled_from(shapes))).clone()
    return loc(k), [name]


def c_dtype(sd, data, name):
    k = any_state(data) if name.startswith("state") else data.draw(st.sampled_from(EIGHT_BIT))
    s = sd["state"][k]
    if name.startswith("state"):
        other = torch.float32 if k in EIGHT_BIT else torch.uint8  # also mixes widths
        dtype = data.draw(st.sampled_from([other, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                           torch.int32]))
    else:
        dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int32]))
    s[name] = s[name].to(dtype)
    if dtype == torch.uint8:  # a float32 state turned to codes: it may be reported as incomplete 8-bit
        return loc(k), KEYS_8
    return loc(k), (KEYS_32 if dtype == torch.float32 else [name])


def c_mixed(sd, data, name):  # one moment of an 8-bit state as plausible float32 values
    k = data.draw(st.sampled_from(EIGHT_BIT))
    s = sd["state"][k]
    s[name] = torch.randn(s[name].shape) ** (1 if name == "state1" else 2)
    return loc(k), KEYS_32


def c_absmax(sd, data, how):
    k = data.draw(st.sampled_from(EIGHT_BIT))
    name = data.draw(st.sampled_from(["absmax1", "absmax2"]))
    a = sd["state"][k][name]
    i = data.draw(st.integers(0, a.numel() - 1))
    sd["state"][k][name] = {
        "short": lambda: a[:-1].clone(), "empty": lambda: a[:0].clone(),
        "long": lambda: resized(a, a.numel() + data.draw(st.integers(1, 5))),
        "nan": lambda: new_value(a, {i: float("nan")}), "inf": lambda: new_value(a, {i: math.inf}),
        "negative": lambda: new_value(a, {i: -(a[i].abs().item() + 1e-3)}),
        "2d": lambda: a.reshape(-1, 1).clone()}[how]()
    return loc(k), [name]


def c_qmap(sd, data, how):
    k = data.draw(st.sampled_from(EIGHT_BIT))
    name = data.draw(st.sampled_from(["qmap1", "qmap2"]))
    q = sd["state"][k][name]
    i = data.draw(st.integers(0, 254))
    sd["state"][k][name] = {
        "short": lambda: q[:255].clone(), "long": lambda: torch.cat([q, q[-1:] + 1e-3]),
        "swapped": lambda: new_value(q, {i: q[i + 1].item(), i + 1: q[i].item()}),
        "repeated": lambda: new_value(q, {i + 1: q[i].item()}),
        "nan": lambda: new_value(q, {i: float("nan")}),
        # still sorted and finite, but outside [-1, 1]
        "above 1": lambda: new_value(q, {255: 1.0 + data.draw(st.floats(1e-3, 4.0))}),
        "below -1": lambda: new_value(q, {0: -1.0 - data.draw(st.floats(1e-3, 4.0))})}[how]()
    return loc(k), [name]


def c_missing_key(sd, data, name):
    k = any_state(data) if name.startswith("state") else data.draw(st.sampled_from(EIGHT_BIT))
    del sd["state"][k][name]
    return loc(k), [name]


BAD_STEPS = {"-1": -1, "-0.5": -0.5, "nan": float("nan"), "inf": math.inf, "string": "3", "None": None,
             "tensor -1": torch.tensor(-1.0), "tensor nan": torch.tensor(float("nan")),
             "two elements": torch.tensor([1.0, 2.0])}


def c_step(sd, data, variant):
    k = any_state(data)
    sd["state"][k]["step"] = BAD_STEPS[variant]
    return loc(k), ["step"]


def c_not_a_dict(sd, data, variant):
    k = any_state(data)
    s = sd["state"][k]
    sd["state"][k] = {"None": None, "tensor": s["state1"], "list": [s["state1"], s["state2"]], "str": "state",
                      "int": 3}[variant]
    return loc(k), []  # no key to name: the place alone


def c_bnb_nested_bad(sd, data, how):
    """bitsandbytes >= 0.49.2's layout for every state (and its groups, without optim_bits /
    min_8bit_size), one nested tensor bad."""
    for s in sd["state"].values():
        keys = KEYS_8 if "absmax1" in s else KEYS_32
        s[BNB_QUANT] = {key: s.pop(key) for key in keys}
        s["step"] = int(s["step"]) if data.draw(st.booleans()) else s["step"]
    for g in sd["param_groups"]:
        del g["optim_bits"], g["min_8bit_size"]
    k = data.draw(st.sampled_from(EIGHT_BIT) if how == "nan" else st.sampled_from(sorted(WHERE)))
    nested = sd["state"][k][BNB_QUANT]
    name = data.draw(st.sampled_from(KEYS_8[2:] if how == "nan" else sorted(nested)))
    t = nested[name]
    if how == "numel":
        nested[name] = resized(t, data.draw(numel_other_than(t.numel())))
    elif how == "dtype":
        nested[name] = t.to(torch.float64)
    else:
        nested[name] = new_value(t, {data.draw(st.integers(0, t.numel() - 1)): float("nan")})
    return loc(k), [name]


def c_torch_bad(sd, data, variant):
    """torch.optim.AdamW's layout (what convert.to_torch_state_dict writes), one entry bad: the
    conversion to 8-bit codes must not see a tensor it cannot quantize."""
    sd.update(to_torch_state_dict(sd))
    k = any_state(data)
    s = sd["state"][k]
    name = variant.split()[0]
    if variant == "step":
        s[name] = torch.tensor(data.draw(st.sampled_from([-2.0, float("nan")])))
    elif variant.endswith("length"):
        s[name] = resized(s[name], data.draw(numel_other_than(s[name].numel())))
    else:
        s[name] = s[name].to(data.draw(st.sampled_from([torch.int32, torch.complex64])))
    return loc(k), [name]


BAD_GROUP_VALUES = {
    "lr": [-1e-3, float("nan"), math.inf, "0.001", None],
    "betas": [(1.0, 0.999), (0.9, 1.0), (-0.1, 0.99), (0.9,), (0.9, 0.99, 0.999), (float("nan"), 0.99), "0.9"],
    "eps": [-1e-8, float("nan"), math.inf],
    "weight_decay": [-0.1, float("nan"), math.inf],
    "optim_bits": [7, 16, "8", 8.5],
    "min_8bit_size": [-1, 1.5, "100", None]}


def c_group_value(sd, data, key):
    gi = data.draw(st.integers(0, 1))
    sd["param_groups"][gi][key] = data.draw(st.sampled_from(BAD_GROUP_VALUES[key]))
    return f"param_groups[{gi}]", [key]


def c_extra_param(sd, data, variant):
    gi = data.draw(st.integers(0, 1))
    new_id = max(sd["state"]) + 1
    sd["param_groups"][gi]["params"].append(new_id)
    if variant == "with a state":
        sd["state"][new_id] = copy.deepcopy(sd["state"][sd["param_groups"][gi]["params"][0]])
    return STRUCTURAL


def c_missing_param(sd, data, variant):
    sd["param_groups"][data.draw(st.integers(0, 1))]["params"].pop(data.draw(st.integers(0, 1)))
    return STRUCTURAL


def c_missing_group(sd, data, variant):
    del sd["param_groups"][data.draw(st.integers(0, 1))]
    return STRUCTURAL


def c_unknown_id(sd, data, variant):
    sd["state"][data.draw(st.sampled_from([4, 99, -1, "x"]))] = copy.deepcopy(sd["state"][any_state(data)])
    return STRUCTURAL


def c_top_level(sd, data, variant):
    key, how = variant.split(" ", 1)
    if how == "missing":
        del sd[key]
    else:
        sd[key] = data.draw(st.sampled_from([None, "x", 3] + ([[]] if key == "state" else [{}])))
    return STRUCTURAL


CASES = {"state_numel": ["state1", "state2"], "state_shape": ["state1", "state2"], "dtype": list(KEYS_8),
         "mixed": ["state1", "state2"], "absmax": ["short", "empty", "long", "nan", "inf", "negative", "2d"],
         "qmap": ["short", "long", "swapped", "repeated", "nan", "above 1", "below -1"],
         "missing_key": list(KEYS_8), "step": list(BAD_STEPS), "not_a_dict": ["None", "tensor", "list", "str", "int"],
         "bnb_nested_bad": ["numel", "dtype", "nan"],
         "torch_bad": ["exp_avg length", "exp_avg_sq length", "exp_avg dtype", "step"],
         "group_value": list(BAD_GROUP_VALUES), "extra_param": ["no state", "with a state"],
         "missing_param": ["-"], "missing_group": ["-"], "unknown_id": ["-"],
         "top_level": ["state missing", "state wrong type", "param_groups missing", "param_groups wrong type"]}
KINDS = {name[2:]: f for name, f in globals().copy().items() if name.startswith("c_")}
assert KINDS.keys() == CASES.keys()


_TWIN = {}


def twin_after_step():
    """Params and states of an untouched optimizer after the step that the tests take."""
    if not _TWIN:
        params, opt = build(range(2))
        step(opt, params, 7)
        _TWIN["params"] = [p.detach().clone() for p in params]
        _TWIN["states"] = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    return _TWIN["params"], _TWIN["states"]


def snapshot(opt, params):
    states = {id(p): {k: (v, v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                      for k, v in opt.state[p].items()} for p in params if p in opt.state}
    groups = [({k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, list(g["params"]))
              for g in opt.param_groups]
    return len(opt.state), states, groups


def assert_unchanged(opt, params, snap):
    n, states, groups = snap
    assert len(opt.state) == n
    for p in params:
        assert (p in opt.state) == (id(p) in states)
        if id(p) not in states:
            continue
        assert opt.state[p].keys() == states[id(p)].keys()
        for k, (obj, value) in states[id(p)].items():
            now = opt.state[p][k]
            if isinstance(value, torch.Tensor):
                assert now is obj and now.dtype == value.dtype and torch.equal(now, value), k
            else:
                assert now == value, k
    assert len(opt.param_groups) == len(groups)
    for g, (values, ps) in zip(opt.param_groups, groups):
        assert {k: v for k, v in g.items() if k != "params"} == values
        assert len(g["params"]) == len(ps) and all(a is b for a, b in zip(g["params"], ps))


# With CI's 15 examples: 5 per case (68 cases), keeping the file under a minute on two cores.
@pytest.mark.parametrize("kind, variant", [(k, v) for k, vs in CASES.items() for v in vs],
                         ids=[f"{k}-{v}" for k, vs in CASES.items() for v in vs])
@settings(max_examples=max(3, settings.default.max_examples // 3))
@given(data=st.data())
def test_corrupt_checkpoint_is_refused_and_changes_nothing(kind, variant, data):
    sd = source_checkpoint()
    expected = KINDS[kind](sd, data, variant)
    params, opt = build(range(2))
    snap = snapshot(opt, params)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    message = str(info.value)
    if expected is not STRUCTURAL:
        place, keys = expected
        assert place in message, message
        assert not keys or any(f"'{key}'" in message for key in keys), message
    assert_unchanged(opt, params, snap)
    step(opt, params, 7)
    twin_params, twin_states = twin_after_step()
    for p, q, s in zip(params, twin_params, twin_states):
        assert torch.equal(p.detach(), q)
        assert opt.state[p].keys() == s.keys()
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k


def test_the_source_checkpoint_itself_loads():
    """The corruptions start from a checkpoint that loads: each refusal is the corruption's."""
    sd = source_checkpoint()
    params, opt = build(range(2))
    opt.load_state_dict(sd)
    src_params, src = build(range(100, 103))
    for p, q in zip(params, src_params):
        for k, v in src.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    step(opt, params, 7)


def test_checkpoint_with_a_group_too_few_is_refused():
    """A checkpoint of one group (with its states) for an optimizer of two groups: refused, nothing
    changed (zip over the groups would otherwise load the first and silently keep the second)."""
    import pagedopt

    a, b = torch.randn(300, requires_grad=True), torch.randn(500, requires_grad=True)
    opt = pagedopt.AdamW8bit([{"params": [a]}, {"params": [b], "lr": 3e-3}], min_8bit_size=256)
    for p in (a, b):
        p.grad = torch.randn(p.shape)
    opt.step()
    sd = opt.state_dict()
    sd = {"state": {0: sd["state"][0]}, "param_groups": sd["param_groups"][:1]}
    before = {k: v.clone() for k, v in opt.state[a].items()}
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(sd)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 3e-3
    for k, v in before.items():
        assert torch.equal(opt.state[a][k], v), k
