"""Exact resume from a checkpoint, for every public optimizer class and parameter dtype.

k uninterrupted steps must equal j steps, ``torch.save(opt.state_dict())``, then, in a new
Python process, a fresh optimizer on the saved parameters, ``load_state_dict(torch.load(...,
weights_only=True))`` and k - j more steps with the same gradients: parameters and every
state tensor bit for bit (``torch.equal``), step counts equal. One child process handles all
cases of a device (the cases are prepared and checked here, per test, from its results).

Also: the state_dict survives torch.save/torch.load(weights_only=True) unchanged, its state
tensors share no storage across dtypes, and ``copy.deepcopy`` / pickle give an optimizer that
is independent of the original and steps exactly like it (as torch.optim.AdamW's copies do).
"""
import copy
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

import pagedopt

# paged classes off CUDA work unpaged and say so once per device; that is not under test here
pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

# name -> (class, extra constructor arguments); every public class, and optim_bits=8 for the
# classes whose width is an argument.
VARIANTS = {
    "Adam": (pagedopt.Adam, {}),
    "Adam-bits8": (pagedopt.Adam, {"optim_bits": 8}),
    "Adam8bit": (pagedopt.Adam8bit, {}),
    "Adam32bit": (pagedopt.Adam32bit, {}),
    "AdamW": (pagedopt.AdamW, {}),
    "AdamW-bits8": (pagedopt.AdamW, {"optim_bits": 8}),
    "AdamW8bit": (pagedopt.AdamW8bit, {}),
    "AdamW32bit": (pagedopt.AdamW32bit, {}),
    "PagedAdam": (pagedopt.PagedAdam, {}),
    "PagedAdam-bits8": (pagedopt.PagedAdam, {"optim_bits": 8}),
    "PagedAdam8bit": (pagedopt.PagedAdam8bit, {}),
    "PagedAdam32bit": (pagedopt.PagedAdam32bit, {}),
    "PagedAdamW": (pagedopt.PagedAdamW, {}),
    "PagedAdamW-bits8": (pagedopt.PagedAdamW, {"optim_bits": 8}),
    "PagedAdamW8bit": (pagedopt.PagedAdamW8bit, {}),
    "PagedAdamW32bit": (pagedopt.PagedAdamW32bit, {}),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MIN_8BIT = 256  # small, so that 8-bit states occur on small tensors
# A small model: two weight matrices, an embedding and a vector of 300 (>= MIN_8BIT elements:
# 8-bit states for the 8-bit variants; 300 ends in a partial 256-block), a bias and a gain below
# MIN_8BIT (32-bit states in the same optimizer).
SHAPES = [(24, 32), (300,), (32,), (40, 16), (7,)]
GROUPS = [dict(idx=[0, 1, 3], weight_decay=0.1), dict(idx=[2, 4], weight_decay=0.0, lr=3e-3)]
OPT_KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, min_8bit_size=MIN_8BIT)
K, J = 6, 3  # k steps in all, checkpoint after j


def grad_is_none(pi: int, s: int) -> bool:
    """Some parameters miss gradients at some steps: the embedding (3) at the first step and at
    the first step after the resume; the gain (4) until the resume, so that it has no state in
    the checkpoint and gets its first state in the resumed optimizer."""
    return (pi == 3 and s in (0, J)) or (pi == 4 and s < J)


def make_params(seed: int, dtype: torch.dtype, device) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device).requires_grad_(True) for s in SHAPES]


def set_grads(params: list, seed: int, s: int) -> None:
    """Deterministic, non-zero random gradients for step s (drawn on the CPU, so that every
    process and device sees the same values), heavy-tailed as real gradients are."""
    g = torch.Generator().manual_seed(seed * 1000 + s)
    for pi, p in enumerate(params):
        x = torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))
        p.grad = None if grad_is_none(pi, s) else x.to(p.dtype).to(p.device)


def make_opt(variant: str, params: list):
    cls, extra = VARIANTS[variant]
    groups = [{"params": [params[i] for i in gr["idx"]], **{k: v for k, v in gr.items() if k != "idx"}}
              for gr in GROUPS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged classes off CUDA warn that they work unpaged
        return cls(groups, **OPT_KW, **extra)


def run_steps(opt, params, seed, steps) -> None:
    for s in steps:
        set_grads(params, seed, s)
        opt.step()


def snapshot(opt, params) -> dict:
    """Parameters and per-parameter states (by parameter index), as independent CPU copies."""
    return {"params": [p.detach().cpu().clone() for p in params],
            "state": {i: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                          for k, v in opt.state[p].items()} for i, p in enumerate(params) if p in opt.state},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def case_seed(variant: str, dtype_name: str) -> int:
    return list(VARIANTS).index(variant) * 10 + list(DTYPES).index(dtype_name) + 1


def is_paged_state(opt, t) -> bool:
    return (opt._pager is not None and opt._pager.is_paged(t)) or pagedopt.paging.is_managed(t)


# ------------------------------------------------------------------ the child process
def _child(workdir: str) -> None:
    """Runs in a new process: for each task, a fresh optimizer on the saved parameters loads the
    checkpoint and takes the remaining steps; records the outcome (or the error) per task."""
    tasks = torch.load(os.path.join(workdir, "tasks.pt"), weights_only=True)
    results = {}
    for t in tasks:
        try:
            device = t["load_device"]
            saved = torch.load(os.path.join(workdir, t["name"] + ".params.pt"), weights_only=True,
                               map_location=device)
            params = [x.requires_grad_(True) for x in saved]
            opt = make_opt(t["variant"], params)
            path = os.path.join(workdir, t["name"] + ".opt.pt")
            if t["map_location"]:
                sd = torch.load(path, weights_only=True, map_location=t["map_location"])
            else:
                sd = torch.load(path, weights_only=True)
            opt.load_state_dict(sd)
            loaded = snapshot(opt, params)
            devices = {f"{i}.{k}": str(v.device) for i, s in enumerate(params) if s in opt.state
                       for k, v in opt.state[s].items() if isinstance(v, torch.Tensor)}
            paged = None
            if t["check_paged"]:
                paged = {f"{i}.{k}": is_paged_state(opt, v) for i, s in enumerate(params) if s in opt.state
                         for k, v in opt.state[s].items() if k in ("state1", "state2", "absmax1", "absmax2")}
            run_steps(opt, params, t["seed"], range(J, K))
            results[t["name"]] = {"ok": True, "loaded": loaded, "final": snapshot(opt, params),
                                  "devices": devices, "paged": paged}
        except Exception as e:  # recorded per task, so that one failure does not hide the others
            results[t["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    torch.save(results, os.path.join(workdir, "results.pt"))


# ------------------------------------------------------------------ the parent side
def _prepare_and_run(save_device: str, pairs) -> dict:
    """pairs: (variant, dtype name, load device, map_location). For each, the uninterrupted run
    and the checkpoint after J steps are made here, on save_device; the child resumes them all."""
    workdir = tempfile.mkdtemp(prefix="pagedopt_resume_")
    tasks, cases = [], {}
    for variant, dn, load_device, map_location in pairs:
        name = f"{variant}.{dn}.{save_device}-to-{load_device}"
        seed = case_seed(variant, dn)
        case = {"variant": variant, "dtype": dn}
        try:
            full_params = make_params(seed, DTYPES[dn], save_device)
            full = make_opt(variant, full_params)
            run_steps(full, full_params, seed, range(K))
            case["expected"] = snapshot(full, full_params)
            params = make_params(seed, DTYPES[dn], save_device)
            opt = make_opt(variant, params)
            run_steps(opt, params, seed, range(J))
            case["saved"] = snapshot(opt, params)
            torch.save([p.detach() for p in params], os.path.join(workdir, name + ".params.pt"))
            torch.save(opt.state_dict(), os.path.join(workdir, name + ".opt.pt"))
        except Exception as e:
            case["error"] = f"while saving: {type(e).__name__}: {e}"
            cases[name] = case
            continue
        cases[name] = case
        tasks.append({"name": name, "variant": variant, "seed": seed, "load_device": load_device,
                      "map_location": map_location,
                      "check_paged": load_device == "cuda" and variant.startswith("Paged")})
    torch.save(tasks, os.path.join(workdir, "tasks.pt"))
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_resume; test_resume._child({workdir!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results = torch.load(os.path.join(workdir, "results.pt"), weights_only=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, r in results.items():
        cases[name]["result"] = r
    return cases


def assert_same(a: dict, b: dict, what: str) -> None:
    """Parameters, states (every tensor: dtype, shape, values bit for bit) and step counts."""
    assert len(a["params"]) == len(b["params"])
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: param {i} differs"
    assert sorted(a["state"]) == sorted(b["state"]), f"{what}: params with state differ"
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sorted(sa) == sorted(sb), f"{what}: state keys of param {i}: {sorted(sa)} vs {sorted(sb)}"
        for k in sa:
            x, y = sa[k], sb[k]
            if k == "step":
                assert float(x) == float(y), f"{what}: step of param {i}: {float(x)} vs {float(y)}"
            else:
                assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {k} of param {i}: {x.dtype} vs {y.dtype}"
                assert torch.equal(x, y), f"{what}: {k} of param {i} differs"
    for ga, gb in zip(a["groups"], b["groups"]):
        assert ga == gb, f"{what}: param group hyperparameters differ"


def check_case(case: dict) -> dict:
    assert "error" not in case, case["error"]
    r = case["result"]
    assert r["ok"], f"in the new process: {r['error']}"
    # the loaded state is the saved one, before any step
    assert_same(case["saved"], r["loaded"], "loaded vs saved")
    return r


CPU_PAIRS = [(v, d, "cpu", None) for v in VARIANTS for d in DTYPES]


@pytest.fixture(scope="module")
def cpu_cases():
    return _prepare_and_run("cpu", CPU_PAIRS)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_in_new_process_is_exact_cpu(cpu_cases, variant, dtype_name):
    case = cpu_cases[f"{variant}.{dtype_name}.cpu-to-cpu"]
    r = check_case(case)
    exp = case["expected"]
    assert_same(exp, r["final"], "resumed vs uninterrupted")
    # the case is meaningful: 8-bit and 32-bit states both occurred where the class has 8-bit ones
    widths = {s["state1"].dtype for s in exp["state"].values()}
    eight = VARIANTS[variant][1].get("optim_bits") == 8 or "8bit" in variant
    assert widths == ({torch.uint8, torch.float32} if eight else {torch.float32})
    assert sorted(exp["state"]) == list(range(len(SHAPES)))


# ------------------------------------------------------------------ CUDA
# Cross-device cases: saved on one device, resumed on the other; the remaining K - J steps then
# run on the other backend, whose arithmetic differs (test_cuda_kernels.py / test_optim_cuda.py).
CROSS_VARIANTS = list(VARIANTS)


@pytest.fixture(scope="module")
def cuda_cases():
    cases = _prepare_and_run("cuda", [(v, d, "cuda", None) for v in VARIANTS for d in DTYPES]
                             + [(v, d, "cpu", "cpu") for v in CROSS_VARIANTS for d in DTYPES])
    cases.update(_prepare_and_run("cpu", [(v, d, "cuda", None) for v in CROSS_VARIANTS for d in DTYPES]))
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_in_new_process_is_exact_cuda(cuda_cases, variant, dtype_name):
    case = cuda_cases[f"{variant}.{dtype_name}.cuda-to-cuda"]
    r = check_case(case)
    assert_same(case["expected"], r["final"], "resumed vs uninterrupted")
    assert all(d.startswith("cuda") for d in r["devices"].values()), r["devices"]
    if variant.startswith("Paged") and pagedopt.paging.paging_available("cuda"):
        not_paged = [k for k, v in r["paged"].items() if not v]
        assert r["paged"] and not not_paged, f"restored states not paged: {not_paged}"


def max_abs_grads(seed: int, dtype: torch.dtype, steps) -> list:
    """Per parameter, the elementwise max |g| over the given steps (as set_grads draws them)."""
    params = make_params(seed, dtype, "cpu")
    out = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for s in steps:
        set_grads(params, seed, s)
        for o, p in zip(out, params):
            if p.grad is not None:
                torch.maximum(o, p.grad.double().abs(), out=o)
    return out


def assert_close_across_backends(exp: dict, got: dict, variant: str, dtype: torch.dtype, seed: int) -> None:
    """The K - J steps after the resume ran on the other backend. Bounds of test_optim_cuda.py
    (derived there for 4 steps on different backends from the same state; here K - J = 3):
    8-bit moments are computed bit for bit alike by both backends when the decay is decoupled (the
    moments never see the parameter); with L2 decay the parameter's one-ulp differences enter the
    gradient. Parameters: one ulp of their dtype + 2^-19 of the update per step; 32-bit states'
    parameters as stated there (a few fp32 ulps per step; a half parameter's one-ulp flip).

    32-bit moments (torch's fused kernels, which round differently): per step each backend rounds
    m = beta1 m + (1 - beta1) g in at most 3 operations, each within u = 2^-24 of
    beta1 |m_prev| + (1 - beta1) |g| <= |m_s| + G (G: the max |g| of the steps), so both within
    8u (|m_s| + G), and |m_s| <= (|m| + G) / beta1^n over the n = K - J steps (v: likewise,
    beta2 > beta1); with L2 decay the
    parameters' difference dp (their bound) enters g as wd dp. Likewise v with g^2 and
    (1 - beta2) wd dp (2 G + wd dp)."""
    ulp = 2.0 ** -{torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    decoupled = VARIANTS[variant][0].decoupled
    n = K - J
    beta1, beta2 = OPT_KW["betas"]
    wd = 0.0 if decoupled else max(g["weight_decay"] for g in GROUPS)
    u = 2.0 ** -24
    grads = max_abs_grads(seed, dtype, range(J, K))
    assert sorted(exp["state"]) == sorted(got["state"])
    for i, (a, b) in enumerate(zip(exp["params"], got["params"])):
        sa, sb = exp["state"][i], got["state"][i]
        assert sorted(sa) == sorted(sb)
        assert float(sa["step"]) == float(sb["step"])
        if sa["state1"].dtype == torch.uint8:
            torch.testing.assert_close(b.double(), a.double(), rtol=8 * ulp, atol=1e-6)
            if decoupled:
                for k in ("state1", "state2", "absmax1", "absmax2"):
                    assert torch.equal(sa[k], sb[k]), k
            else:
                for k in ("absmax1", "absmax2"):
                    torch.testing.assert_close(sb[k], sa[k], rtol=4 * ulp, atol=0)
                for k in ("state1", "state2"):
                    diff = (sb[k].int() - sa[k].int()).abs()
                    assert diff.max() <= 1 and (diff != 0).float().mean() <= 0.02, k
        else:
            if dtype == torch.float32:
                p_tol = dict(rtol=1e-5, atol=1e-6)
            else:
                p_tol = dict(rtol=1e-2, atol=1e-3)
            torch.testing.assert_close(b, a, **p_tol)
            G = grads[i]
            dp = p_tol["atol"] + p_tol["rtol"] * torch.maximum(a.double().abs(), b.double().abs())
            for k, x, (c, lin) in (("state1", G, (1 - beta1, torch.ones_like(G))), ("state2", G * G, (1 - beta2, 2 * G))):
                mag = torch.maximum(sa[k].double().abs(), sb[k].double().abs())
                tol = n * (8 * u * ((mag + x) / beta1**n + x) + c * wd * dp * (lin + wd * dp * (k == "state2")))
                err = (sa[k].double() - sb[k].double()).abs()
                assert (err <= tol).all(), f"param {i}: {k}: {(err - tol).max().item()}"


@pytest.mark.cuda
@pytest.mark.parametrize("direction", ["cuda-to-cpu", "cpu-to-cuda"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", CROSS_VARIANTS)
def test_resume_across_devices(cuda_cases, variant, dtype_name, direction):
    """Saved on CUDA and loaded with map_location='cpu' into a CPU optimizer, or saved on the CPU
    and loaded into a CUDA optimizer: the restored state is the saved one, bit for bit, on the
    new device, and the remaining steps agree with the uninterrupted run within the bounds
    between the backends."""
    case = cuda_cases[f"{variant}.{dtype_name}.{direction}"]
    r = check_case(case)
    target = direction.split("-to-")[1]
    assert all(d.split(":")[0] == target for d in r["devices"].values()), r["devices"]
    assert_close_across_backends(case["expected"], r["final"], variant, DTYPES[dtype_name],
                                 case_seed(variant, dtype_name))
    if target == "cuda" and variant.startswith("Paged") and pagedopt.paging.paging_available("cuda"):
        not_paged = [k for k, v in r["paged"].items() if not v]
        assert r["paged"] and not not_paged, f"restored states not paged: {not_paged}"


# ------------------------------------------------------------------ serialization, copies
def stepped(variant: str, dtype: torch.dtype, device: str, steps=range(2)):
    seed = case_seed(variant, {v: k for k, v in DTYPES.items()}[dtype])
    params = make_params(seed, dtype, device)
    opt = make_opt(variant, params)
    run_steps(opt, params, seed, steps)
    return opt, params, seed


def storage_span(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def check_state_dict_round_trip(variant: str, device: str) -> None:
    for dtype in DTYPES.values():
        opt, params, _ = stepped(variant, dtype, device, range(J))
        sd = opt.state_dict()
        tensors = [(f"{pid}.{k}", v) for pid, s in sd["state"].items() for k, v in s.items()
                   if isinstance(v, torch.Tensor)]
        # torch.save refuses (or silently mis-saves) storages viewed with two dtypes; and a
        # storage shared across dtypes means a checkpoint carries one tensor's bytes as another's
        for i, (na, a) in enumerate(tensors):
            for nb, b in tensors[i + 1:]:
                if a.dtype != b.dtype and a.device == b.device:
                    (a0, a1), (b0, b1) = storage_span(a), storage_span(b)
                    assert a1 <= b0 or b1 <= a0, f"{dtype}: {na} ({a.dtype}) and {nb} ({b.dtype}) share a storage"
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert loaded["param_groups"] == sd["param_groups"]
        assert sorted(loaded["state"]) == sorted(sd["state"]) and len(sd["state"]) == len(SHAPES) - 1
        for pid, s in sd["state"].items():
            assert sorted(loaded["state"][pid]) == sorted(s)
            for k, v in s.items():
                w = loaded["state"][pid][k]
                if isinstance(v, torch.Tensor):
                    assert w.dtype == v.dtype and w.device == v.device and torch.equal(w, v), f"{dtype}: {pid}.{k}"
                else:
                    assert w == v


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_survives_save_and_weights_only_load_cpu(variant):
    check_state_dict_round_trip(variant, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_survives_save_and_weights_only_load_cuda(variant):
    check_state_dict_round_trip(variant, "cuda")


def check_checkpoint_size(variant: str, device: str) -> None:
    """A checkpoint holds the states' bytes, not more: torch.save writes whole storages, so a
    state tensor that views a larger storage (a shared slab) would carry the slab into every
    checkpoint. Each storage's bytes are at most those of the state tensors viewing it."""
    opt, _, _ = stepped(variant, torch.float32, device, range(J))
    by_storage = {}
    for s in opt.state_dict()["state"].values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                by_storage.setdefault(storage_span(v), {})[(v.data_ptr(), v.numel(), v.dtype)] = v
    for (start, end), views in by_storage.items():
        used = sum(v.numel() * v.element_size() for v in views.values())
        assert end - start <= used, f"a storage of {end - start} bytes holds state tensors of {used} bytes"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_carries_no_extra_bytes_cpu(variant):
    check_checkpoint_size(variant, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_carries_no_extra_bytes_cuda(variant):
    check_checkpoint_size(variant, "cuda")


def _copy_steps_like_original(make, copier) -> None:
    """copier(opt) is an optimizer over copies of the parameters with copies of the states:
    stepping it leaves the original alone, and the original stepped alike then equals it."""
    opt, params, seed = make()
    before = snapshot(opt, params)
    twin = copier(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    order = [p for g in opt.param_groups for p in g["params"]]
    # twin_params[i] copies order[i]; re-index to the original's parameter list
    twin_by_index = [twin_params[next(j for j, q in enumerate(order) if q is p)] for p in params]
    assert all(q is not p for p, q in zip(params, twin_by_index))
    assert_same(before, snapshot(twin, twin_by_index), "copy vs original")
    run_steps(twin, twin_by_index, seed, range(J, K))
    assert_same(before, snapshot(opt, params), "original after stepping the copy")
    run_steps(opt, params, seed, range(J, K))
    assert_same(snapshot(opt, params), snapshot(twin, twin_by_index), "copy vs original, stepped alike")


COPIERS = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}


@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_copies_step_like_the_original(variant, how):
    for dtype in DTYPES.values():
        _copy_steps_like_original(lambda: stepped(variant, dtype, "cpu", range(J)), COPIERS[how])


@pytest.mark.parametrize("how", list(COPIERS))
def test_copy_check_holds_for_torch_adamw(how):
    """The same check passes for torch.optim.AdamW (the behaviour the copies are held to)."""
    def make():
        params = make_params(1, torch.float32, "cpu")
        opt = torch.optim.AdamW([{"params": [params[i] for i in gr["idx"]],
                                  **{k: v for k, v in gr.items() if k != "idx"}} for gr in GROUPS],
                                lr=OPT_KW["lr"], betas=OPT_KW["betas"])
        run_steps(opt, params, 1, range(J))
        return opt, params, 1
    _copy_steps_like_original(make, COPIERS[how])
