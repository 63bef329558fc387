"""The README's "Use it with..." section: every subsection's python snippet runs, as a user would
paste it, and does what the section says (CPU; a snippet whose library is missing is skipped, with
the package named).

The Hugging Face snippets get what the section says they take: ``model`` (the tiny Llama of
tests/_hf_tiny.py), ``tokenizer`` (a word-level tokenizer made here) and ``train_dataset`` (random
token ids; a ``datasets.Dataset`` for TRL). The torchrun snippet is written to ``train_ddp.py`` and
run with the section's own command line, two processes on gloo (CUDA hidden, so that a one-GPU
machine runs it too); a line appended to it saves each rank's weights, to compare the replicas.

A subsection with a python snippet and no runner here fails: every snippet of the section runs.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import pagedopt

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
SECTION = "Use it with..."

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")


def subsections() -> dict[str, str]:
    """{### heading: its text} of the README's "Use it with..." section."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    m = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no '## {SECTION}' section in README.md"
    parts = re.finditer(r"^### (.+?)\n(.*?)(?=^### |\Z)", m.group(1), re.S | re.M)
    return {h.group(1).strip(): h.group(2) for h in parts}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def need(package: str):
    return pytest.importorskip(package, reason=f"{package} is not installed (scripts/setup_tests.sh installs it)")


def run(heading: str, ns: dict, replace: tuple[str, str] = ("", "")) -> dict:
    """Run the subsection's snippet in ``ns``, with ``replace`` applied (the text must be there)."""
    (block,) = python_blocks(subsections()[heading])
    assert replace[0] in block, f"README {heading}: {replace[0]!r} not in the snippet"
    block = block.replace(*replace)
    exec(compile(block, f"README: {heading}", "exec"), ns)
    return ns


def inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper


def hf_inputs(datasets_dataset=False) -> dict:
    need("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, TESTS_DIR)
    import _hf_tiny as tiny

    data = tiny.Tokens(1)
    if datasets_dataset:
        datasets = need("datasets")
        datasets.disable_progress_bars()
        ids = data.ids.tolist()
        data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    return {"model": tiny.make_model(0), "tokenizer": tiny.make_tokenizer(), "train_dataset": data}


def assert_only_adapters_have_states(trainer):
    opt = inner(trainer.optimizer)
    trainable = {id(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert {id(p) for p in opt.state} == trainable


# ----------------------------------------------------------------------------- the runners
def plain_loop():
    ns = run("A plain training loop", {})
    opt, model = ns["opt"], ns["model"]
    assert type(opt) is pagedopt.PagedAdamW8bit
    assert opt.state[model[0].weight]["state1"].dtype == torch.uint8
    assert all(s["step"].item() == 20 for s in opt.state.values())
    assert ns["sched"].get_last_lr()[0] < 1e-9  # the cosine schedule ran its course, one step a step


def hf_trainer():
    ns = run("The Hugging Face Trainer", hf_inputs())
    trainer = ns["trainer"]
    assert type(inner(trainer.optimizer)) is pagedopt.PagedAdamW8bit and trainer.state.global_step == 10


def peft():
    need("peft")
    ns = run("PEFT (LoRA)", hf_inputs())
    trainer = ns["trainer"]
    assert type(inner(trainer.optimizer)) is pagedopt.PagedAdamW8bit and trainer.state.global_step == 10
    assert_only_adapters_have_states(trainer)


def trl():
    need("peft")
    need("trl")
    # TRL's configs train in bf16 by default, which TrainingArguments refuses on a machine without a
    # GPU unless use_cpu=True: the README says to add it there, and so does the test
    cpu = ("max_steps=10)", "max_steps=10, use_cpu=True)") if not torch.cuda.is_available() else ("", "")
    assert "use_cpu=True" in subsections()["TRL"]
    ns = run("TRL", hf_inputs(datasets_dataset=True), cpu)
    trainer = ns["trainer"]
    assert type(inner(trainer.optimizer)) is pagedopt.PagedAdamW8bit and trainer.state.global_step == 10
    assert_only_adapters_have_states(trainer)


def accelerate():
    need("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    ns = run("Accelerate", {})
    opt = ns["opt"]
    assert isinstance(opt, AcceleratedOptimizer) and type(opt.optimizer) is pagedopt.PagedAdamW8bit
    assert all(s["step"].item() == 10 for s in opt.optimizer.state.values())
    saved = torch.load(os.path.join("ckpt", "optimizer.bin"), weights_only=True)
    assert {s["state1"].dtype for s in saved["state"].values()} == {torch.uint8, torch.float32}


def lightning():
    need("lightning")
    ns = run("Lightning", {})
    model, resumed = ns["model"], ns["resumed"]
    opt = ns["trainer"].optimizers[0]
    assert type(opt) is pagedopt.PagedAdamW8bit and opt.state[model.net[0].weight]["state1"].dtype == torch.uint8
    assert all(s["step"].item() == 2 * 8 for s in opt.state.values())  # 2 epochs of 512 / 64 batches
    # StepLR(step_size=5, gamma=0.5) stepped after every batch: halved 3 times in 16 steps
    assert ns["trainer"].lr_scheduler_configs[0].scheduler.get_last_lr() == [1e-3 * 0.5 ** 3]
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def torchrun():
    text = subsections()["torchrun (DDP)"]
    (block,) = python_blocks(text)
    (command,) = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    argv = shlex.split(command)
    assert argv[0] == "torchrun" and argv[-1] == "train_ddp.py" and block.startswith("# train_ddp.py\n")
    with open("train_ddp.py", "w") as f:
        f.write(block + 'torch.save([p.detach().cpu() for p in model.parameters()], f"params{rank}.pt")\n')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nproc = int(argv[argv.index("--nproc_per_node=2")].split("=")[1])
    params = [torch.load(f"params{r}.pt", weights_only=True) for r in range(nproc)]
    assert nproc == 2 and all(torch.equal(a, b) for a, b in zip(*params))  # the replicas are bit-identical
    state = torch.load("optimizer.pt", weights_only=True)["state"]
    assert state[0]["state1"].dtype == torch.uint8 and state[0]["step"].item() == 10


RUNNERS = {"A plain training loop": plain_loop, "The Hugging Face Trainer": hf_trainer, "PEFT (LoRA)": peft,
           "TRL": trl, "Accelerate": accelerate, "Lightning": lightning, "torchrun (DDP)": torchrun}


def test_every_snippet_has_a_runner():
    with_code = [h for h, text in subsections().items() if python_blocks(text)]
    assert set(RUNNERS) <= set(with_code), "a runner's subsection is gone from the README"
    missing = [h for h in with_code if h not in RUNNERS]
    assert not missing, f"README '{SECTION}' subsections with python snippets that no test runs: {missing}"
    assert all(len(python_blocks(subsections()[h])) == 1 for h in with_code)


@pytest.mark.parametrize("heading", list(RUNNERS))
def test_snippet(heading, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pagedopt.GlobalOptimManager.get_instance().initialize()
    try:
        RUNNERS[heading]()
    finally:
        pagedopt.GlobalOptimManager.get_instance().initialize()  # the Trainer's embedding overrides
