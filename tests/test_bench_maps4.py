"""bench/bench_maps4.py (the measurement behind the 4-bit maps and block size, bench/RESULTS.md)
runs on CPU in its --smoke mode and writes its figures; its candidate maps are valid 4-bit maps."""
import importlib.util
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
    spec = importlib.util.spec_from_file_location("bench_maps4", os.path.join(ROOT, "bench", "bench_maps4.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_writes_finite_figures(tmp_path):
    bench = load()
    results = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "maps4.json").read_text())
    assert saved["walk_one_shot"] == results["walk_one_shot"]
    sections = ("walk_one_shot", "mlp_one_shot", "walk_trajectory")
    for section in sections:
        rows = results[section]
        assert {r["block"] for r in rows} == set(bench.BLOCKS)
        for r in rows:
            for k in r:
                if k.endswith("_err"):
                    # relative errors; the update's with a v map that has a zero ("de0") may blow up
                    # (the point of that row), the others stay of order 1
                    assert 0 < r[k] < (float("inf") if r["v_map"] == "de0" and k == "u_err" else 10), (section, r)
    assert (tmp_path / "maps4.txt").read_text().startswith("walk, one-shot")
    norm = results["normalized_trajectory"]
    assert {(r["source"], r["stored"]) for r in norm} == {(s, k) for s in ("walk", "mlp") for k in ("m", "r")}
    assert all(0 < r["u_err"] < 10 for r in norm), norm


def test_stored_trajectories_are_exact_without_quantization_and_not_with_it():
    """With no code the stored m (or r = m / (sqrt(v) + eps), multiplied back) is the fp32 Adam's:
    the error is 0 for m and float rounding for r (a divide and a multiply, ~1e-7 relative per
    step, accumulated over 12 steps with beta1 0.9: under 1e-5); with 4-bit codes it is not."""
    bench = load()
    code = bench.signed_maps()["de"]
    grads = lambda: bench.walk_gradients(16, 32, 12)  # noqa: E731
    assert bench.stored_trajectory(grads(), "m", None, None, 128, skip=2) == 0.0
    assert bench.stored_trajectory(grads(), "r", None, None, 128, skip=2) < 1e-5
    for store in ("m", "r"):
        err = bench.stored_trajectory(grads(), store, code, bench.linear_codebook_4bit_no_zero(), 128, skip=2)
        assert 0.01 < err < 2.0, (store, err)


def test_candidate_maps_and_roundtrip():
    bench = load()
    for name, code in bench.signed_maps().items():
        # a value that is a code times its block's absmax comes back exactly
        x = code * 3.0  # each value a code times the block's absmax (3.0): the round trip is exact
        assert torch.equal(bench.roundtrip(x, code, 64), x), name
    # the relative error is 0 for an exact round trip and positive otherwise
    assert bench.rel(torch.ones(4), torch.ones(4)) == 0.0
    assert bench.rel(torch.ones(4) * 1.1, torch.ones(4)) > 0.0
