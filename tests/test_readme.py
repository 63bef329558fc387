"""Every python snippet of README.md runs, as a user would paste it, and does what the text around
it says. (The Hugging Face Trainer section has its own test, tests/test_transformers_trainer.py.)"""
import copy
import os
import re

import pytest
import torch

import pagedopt
from pagedopt.quant import dequantize_blockwise_reference

from reference import quantization_error_bound

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sections() -> dict[str, list[str]]:
    """{section title: [python snippets]} of README.md."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    out = {}
    for m in re.finditer(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.S | re.M):
        blocks = re.findall(r"```python\n(.*?)```", m.group(2), re.S)
        if blocks:
            out[m.group(1).strip()] = blocks
    return out


def make_model():
    torch.manual_seed(0)
    # 64*128 = 8192 weights >= min_8bit_size (8-bit states); biases below it (32-bit states)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))


def train(model, opt, steps=3):
    for i in range(steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.fixture(autouse=True)
def fresh_manager(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pagedopt.GlobalOptimManager.get_instance().initialize()
    yield
    pagedopt.GlobalOptimManager.get_instance().initialize()


def test_the_sections_with_snippets_are_the_expected_ones():
    assert {"Use", "Checkpoints", "Memory: what fits"} <= set(sections())


def test_use_snippet():
    model = make_model()
    ns = {"model": model}
    for block in sections()["Use"]:
        exec(block, ns)
    assert type(ns["opt"]) is pagedopt.AdamW
    train(model, ns["opt"])
    assert ns["opt"].state[model[0].weight]["state1"].dtype == torch.uint8  # optim_bits=8


def test_checkpoint_snippet():
    model = make_model()
    (block,) = sections()["Checkpoints"]
    assert "# ... train ...\n" in block
    ns = {"model": model, "train": train}
    exec(block.replace("# ... train ...\n", "train(model, opt)\n"), ns)
    opt, torch_opt, opt8 = ns["opt"], ns["torch_opt"], ns["opt8"]
    saved = torch.load("optimizer.pt", weights_only=True)["state"]
    params = list(model.parameters())
    for i, p in enumerate(params):  # the reloaded optimizer holds exactly what was saved
        for k, v in saved[i].items():
            assert torch.equal(opt.state[p][k].cpu(), v.cpu()), k
    w = model[0].weight
    for i, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
        s = opt.state[w]
        # to_torch_state_dict dequantizes exactly as the reference does: code[q] * absmax, in fp32
        expected = dequantize_blockwise_reference(s[f"state{i}"], s[f"absmax{i}"], s[f"qmap{i}"])
        assert torch.equal(torch_opt.state[w][key], expected.reshape(w.shape))
        # and the 8-bit optimizer requantizes torch's moments: within one rounding of the codebook
        s8 = opt8.state[w]
        back = dequantize_blockwise_reference(s8[f"state{i}"], s8[f"absmax{i}"], s8[f"qmap{i}"]).reshape(-1)
        x = torch_opt.state[w][key].reshape(-1)
        assert ((back - x).abs() <= quantization_error_bound(x, s8[f"absmax{i}"], s8[f"qmap{i}"])).all()
    # the module override gives model[0].weight 32-bit states in an optimizer built afterwards
    later = pagedopt.AdamW8bit(model.parameters())
    train(model, later, steps=1)
    assert later.state[w]["state1"].dtype == torch.float32
    assert later.state[model[2].weight]["state1"].dtype == torch.uint8


def test_bf16_snippet():
    """The snippet's optimizer moves many more weights in its first step (Adam's first update is lr
    = 1e-5 per weight, below half the bf16 spacing of all but the smallest weights) than the same
    optimizer rounding to nearest, which moves only weights under about 2.6e-3 (6% of them): about
    14% by the estimate 6% + the mean of 1e-5 / spacing over the others; asserted: 1.5 times as many."""
    (block,) = sections()["bf16 parameters: stochastic rounding"]
    ns = {}
    exec(block, ns)
    model, opt = ns["model"], ns["opt"]
    assert model.weight.dtype == torch.bfloat16 and opt.param_groups[0]["bf16_stochastic_round"] is True
    twin = copy.deepcopy(model)
    nearest = pagedopt.AdamW8bit(twin.parameters(), lr=1e-5)
    before = model.weight.detach().clone()
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    for m, o in ((model, opt), (twin, nearest)):
        m(x).float().square().mean().backward()
        o.step()
    moved, moved_nearest = int((model.weight != before).sum()), int((twin.weight != before).sum())
    assert moved > 1.5 * moved_nearest > 0, (moved, moved_nearest)


def test_memory_callback_snippet(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    import _hf_tiny

    (block,) = sections()["Memory: what fits"]
    steps = 100  # two reports at every_n_steps=50
    args = TrainingArguments(**{**_hf_tiny.run_kwargs(str(tmp_path / "out"), steps, steps, 0),
                                "save_strategy": "no", "optim": "adamw_torch"})
    ns = {"model": _hf_tiny.make_model(0), "args": args, "ds": _hf_tiny.Tokens(0)}
    exec(block, ns)
    entries = [h for h in ns["trainer"].state.log_history if "mem/allocated_gib" in h]
    assert [h["step"] for h in entries] == [50, 100]


# ------------------------------------------------------------------ Quick start
def quick_start() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    return re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M).group(1)


def test_demo_table_as_the_demo_prints_it():
    """The example output has the demo's header, and each row its fields where the header's end."""
    from pagedopt import demo

    block = re.search(r"`make demo` prints .*?```\n(.*?)```", quick_start(), re.S).group(1).splitlines()
    assert block[0] == demo.TABLE_HEADER

    header_ends = [m.end() for m in re.finditer(r"\S+( \S+)?(?=\s{2,}|$)", block[0])]
    rows = [line for line in block[1:] if line.startswith(("torch.", "pagedopt."))]
    assert len(rows) == 2
    for row in rows:
        # the first column is left-aligned, the others right-aligned under their header
        assert [m.end() for m in re.finditer(r"\S+", row)][1:] == header_ends[1:], row


def test_quick_start_says_what_each_command_installs():
    """Every package scripts/setup.sh (make demo) and scripts/setup_tests.sh (make test) install is
    in the README's column of that command, and the demo's set-up installs none of the tests'."""
    def installed(script):
        with open(os.path.join(REPO, "scripts", script)) as f:
            text = f.read()
        found = set()
        defaults = dict(re.findall(r'(\w+_VERSION)=\$\{\1:-([^}]+)\}', text))  # NAME_VERSION=${NAME_VERSION:-v}
        for line in re.findall(r'(?:MISSING=|<<<")\$\("\$PY" scripts/missing_packages\.py ([^)]*)\)', text):
            words = [w.strip('"') for w in line.split()]
            for var, version in defaults.items():
                words = [w.replace(f"${var}", version) for w in words]
            if "--editable-build" in words:  # what the editable install needs (missing_packages.py)
                words += ["setuptools>=64", "wheel"]
            found |= {w for w in words if not w.startswith("-")}
        found |= set(re.findall(r'pip install -q "(torch==[^"]+)"', text))
        return found

    demo, tests = installed("setup.sh"), installed("setup_tests.sh")
    assert demo == {"torch==2.14.1", "ninja", "tqdm", "setuptools>=64", "wheel"}
    assert tests >= {"pytest", "hypothesis", "matplotlib", "transformers==5.25.0", "accelerate==1.16.0",
                     "deepspeed==0.19.8", "peft==0.21.2", "trl==1.16.0", "lightning==2.6.6"}
    table = re.search(r"^\| \| `make demo`.*?\n\n", quick_start(), re.S | re.M).group(0)
    columns = [row.split("|")[2:4] for row in table.splitlines() if row.startswith("| packages")]
    (demo_column, tests_column), = columns
    for name in demo:
        assert f"`{name}`" in demo_column, name
    for name in tests:
        assert f"`{name}`" in tests_column and f"`{name}`" not in demo_column, name
