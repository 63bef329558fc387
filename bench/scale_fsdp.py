"""bench/scale.py across the GPUs of one node (``--gpus N``): FSDP2, ``fully_shard`` on every block
and on the model, one process per GPU started by torchrun, each rank with its own batch of
``--batch`` x ``--seq`` tokens (activation checkpointing, bf16 autocast, as on one GPU).

The parent plans each configuration for the node: parameters, gradients and states of each GPU are
1/N of the model's, so the managed memory of a row is checked per GPU and its page-locked memory
for all GPUs together; the estimator models one GPU without FSDP2, so no prediction is given. Each
configuration runs as ``torchrun --standalone --nproc-per-node N bench/scale.py ... --child ...``:
every rank trains (scale.run_config with a sharded model) and writes its record; rank 0 gathers
them into one: the step time of the slowest rank (the node's step), each peak the largest over the
ranks, the host link's bytes of one rank (each moves its own shards' states), and every rank's
figures under ``ranks``. A configuration that fails on some ranks only (its collectives then wait
for the others) is cut by its timeout; the parent reads what the ranks wrote (``salvage``).

The host link's rate is bench/bench_node.py link's: each GPU's pinned rate with every GPU copying at
once, the slowest GPU's, since that is what each rank's streamed states get.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def nproc_of(argv: list) -> int:
    """The --gpus of a child's argument list (1 without). (Not --nproc: torchrun, which reads the
    whole command line, takes it for an abbreviation of its --nproc-per-node.)"""
    return int(argv[argv.index("--gpus") + 1]) if "--gpus" in argv else 1


def launcher(nproc: int) -> list:
    """What comes between the interpreter and the script: torchrun for several processes."""
    if nproc <= 1:
        return []
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def run_graceful(cmd: list, timeout_s: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run, but a child cut short (its timeout, or this process interrupted) gets SIGTERM
    first: torchrun's workers run in sessions of their own, and only torchrun, when terminated,
    ends them; killed outright it would leave them on the GPUs. TimeoutExpired as subprocess.run."""
    proc = subprocess.Popen(cmd, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def plan_node(settings: dict, nproc: int) -> None:
    """A plan of the whole model made per GPU, in place: the managed memory, the link's bytes, the
    states and the budget of one rank; the page-locked memory of all ranks (one host slab each)."""
    from pagedopt.memory.modes import HOST_SLAB_BYTES

    need = settings["need"]
    for k in ("managed", "link_h2d", "link_d2h", "states"):
        need[k] = -(-need[k] // nproc)
    if need["pinned"]:
        need["pinned"] += (nproc - 1) * HOST_SLAB_BYTES
    settings["states_bytes"] = -(-settings["states_bytes"] // nproc)
    settings["budget_bytes"] //= nproc
    settings["prediction"] = None
    need["nproc"] = nproc


def build(shape, dtype, device, checkpointing: bool = True, seed: int = 0):
    """scale_model's Decoder made on the meta device, each block and then the model sharded by
    fully_shard, then this rank's shards allocated on ``device`` in ``dtype`` and drawn as
    scale_model.build draws them (matrices ~ N(0, 0.02), norms 1)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import scale_model as M

    with torch.device("meta"):
        model = M.Decoder(shape, checkpointing).to(dtype)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            if p.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=g)
    return model


def merge(recs: list) -> dict:
    """One record of the node from the ranks' (in rank order)."""
    ok = [r for r in recs if r.get("status") == "ok"]
    if len(ok) == len(recs):
        slow = max(recs, key=lambda r: r["step_ms"])
        out = dict(recs[0], step_ms=slow["step_ms"], step_ms_all=slow["step_ms_all"],
                   first_step_ms=max(r["first_step_ms"] for r in recs), slowest_rank=recs.index(slow))
    else:
        failed = [r for r in recs if r.get("status") != "ok"]
        worst = next((r for r in failed if r.get("status") == "oom"), failed[0])
        out = dict(worst, failed_ranks=[i for i, r in enumerate(recs) if r.get("status") != "ok"])
    for k in ("max_allocated", "max_allocated_first", "max_reserved", "max_reserved_first", "device_used",
              "device_used_first"):
        vals = [r[k] for r in recs if r.get(k) is not None]
        if vals:
            out[k] = max(vals)
    keep = ("status", "step_ms", "first_step_ms", "max_allocated", "max_reserved", "device_used", "link_h2d",
            "link_d2h", "state_bytes", "host_state_bytes", "phase", "error")
    out["ranks"] = [{k: r[k] for k in keep if k in r} for r in recs]
    out["nproc"] = len(recs)
    return out


def child(run_config, row, shape, dtype: str, settings: dict, out_path: str, timeout_s: float) -> None:
    """One configuration on every rank (under torchrun): train, write this rank's record, gather;
    the process ends here."""
    import datetime

    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and settings.get("device", "cuda") != "cpu"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rec = run_config(row, shape, dtype, device, settings, build=build)
        rec["rank"] = rank
        with open(f"{out_path}.rank{rank}", "w") as f:
            json.dump(rec, f)
        recs = [None] * dist.get_world_size()
        dist.all_gather_object(recs, rec)
        if rank == 0:
            import common as C
            C.write_json(out_path, merge(recs))
    finally:
        dist.destroy_process_group()
    leave()


def leave() -> None:
    """End a rank that did its work without the interpreter's teardown: a thread of the process
    group still joinable at static destruction aborts the process now and then ("terminate called
    without an active exception", as tests/distributed_helpers.py says), which torchrun reports as
    a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def salvage(out_path: str) -> Optional[dict]:
    """The ranks' records a configuration cut short left behind, merged (None if none)."""
    recs = []
    for path in sorted(glob.glob(f"{out_path}.rank*"), key=lambda p: int(p.rsplit("rank", 1)[1])):
        with open(path) as f:
            recs.append(json.load(f))
    if not recs:
        return None
    out = merge(recs)
    if out.get("status") == "ok":  # some ranks finished, the others did not report
        out.update(status="error", error=f"only {len(recs)} ranks reported")
    return out


def measure_link(nproc: int, timeout_s: float = 300.0) -> dict:
    """Each GPU's pinned rates with all ``nproc`` GPUs copying at once (bench_node.py link), as
    scale.py's measure_link gives one GPU's: the slowest GPU's of each direction."""
    folder = tempfile.mkdtemp(prefix="scale_node_link_")
    cmd = [sys.executable, os.path.join(HERE, "bench_node.py"), "link", "--nproc", str(nproc), "--out", folder]
    try:
        proc = run_graceful(cmd, timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.TimeoutExpired:
        return {"skipped": f"bench_node.py link timed out ({timeout_s:.0f} s)"}
    path = os.path.join(folder, "node_link.json")
    if proc.returncode or not os.path.exists(path):
        return {"skipped": f"bench_node.py link: exit {proc.returncode}: {(proc.stderr or '')[-300:]}"}
    with open(path) as f:
        doc = json.load(f)
    if "ranks" not in doc:
        return {"skipped": doc.get("skipped") or doc.get("error")}
    ranks = doc["ranks"]
    return {"h2d_gbps": min(r["all"]["h2d_gbps"] for r in ranks), "d2h_gbps": min(r["all"]["d2h_gbps"] for r in ranks),
            "both_gbps_each_way": min(r["all"]["both_gbps"] for r in ranks), "per_gpu_all_at_once": doc["summary"],
            "nproc": nproc, "env": ranks[0].get("env")}
