"""The benches' --smoke modes run on CPU in seconds and write valid JSON (and a PNG when
matplotlib is there). Keeps bench/ from rotting between device runs."""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _load_common():
    spec = importlib.util.spec_from_file_location("pagedopt_bench_common", os.path.join(BENCH, "common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_bench_train(name: str):
    """bench/bench_train.py as a module of its own name (it imports common.py from bench/)."""
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, "bench_train.py"))
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH)
    return mod


def _run(args, timeout=600):  # a guard against a hang, not a speed check (CI runs two workers on 2 cores)
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _has_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_param_sets():
    C = _load_common()
    shapes = C.tinyllama_shapes()
    assert len(shapes) == 22 * 9 + 3 == 201
    n = C.numel_of(shapes)
    assert 1.09e9 < n < 1.11e9, n
    assert dict(shapes)["layers.0.k_proj"] == (256, 2048)
    assert dict(shapes)["lm_head"] == (32000, 2048)
    small = C.small_shapes()
    assert len(small) == 2000 and C.numel_of(small) == 2000 * 256 * 256
    tiny = C.tinyllama_shapes(scale=1 / 32, layers=2)
    assert len(tiny) == 2 * 9 + 3 and C.numel_of(tiny) < 1e6
    import torch
    params = C.make_params(tiny[:3], torch.float32, "cpu", seed=0)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 and p.abs().sum() > 0 for p in params)
    assert C.all_finite(params)
    ms = C.time_ms(lambda: params[0].grad.mul_(1.0), "cpu", warmup=1, repeat=3)
    assert len(ms) == 3 and all(t >= 0 for t in ms)


def test_bench_step_smoke(tmp_path):
    out = tmp_path / "step"
    proc = _run([os.path.join("bench", "bench_step.py"), "--smoke", "--out", str(out)])
    doc = json.loads((out / "bench_step.json").read_text())
    for key in ("bench", "env", "config", "bandwidth", "cases", "plan"):
        assert key in doc, key
    assert doc["bench"] == "step"
    for key in ("date", "torch", "device_name", "python"):
        assert doc["env"].get(key), key
    assert _positive(doc["bandwidth"]["copy"]["gbps"])
    cases = {(c["name"], c["set"], c["dtype"], c["mode"]): c for c in doc["cases"]}
    expected = [("pagedopt_adamw8bit", "tinyllama", "fp32"), ("pagedopt_adamw8bit", "tinyllama", "bf16"),
                ("pagedopt_adamw8bit", "small", "fp32"), ("pagedopt_paged_adamw8bit", "tinyllama", "fp32"),
                ("pagedopt_paged_adamw8bit", "tinyllama", "bf16"), ("pagedopt_paged_adamw8bit", "small", "fp32"),
                ("pagedopt_lion8bit", "tinyllama", "fp32"), ("pagedopt_ademamix8bit", "tinyllama", "bf16")]
    for name, set_name, dtype in expected:
        c = cases.get((name, set_name, dtype, "resident"))
        assert c is not None, (name, set_name, dtype)
        assert not c.get("error") and not c.get("skipped"), c
        for key in ("median_ms", "gbps", "frac_copy", "state_bytes", "n_params", "first_step_ms"):
            assert _positive(c.get(key)), (name, key, c.get(key))
        assert c["finite"] is True
        assert c["n"] == doc["config"]["repeat"]
    for set_name, dtype in (("tinyllama", "fp32"), ("tinyllama", "bf16"), ("small", "fp32")):
        c = cases.get(("pagedopt_paged_adamw8bit", set_name, dtype, "after_pageout"))
        assert c is not None and not c.get("error"), c
        assert _positive(c["median_ms"])
    # the byte floor counts each algorithm's moments: Lion 1, AdEMAMix 3 (1 byte each way per 8-bit moment)
    assert cases[("pagedopt_lion8bit", "tinyllama", "fp32", "resident")]["floor_bytes_per_param"] == 12 + 2
    assert cases[("pagedopt_ademamix8bit", "tinyllama", "bf16", "resident")]["floor_bytes_per_param"] == 6 + 6
    # the 8-bit states are about 2 bytes per parameter, far under fp32 AdamW's 8
    c = cases[("pagedopt_adamw8bit", "tinyllama", "fp32", "resident")]
    assert c["state_bytes"] < 4 * c["n_params"]
    if _has_matplotlib():
        assert (out / "bench_step.png").stat().st_size > 1000
    assert "optimizer" in proc.stdout  # the closing table


@pytest.mark.parametrize("isolate, children, order", [
    # the plan's order; a child per case: the three and the two graph rows the prefixes select
    ("case", 5, ["pagedopt_adamw8bit", "torch_adamw_fused", "pagedopt_lion8bit"]),
    ("library", 2, ["pagedopt_adamw8bit", "pagedopt_lion8bit", "torch_adamw_fused"])])  # a library's rows together
def test_bench_step_isolated_cases(tmp_path, isolate, children, order):
    """--isolate (library by default on CUDA): the rows run in child processes of this script, one
    per case or one per library and (set, dtype), and the parent records what the children
    measured, with the copy bandwidth of its own probe."""
    out = tmp_path / "iso"
    rows = "pagedopt_adamw8bit,pagedopt_lion8bit,torch_adamw_fused"
    proc = _run([os.path.join("bench", "bench_step.py"), "--smoke", "--no-plot", "--isolate", isolate, "--sets",
                 "tinyllama", "--dtypes", "fp32", "--only", rows, "--out", str(out)])
    doc = json.loads((out / "bench_step.json").read_text())
    assert doc["isolated"] == isolate
    graph_rows = [c for c in doc["cases"] if c["name"].endswith("_graph")]  # the prefixes select them too
    assert sorted(c["name"] for c in graph_rows) == ["pagedopt_adamw8bit_graph", "torch_adamw_fused_graph"]
    assert all(c["skipped"] == "a CUDA graph needs CUDA" for c in graph_rows)  # on the CPU
    cases = [c for c in doc["cases"] if c not in graph_rows]
    assert [c["name"] for c in cases] == order
    copy = doc["bandwidth"]["copy"]["gbps"]
    for c in cases:
        assert not c.get("error") and _positive(c["median_ms"]) and c["finite"] is True, c
        assert math.isclose(c["frac_copy"], c["gbps"] / copy, rel_tol=1e-9), c  # the parent's probe
    progress = [line for line in proc.stdout.splitlines() if line.startswith("  pagedopt_lion8bit ")]
    assert len(progress) == 1, proc.stdout  # the case's progress line, printed once (by its child)
    assert proc.stdout.count("bench_step on ") == 1  # children print no header
    assert doc["children"] == children


def test_bench_quant_smoke(tmp_path):
    out = tmp_path / "quant"
    _run([os.path.join("bench", "bench_quant.py"), "--smoke", "--out", str(out)])
    doc = json.loads((out / "bench_quant.json").read_text())
    for key in ("bench", "env", "config", "bandwidth", "cases", "checks"):
        assert key in doc, key
    assert doc["bench"] == "quant"
    cases = {(c["name"], c["dtype"]): c for c in doc["cases"]}
    for name in ("pagedopt_quantize", "pagedopt_dequantize", "torch_absmax", "torch_quantize_eager"):
        for dtype in ("fp32", "bf16"):
            c = cases.get((name, dtype))
            assert c is not None and not c.get("error"), (name, dtype, c)
            assert _positive(c["median_ms"]) and _positive(c["gbps"]) and _positive(c["floor_bytes"])
    for dtype in ("fp32", "bf16"):
        chk = doc["checks"][dtype]
        assert chk.get("pagedopt_codes_mismatch_vs_reference", 1.0) < 0.01, chk
        assert chk.get("pagedopt_absmax_equal_reference") is True, chk
    if _has_matplotlib():
        assert (out / "bench_quant.png").stat().st_size > 1000


def test_merge_and_summary(tmp_path):
    # merge two bench JSONs the way scripts/device_check.sh does, then print the summary
    C = _load_common()
    step = {"bench": "step", "env": {"device_name": "cpu"}, "bandwidth": {"copy": {"gbps": 1.0}},
            "cases": [{"name": "x", "set": "s", "dtype": "fp32", "mode": "resident", "median_ms": 1.0,
                       "gbps": 2.0, "frac_copy": 0.5, "state_bytes": 1 << 20}]}
    quant = {"bench": "quant", "cases": [{"name": "q", "dtype": "fp32", "median_ms": 1.0, "gbps": 3.0}]}
    C.write_json(str(tmp_path / "bench_step.json"), step)
    C.write_json(str(tmp_path / "bench_quant.json"), quant)
    merged = str(tmp_path / "results.json")
    _run([os.path.join("bench", "common.py"), "merge", merged, str(tmp_path / "bench_step.json"),
          str(tmp_path / "bench_quant.json"), "paging=" + str(tmp_path / "missing.json")])
    doc = json.loads(open(merged).read())
    assert set(doc) == {"step", "quant", "paging"} and "missing" in doc["paging"]
    proc = _run([os.path.join("bench", "common.py"), "summary", merged])
    assert "optimizer" in proc.stdout and "op" in proc.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_bench_train_smoke(tmp_path):
    """bench_train.py --smoke: every smoke mode trains the tiny model in its own process and
    records finite losses and a step time; the modes see the same model and tokens."""
    _run([os.path.join(BENCH, "bench_train.py"), "--smoke", "--out", str(tmp_path)])
    with open(tmp_path / "train.json") as f:
        doc = json.load(f)
    recs = {r["mode"]: r for r in doc["records"]}
    assert set(recs) == {"torch_adamw_fused", "pagedopt_adamw8bit", "pagedopt_paged_adamw8bit_pageout",
                         "pagedopt_paged_adamw8bit_host", "pagedopt_paged_adamw8bit_host_bwd"}
    for r in recs.values():
        assert "skipped" not in r, r
        assert _positive(r["step_ms"]) and len(r["step_ms_all"]) == 2
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["params"] == doc["params"]  # the closed-form count matches the model's parameters
    # the same seed gives every mode the same model and tokens: the loss before any update agrees
    assert len({r["losses"][0] for r in recs.values()}) == 1
    # and the updates move it
    assert recs["pagedopt_adamw8bit"]["losses"][2] != recs["pagedopt_adamw8bit"]["losses"][0]
    # page_out() after every step never changes the math: the paged mode's losses are the resident 8-bit ones
    assert recs["pagedopt_paged_adamw8bit_pageout"]["losses"] == recs["pagedopt_adamw8bit"]["losses"]
    # nor does streaming host-resident states through the device buffer
    assert recs["pagedopt_paged_adamw8bit_host"]["losses"] == recs["pagedopt_adamw8bit"]["losses"]
    # nor updating them during backward (its second and third steps do), also in the back-to-back loop
    for key in ("losses", "loop_losses"):
        assert recs["pagedopt_paged_adamw8bit_host_bwd"][key] == recs["pagedopt_adamw8bit"][key]
    assert all(_positive(r["loop_step_ms"]) and len(r["loop_losses"]) == 2 for r in recs.values())
    # every mode keeps states; the 8-bit ones are the same bytes wherever they live; no CUDA, no
    # link measurement and no copy times
    assert all(_positive(r["state_bytes"]) for r in recs.values())
    assert recs["pagedopt_paged_adamw8bit_host_bwd"]["state_bytes"] == recs["pagedopt_adamw8bit"]["state_bytes"]
    assert doc["link"] is None and all(r["transfer_ms"] is None for r in recs.values())
    if _has_matplotlib():
        assert (tmp_path / "train.png").stat().st_size > 0


def test_bench_train_mode_variants():
    """bench_train's ``@cNpM`` mode names: the tuning of updates during backward, set in the mode's
    own process before its optimizer is made; anything else is an unknown mode."""
    bt = _load_bench_train("pagedopt_bench_train")
    from pagedopt.optim.backward_updates import BackwardUpdates

    by_name = {m.name: m for m in bt.MODES}
    base = "pagedopt_paged_adamw8bit_host_bwd"
    assert bt.resolve_mode(base, by_name) is by_name[base]
    for bad in (base + "@", base + "@x3", base + "@c0", base + "@c3q", base + "@wc3", base + "@ww",
                "pagedopt_adamw8bit@c4", "nope@c4", "nope"):
        assert bt.resolve_mode(bad, by_name) is None, bad
    knobs = ("chunks_per_buffer", "stream_priority", "update_thread")
    saved = tuple(getattr(BackwardUpdates, k) for k in knobs)
    try:
        for name, want in ((base + "@c6p0", (6, 0, saved[2])), (base + "@p1", (saved[0], 1, saved[2])),
                           (base + "@c3", (3, saved[1], saved[2])), (base + "@w", (saved[0], saved[1], True)),
                           (base + "@c2p-1w", (2, -1, True))):
            for k, v in zip(knobs, saved):  # as in a fresh process
                setattr(BackwardUpdates, k, v)
            mode = bt.resolve_mode(name, by_name)
            assert mode.name == name
            opt = mode.make([torch.nn.Parameter(torch.randn(64))], torch.device("cpu"))
            assert opt.update_in_backward
            assert tuple(getattr(BackwardUpdates, k) for k in knobs) == want, name
    finally:
        for k, v in zip(knobs, saved):
            setattr(BackwardUpdates, k, v)
    with pytest.raises(SystemExit):  # argparse's error, naming the variant grammar
        bt.main(["--smoke", "--modes", base + "@c0"])
    # the link summary's floor: the states' bytes at the slower of the rates measured both ways at once
    link = {"before": {"h2d_gbps": 50.0, "d2h_gbps": 52.0, "both_gbps_each_way": 40.0},
            "after": {"h2d_gbps": 49.0, "d2h_gbps": 51.0, "both_gbps_each_way": 20.0}}
    text = bt.link_summary(link, [{"mode": "pagedopt_adamw8bit", "state_bytes": 10 ** 9},
                                  {"mode": base, "state_bytes": 2 * 10 ** 9}])
    assert "2.00 GB each way" in text and "100.0 ms" in text and "both at once 40.0 GB/s" in text


def test_bench_train_records_peers_shapes():
    """run_mode records optimizers shaped like the peers': one that says it is paged but has no
    paging_stats (bitsandbytes' Paged*), one without a ``state`` (torchao's CPUOffloadOptimizer)."""
    bt = _load_bench_train("pagedopt_bench_train2")

    class PagedWithoutStats(torch.optim.SGD):
        is_paged = True

    class Wrapper:  # steps an inner optimizer, keeps no .state of its own
        def __init__(self, params):
            self.inner = torch.optim.SGD(params, lr=1e-3)

        def step(self):
            self.inner.step()

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none=set_to_none)

    cpu = torch.device("cpu")
    for make, has_states in ((lambda ps, d: PagedWithoutStats(ps, lr=1e-3, momentum=0.9), True),
                             (lambda ps, d: Wrapper(ps), False)):
        rec = bt.run_mode(bt.Mode("peer", make), bt.TINY, cpu, warmup=1, steps=2)
        assert _positive(rec["step_ms"]) and rec["transfer_ms"] is None
        assert (rec["state_bytes"] is not None and rec["state_bytes"] > 0) if has_states else rec["state_bytes"] is None


def test_plot_copy_timeline_reads_the_profile_table(tmp_path):
    """scripts/plot_copy_timeline.py: the rows and marks of profile_train_step's copy table (a
    chunk whose copies are not in the trace keeps None), and a PNG of them."""
    spec = importlib.util.spec_from_file_location("pagedopt_plot_timeline",
                                                  os.path.join(ROOT, "scripts", "plot_copy_timeline.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = """== x, no profiler (median of 3, ms from the step's start): forward 16.1, backward 53.5, step 55.5; transfers 1
   chunk   in start   in end   grads   upd start  upd end  back start  back end
       0     -4.11     -2.87     18.32     18.33     18.54     18.54     19.91
       1     19.91     21.14         -         -         -     22.90     24.14
   copies in: -4.11 to 21.14 ms, busy 2.47 ms (10%)
"""
    marks, rows = mod.parse(text)
    assert marks == {"forward": 16.1, "backward": 53.5, "step": 55.5}
    assert rows == [(0, [-4.11, -2.87, 18.32, 18.33, 18.54, 18.54, 19.91]),
                    (1, [19.91, 21.14, None, None, None, 22.90, 24.14])]
    src = tmp_path / "profile.txt"
    src.write_text(text)
    if _has_matplotlib():
        assert mod.main([str(src), str(tmp_path / "t.png")]) == 0 and (tmp_path / "t.png").stat().st_size > 0
    src.write_text("nothing here\n")
    assert mod.main([str(src), str(tmp_path / "u.png")]) == 1


def test_bench_train_rounds(tmp_path):
    """--rounds N: every mode runs N times, interleaved, each run its own process; its record holds
    the median over rounds of the step and loop times, every round's pair and the largest memory peak."""
    bt = _load_bench_train("pagedopt_bench_train3")
    recs = [{"mode": "m", "step_ms": s, "loop_step_ms": l, "device_used_peak": d, "note": "n"}
            for s, l, d in ((5.0, 9.0, 3), (1.0, 2.0, 7), (6.0, 4.0, 5))] + [{"mode": "m", "skipped": "boom"}]
    merged = bt.merge_rounds(recs)
    # medians 5 and 4, where the means are 4 and 5: one slow round must not move the figure
    assert merged["step_ms"] == 5.0 and merged["loop_step_ms"] == 4.0 and merged["device_used_peak"] == 7
    assert [r["step_ms"] for r in merged["rounds"]] == [5.0, 1.0, 6.0] and merged["skipped_rounds"] == ["boom"]
    assert bt.loop_range(merged) == "2.0-9.0" and bt.loop_range(recs[0]) is None
    assert bt.merge_rounds([{"mode": "m", "skipped": "x"}]) == {"mode": "m", "skipped": "x"}
    with pytest.raises(SystemExit):
        bt.main(["--smoke", "--modes", "pagedopt_adamw8bit", "--rounds", "0", "--out", str(tmp_path)])
    _run([os.path.join(BENCH, "bench_train.py"), "--smoke", "--modes", "pagedopt_adamw8bit,torch_adamw_fused",
          "--rounds", "2", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "train.json").read_text())
    assert [r["mode"] for r in doc["records"]] == ["pagedopt_adamw8bit", "torch_adamw_fused"]
    for r in doc["records"]:
        assert len(r["rounds"]) == 2 and all(_positive(x["step_ms"]) for x in r["rounds"])
        assert r["step_ms"] == statistics.median(x["step_ms"] for x in r["rounds"])
    assert sorted(p.name for p in tmp_path.glob("mode_*_r*.json")) == [
        "mode_pagedopt_adamw8bit_r1.json", "mode_pagedopt_adamw8bit_r2.json",
        "mode_torch_adamw_fused_r1.json", "mode_torch_adamw_fused_r2.json"]


def test_probe_first_step_memory_smoke(tmp_path):
    """scripts/probe_first_step_memory.py --smoke: each mode trains its three steps in a process of
    its own (losses only on the CPU) and the JSON says so."""
    out = tmp_path / "probe.json"
    _run([os.path.join(ROOT, "scripts", "probe_first_step_memory.py"), "--smoke",
          "--modes", "host,host_bwd,resident_bwd", "--out", str(out)])
    recs = json.loads(out.read_text())
    assert [r["mode"] for r in recs] == ["host", "host_bwd", "resident_bwd"]
    for r in recs:
        assert "error" not in r, r
        losses = [s["loss"] for s in r["steps"]]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]  # three steps of training on one batch lower its loss


def test_probe_host_time_smoke():
    """scripts/probe_host_time.py on the CPU with a few small tensors: it reports the host time."""
    p = _run([os.path.join(ROOT, "scripts", "probe_host_time.py"), "--n", "20", "--side", "16",
              "--steps", "3"])
    assert "host ms median" in p.stdout
