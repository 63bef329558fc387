"""The node benches on the CPU (gloo, torchrun, 2 ranks): bench/bench_node.py (the host link with every
GPU copying at once, the optimizer step per GPU at 1 and 2 ranks) and bench/scale.py --gpus (FSDP2
across the GPUs, bench/scale_fsdp.py). What the GPUs alone can measure (rates, times, peaks) is not
checked here; what each rank holds and moves, how the ranks' records are merged, and the per-GPU
plan and its device-safety refusals are."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from bench_modules import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")


N, S = load_bench("bench_node"), load_bench("scale")
M, R, SF = S.M, S.R, S.SF


def _states_8bit(local: int, whole: int) -> int:
    """Adam's states of a shard of ``local`` elements of a tensor of ``whole``: 8-bit codes and an
    fp32 absmax per 256-element block from min_8bit_size (4096, of the whole tensor) on, else fp32."""
    return 2 * local + 8 * math.ceil(local / 256) if whole >= 4096 else 8 * local


def test_node_step_smoke(tmp_path):
    rows = "pagedopt_adamw8bit,pagedopt_paged_adamw8bit_host"
    # 2 ranks only (a torchrun costs seconds here); the plain tensors of 1 GPU run on the device
    assert N.main(["step", "--smoke", "--worlds", "2", "--rows", rows, "--warmup", "1", "--repeat", "3",
                   "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "node_step.json").read_text())
    assert sorted(doc["worlds"]) == ["2"]
    shapes = N._shapes(True)
    for world in (2,):
        ranks = doc["worlds"][str(world)]["ranks"]
        assert len(ranks) == world
        for rank, got in enumerate(ranks):
            recs = {(r["set"], r["row"]): r for r in got["records"]}
            assert set(recs) == {(s, r) for s in ("fixed_model", "fixed_per_gpu") for r in rows.split(",")}
            for (set_name, row), r in recs.items():
                assert "error" not in r, r
                # fixed model: each rank 1/world of every tensor (rows); fixed size per GPU: a whole list each
                local = [(shape[0] // world if set_name == "fixed_model" else shape[0]) * math.prod(shape[1:])
                         for _, shape in shapes]
                whole = [math.prod(shape) * (world if set_name == "fixed_per_gpu" else 1) for _, shape in shapes]
                assert r["local_params"] == sum(local) and (r["world"], r["rank"]) == (world, rank)
                assert len(r["step_ms_all"]) == 3 and r["step_ms"] > 0 and r["first_step_ms"] > 0
                floor = N.floor_bytes_per_param(8, "fp32") * sum(local)
                assert r["floor_gbps"] == pytest.approx(floor / (r["step_ms"] * 1e-3) / 1e9, rel=1e-9)
                if row.endswith("_host"):  # each rank streams its own shards' states, in and back
                    states = sum(_states_8bit(n, w) for n, w in zip(local, whole))
                    assert r["link_h2d"] == r["link_d2h"] == states, (set_name, world, rank)
        # the tables give the slowest rank's step
        for set_name in ("fixed_model", "fixed_per_gpu"):
            times = [r["step_ms"] for got in ranks for r in got["records"]
                     if (r["set"], r["row"]) == (set_name, "pagedopt_adamw8bit")]
            assert N.slowest(doc, set_name, "pagedopt_adamw8bit", world)["step_ms"] == max(times)
    md = (tmp_path / "node_step.md").read_text()
    assert "### fixed_model" in md and "### fixed_per_gpu" in md and "\npagedopt_paged_adamw8bit_host " in md


def test_node_link_smoke_and_its_limit(tmp_path, monkeypatch):
    """The link's harness on the CPU (plain copies: no rate means anything here): each rank alone,
    then all at once, gathered; the node's figure is the sum of the ranks' all-at-once rates. Over
    the page-locked limit nothing starts."""
    assert N.main(["link", "--smoke", "--bytes", str(1 << 16), "--warmup", "1", "--repeat", "2",
                   "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "node_link.json").read_text())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["bytes_per_gpu"] == 1 << 16
    for r in doc["ranks"]:
        for mode in ("alone", "all"):
            assert all(r[mode][k + "_gbps"] > 0 for k in ("h2d", "d2h", "both")), r
    s = doc["summary"]
    assert s["node_h2d_gbps"] == pytest.approx(sum(r["all"]["h2d_gbps"] for r in doc["ranks"]))
    assert s["alone_both"] == [r["alone"]["both_gbps"] for r in doc["ranks"]]
    monkeypatch.setattr(N, "torchrun", lambda *a: pytest.fail("a refused measurement started"))
    assert N.main(["link", "--smoke", "--bytes", str(1 << 20), "--pinned-limit", str(1 << 20),
                   "--out", str(tmp_path)]) == 0
    assert "over the limit" in json.loads((tmp_path / "node_link.json").read_text())["skipped"]


def test_scale_across_gpus_smoke(tmp_path):
    """FSDP2 over two ranks (torchrun, gloo): every configuration trains on both; each rank's host
    link bytes are its own shards' states (Shard(0) of every tensor, 8-bit by the whole tensor's
    size); the node's step is its slowest rank's."""
    assert S.main(["--smoke", "--gpus", "2", "--rows", "pagedopt_paged_adamw8bit_host",
                   "--steps", "3", "--assume-link", "50,40,25", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert doc["settings"]["nproc"] == 2
    recs = {r["row"]: r for r in doc["records"]}
    with torch.device("meta"):
        params = list(M.Decoder(M.SHAPES["tiny"]).parameters())
    for rank_ in range(2):
        states = 0
        for p in params:
            rows = math.ceil(p.shape[0] / 2)  # torch.chunk: the first piece the larger
            rows = rows if rank_ == 0 else p.shape[0] - rows
            states += _states_8bit(rows * math.prod(p.shape[1:]), p.numel())
        host = recs["pagedopt_paged_adamw8bit_host"]["ranks"][rank_]
        assert host["status"] == "ok" and host["link_h2d"] == host["link_d2h"] == states, (rank_, host, states)
    for r in recs.values():
        assert r["status"] == "ok" and r["nproc"] == 2 and len(r["ranks"]) == 2, r
        assert r["step_ms"] == max(x["step_ms"] for x in r["ranks"]) and len(r["step_ms_all"]) == 3
        assert r["prediction"] is None and r["need"]["nproc"] == 2
    assert recs["pagedopt_paged_adamw8bit_host"]["need"]["link_h2d"] == math.ceil(
        sum(_states_8bit(p.numel(), p.numel()) for p in params) / 2)
    assert "| pagedopt_paged_adamw8bit_host | fp32 | tiny |" in (tmp_path / "scale.md").read_text()


def _args(**kw):
    base = dict(batch=1, seq=2048, no_checkpointing=False, budget="0.5", device_buffer_bytes=256 << 20, nproc=8)
    base.update(kw)
    return type("Args", (), base)


def test_node_plan_is_per_gpu():
    """The 70B-shaped model over 8 GPUs: managed states are checked per GPU (1/8 of the model's, still
    over 16 GiB), host residency pins the states of all ranks (one slab each), each rank moves its
    eighth over the link."""
    gib = 1 << 30
    limits = {"managed": 16 * gib, "pinned": 400 * gib, "host_available": None}
    one, _ = S.plan_config(R.BY_NAME["pagedopt_paged_adamw8bit_host"], M.SHAPES["70b"], "bf16", _args(nproc=1), limits)
    node, refused = S.plan_config(R.BY_NAME["pagedopt_paged_adamw8bit_host"], M.SHAPES["70b"], "bf16", _args(), limits)
    assert refused is None and node["prediction"] is None and one["prediction"] is not None
    slab = one["need"]["pinned"] - one["need"]["link_h2d"]
    assert node["need"]["link_h2d"] == math.ceil(one["need"]["link_h2d"] / 8)
    assert node["need"]["pinned"] == one["need"]["pinned"] + 7 * slab
    assert node["states_bytes"] == math.ceil(one["states_bytes"] / 8)
    _, refused = S.plan_config(R.BY_NAME["pagedopt_paged_adamw8bit_host"], M.SHAPES["70b"], "bf16", _args(),
                               dict(limits, pinned=100 * gib))
    assert "page-locked" in refused  # 8 x 18 GiB
    managed, refused = S.plan_config(R.BY_NAME["pagedopt_paged_adamw8bit"], M.SHAPES["70b"], "bf16", _args(), limits)
    assert "managed" in refused and 16 * gib <= managed["need"]["managed"] < 20 * gib
    _, refused = S.plan_config(R.BY_NAME["pagedopt_paged_adamw8bit"], M.SHAPES["30b"], "bf16", _args(), limits)
    assert refused is None  # 56 GiB of states / 8
    assert 77e9 < M.param_count(M.SHAPES["70b"]) < 79e9
    assert S.parse_configs("", "bf16", False, node=True) == [(s, "bf16") for s in M.NODE_LADDER]


def test_merge_and_salvage(tmp_path):
    ok = lambda ms: {"status": "ok", "step_ms": ms, "step_ms_all": [9.0, ms], "first_step_ms": 9.0 + ms,  # noqa: E731
                     "max_allocated": int(ms * 10), "link_h2d": 5}
    merged = SF.merge([ok(1.0), ok(3.0), ok(2.0)])
    assert (merged["status"], merged["step_ms"], merged["slowest_rank"], merged["max_allocated"]) == ("ok", 3.0, 1, 30)
    assert merged["first_step_ms"] == 12.0 and merged["nproc"] == 3
    merged = SF.merge([ok(1.0), {"status": "error", "error": "x"}, {"status": "oom", "phase": "backward"}])
    assert (merged["status"], merged["phase"], merged["failed_ranks"]) == ("oom", "backward", [1, 2])
    out = str(tmp_path / "child.json")
    assert SF.salvage(out) is None
    for rank, rec in enumerate([ok(1.0), {"status": "oom", "phase": "step"}]):
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(rec, f)
    assert SF.salvage(out)["status"] == "oom"
    os.remove(f"{out}.rank1")
    assert SF.salvage(out)["status"] == "error"  # rank 1 never reported
    assert SF.nproc_of(["--steps", "5", "--gpus", "8"]) == 8 and SF.nproc_of([]) == 1
    assert SF.launcher(1) == [] and "--nproc-per-node=4" in SF.launcher(4)


def test_a_child_cut_short_is_terminated_not_killed(tmp_path):
    """torchrun, terminated (SIGTERM), ends the workers it started in sessions of their own; killed
    (SIGKILL) it would leave them on the GPUs. A child past its time gets SIGTERM first."""
    import subprocess
    import time

    flag = tmp_path / "terminated"
    child = ("import signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, 'w').close(), sys.exit(0)))\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")
    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        SF.run_graceful([sys.executable, "-c", child], 3.0, stdout=subprocess.PIPE)
    assert flag.exists() and time.perf_counter() - t0 < 30


def test_multigpu_check_skips_below_two_gpus(tmp_path):
    """scripts/multigpu_check.sh on a machine with fewer than 2 GPUs: says so, exits 0, builds nothing;
    its stages' pytest selections name tests that exist (collected, skipped here without GPUs)."""
    import re
    import subprocess

    script = os.path.join(ROOT, "scripts", "multigpu_check.sh")
    env = dict(os.environ, OUT=str(tmp_path), HOME=str(tmp_path), MULTIGPU_FAKE_GPUS="1")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "skipped: needs >= 2 GPUs (found 1)" in proc.stdout
    assert (tmp_path / "summary.txt").read_text().startswith("skipped: needs >= 2 GPUs")
    assert not (tmp_path / "pagedopt-multigpu").exists()
    text = open(script).read()
    selections = {}
    for stage in ("nccl", "agree", "reshard"):
        call = re.search(rf'run_pytest {stage} "[^"]*" -- (.*?)\n(?!    )', text, re.S).group(1)
        args = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', call.replace("\\\n", " "))]
        keyword = args[args.index("-k") + 1] if "-k" in args else None
        selections[stage] = ([a for a in args if a.startswith("tests/")], keyword)
    files = sorted({f for fs, _ in selections.values() for f in fs})
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "--collect-only",
                          "-q", *files], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    ids = [x for x in out.splitlines() if "::" in x]
    for stage, expected in (("nccl", 15), ("agree", 3), ("reshard", 3)):
        fs, keyword = selections[stage]  # -k with words joined by "or", as the script writes them
        chosen = [i for i in ids if i.split("::")[0] in fs and (keyword is None or any(
            w in i.split("::")[1] for w in keyword.split(" or ")))]
        assert len(chosen) == expected, (stage, fs, keyword, chosen)
