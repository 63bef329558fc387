"""PEFT (LoRA) and TRL's SFTTrainer with pagedopt's Trainer ``optim=`` names, on the CPU.

A LoRA adapter (r=8 on q_proj and v_proj) of the tiny Llama of tests/_hf_tiny.py trains for 6 steps
with ``optim="pagedopt_paged_adamw_8bit"`` (``optim_args="min_8bit_size=256"``, so that the
adapters of 256 elements get 8-bit states and v_proj's 16x8 ``lora_B`` keeps 32-bit ones) and with
``"pagedopt_paged_adamw_32bit"``, along two routes:

* ``trainer``: ``peft.get_peft_model`` and the Hugging Face ``Trainer``;
* ``sft``: TRL's ``SFTTrainer`` with ``peft_config=``, a ``datasets.Dataset`` of token ids and a
  word-level tokenizer made on the spot (no hub).

Each run checkpoints every 3 steps and carries ``MemoryReportCallback(every_n_steps=1)``. Then:

* only the adapters have optimizer states, and only they are in the optimizer's groups; the frozen
  base weights did not move, every adapter did; the states' widths follow ``min_8bit_size``;
* the callback's ``mem/optimizer_state_gib`` times 2**30 is exactly the bytes of the live state
  tensors (codebooks excluded), which is also the README's per-tensor formula, at every step;
* a new trainer over a fresh model (another adapter initialisation on the ``trainer`` route) that
  resumes from checkpoint-3 makes the 3 remaining steps and ends with the uninterrupted run's
  weights and optimizer states.

Tolerances: none. The Trainer restores the data order, the RNG states, the scheduler and the
optimizer state (``optimizer.pt``, loaded with ``load_state_dict``), the adapter weights come from
``adapter_model.safetensors`` bit for bit, and the CPU kernels are deterministic, so the resumed run
repeats the uninterrupted one's arithmetic exactly (measured: equal on transformers 5.25, peft
0.21, trl 1.16). The byte figure is an integer divided by a power of two in float64 (exact below
2**53 bytes), so multiplying back is exact.
"""
import math
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub access, before transformers is imported
pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup_tests.sh installs it)")
pytest.importorskip("peft", reason="peft is not installed (scripts/setup_tests.sh installs it)")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import pagedopt  # noqa: E402
from pagedopt.integrations import transformers as pagedopt_hf  # noqa: E402
from pagedopt.integrations.callbacks import MemoryReportCallback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _hf_tiny as tiny  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

NAMES = ["pagedopt_paged_adamw_8bit", "pagedopt_paged_adamw_32bit"]
OPTIM_ARGS = {"pagedopt_paged_adamw_8bit": "min_8bit_size=256"}
MIN_8BIT = 256
ROUTES = ["trainer", "sft"]
SEED, DATA_SEED, OTHER_ADAPTER_SEED = 0, 1, 12345
STEPS, AT = 6, 3
GIB = 2 ** 30


def lora_config():
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def make_trainer(route, name, out_dir, adapter_seed, callbacks):
    kwargs = dict(optim=name, optim_args=OPTIM_ARGS.get(name), learning_rate=1e-2,
                  **tiny.run_kwargs(out_dir, STEPS, AT, SEED))
    if route == "trainer":
        base = tiny.make_model(SEED)
        torch.manual_seed(adapter_seed)  # lora_A's initialisation
        model = get_peft_model(base, lora_config())
        return Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=tiny.Tokens(DATA_SEED),
                       callbacks=callbacks)
    pytest.importorskip("trl", reason="trl is not installed (scripts/setup_tests.sh installs it)")
    import datasets
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    data = datasets.Dataset.from_dict({"input_ids": tiny.Tokens(DATA_SEED).ids.tolist()})  # labels: a copy
    return SFTTrainer(model=tiny.make_model(SEED), args=SFTConfig(**kwargs), train_dataset=data,
                      processing_class=tiny.make_tokenizer(), peft_config=lora_config(), callbacks=callbacks)


def inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the Trainer's optimizer


@pytest.fixture(scope="module", autouse=True)
def registered():
    pagedopt_hf.register()
    yield
    pagedopt.GlobalOptimManager.get_instance().initialize()  # the Trainer's embedding overrides


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(route, name): the uninterrupted run and the resumed one}, each trained once per module."""
    cache = {}

    def get(route, name):
        if (route, name) not in cache:
            root = tmp_path_factory.mktemp(f"{route}-{name}")
            trainer = make_trainer(route, name, str(root / "run"), SEED, [MemoryReportCallback(every_n_steps=1)])
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.train()
            counter = tiny.CountSteps()
            resumed = make_trainer(route, name, str(root / "resumed"), OTHER_ADAPTER_SEED, [counter])
            resumed_before = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
            checkpoint = str(root / "run" / f"checkpoint-{AT}")
            resumed.train(resume_from_checkpoint=checkpoint)
            cache[route, name] = dict(trainer=trainer, before=before, resumed=resumed, counter=counter,
                                      resumed_before=resumed_before, checkpoint=checkpoint)
        return cache[route, name]

    return get


CASES = [(r, n) for r in ROUTES for n in NAMES]


@pytest.mark.parametrize("route,name", CASES)
def test_only_the_adapters_have_optimizer_states(runs, route, name):
    run = runs(route, name)
    model, opt = run["trainer"].model, inner(run["trainer"].optimizer)
    assert type(opt) is {"pagedopt_paged_adamw_8bit": pagedopt.PagedAdamW8bit,
                         "pagedopt_paged_adamw_32bit": pagedopt.PagedAdamW32bit}[name]
    named = dict(model.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert {n for n, p in named.items() if p.requires_grad} == adapters
    by_id = {id(p): n for n, p in named.items()}
    assert {by_id[id(p)] for p in opt.state} == adapters
    assert sorted(by_id[id(p)] for g in opt.param_groups for p in g["params"]) == sorted(adapters)
    for n, p in named.items():
        moved = not torch.equal(p.detach(), run["before"][n])
        assert moved == (n in adapters), f"{n}: moved={moved}"
        if n in adapters:
            eight_bit = name.endswith("_8bit") and p.numel() >= MIN_8BIT
            assert opt.state[p]["state1"].dtype == (torch.uint8 if eight_bit else torch.float32), n
    widths = {opt.state[named[n]]["state1"].dtype for n in adapters}
    # both widths among the 8-bit run's adapters (v_proj's lora_B has 16x8 = 128 < 256 elements)
    assert widths == ({torch.uint8, torch.float32} if name.endswith("_8bit") else {torch.float32})


def live_state_bytes(opt) -> int:
    """The bytes of every state tensor, counted here from the tensors (codebooks excluded)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and not k.startswith("qmap"))


def formula_state_bytes(opt) -> int:
    """The README's per-tensor formula ("Memory: what fits"): 8-bit 2n + 8*ceil(n/256) + 4, else 8n + 4."""
    return sum(2 * p.numel() + 8 * math.ceil(p.numel() / 256) + 4 if opt.state[p]["state1"].dtype == torch.uint8
               else 8 * p.numel() + 4 for p in opt.state)


@pytest.mark.parametrize("route,name", CASES)
def test_memory_callback_reports_the_live_state_bytes(runs, route, name):
    trainer = runs(route, name)["trainer"]
    opt = inner(trainer.optimizer)
    entries = [h for h in trainer.state.log_history if "mem/optimizer_state_gib" in h]
    assert [h["step"] for h in entries] == list(range(1, STEPS + 1))
    live = live_state_bytes(opt)
    assert live == formula_state_bytes(opt) > 0
    for h in entries:  # the states exist from the first step on and keep their size
        assert h["mem/optimizer_state_gib"] * GIB == live, h
        # a paged class reports its paging figures (unpaged on the CPU), found through accelerate's wrapper
        assert {"mem/paged_resident_gib", "mem/paged_host_gib", "mem/unpaged_gib"} <= set(h), h


@pytest.mark.parametrize("route,name", CASES)
def test_resume_from_checkpoint_is_exact(runs, route, name):
    run = runs(route, name)
    first, resumed = run["trainer"], run["resumed"]
    assert run["counter"].steps == STEPS - AT and resumed.state.global_step == STEPS
    want, got = first.model.state_dict(), resumed.model.state_dict()
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"{route}/{name}: resumed weights differ from the uninterrupted run's in {different}"
    opt, opt2 = inner(first.optimizer), inner(resumed.optimizer)
    named2 = dict(resumed.model.named_parameters())
    for n, p in first.model.named_parameters():
        if p in opt.state:
            s, s2 = opt.state[p], opt2.state[named2[n]]
            assert s.keys() == s2.keys(), n
            for k in s:
                assert torch.equal(s[k], s2[k]), f"{n} {k}"
    # not trivially equal: the adapters moved after the checkpoint, and the resumed model started elsewhere
    from safetensors.torch import load_file

    at_checkpoint = load_file(os.path.join(run["checkpoint"], "adapter_model.safetensors"))
    assert len(at_checkpoint) == 8
    final = {n: p for n, p in first.model.named_parameters() if p.requires_grad}
    for key, value in at_checkpoint.items():
        (match,) = [n for n in final if n.replace(".default.", ".") == key]
        assert not torch.equal(value, final[match].detach()), key
        assert not torch.equal(value, run["resumed_before"][match]), key
