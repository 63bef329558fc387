"""pagedopt.memory (the "what fits" estimator and pagedopt-mem) and the memory reports.

Every exact figure of the estimator (parameter count, weight, gradient and optimizer-state bytes) is
checked against a real tiny Llama built from a LlamaConfig (no download) and real optimizers after
one step; expectations are computed from that model, never written down. The activation figure is
an estimate and is only checked for its own consistency (batch scaling, max_batch), not against a
measurement.
"""
import os
import subprocess
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import pagedopt  # noqa: E402
from pagedopt import memory  # noqa: E402
from pagedopt.optim.base import optimizer_state_bytes  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# hidden 48: attention matrices 48*48 = 2304 and 48*24 = 1152 elements (below min_8bit_size 4096:
# 32-bit states), MLP 48*136 = 6528 and embeddings/lm_head 100*48 = 4800 (8-bit, neither a multiple
# of 256: partial absmax blocks), norms 48.
BASE = dict(hidden_size=48, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=64)
CONFIGS = {
    "gqa_untied": dict(BASE, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(BASE, num_key_value_heads=4, tie_word_embeddings=True),
    "bias_headdim": dict(BASE, num_key_value_heads=1, head_dim=16, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=False),
}
MIN_8BIT = 4096


@pytest.fixture(autouse=True)
def _clean_global_manager():
    """No per-parameter override left by another test may change which states are 8-bit here."""
    m = pagedopt.GlobalOptimManager.get_instance()
    saved = dict(m.__dict__)
    m.initialize()
    yield
    m.__dict__.clear()
    m.__dict__.update(saved)


def _real_model(cfg: dict, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)


def _config_json(tmp_path, cfg: dict) -> str:
    LlamaConfig(**cfg).save_pretrained(tmp_path)  # writes config.json only
    return str(tmp_path / "config.json")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_from_config_json(tmp_path, name):
    model = _real_model(CONFIGS[name])
    expected = sorted((n, p.numel()) for n, p in model.named_parameters())
    path = _config_json(tmp_path, CONFIGS[name])
    meta = memory.model_from_config(path)
    formula = memory.model_from_config(path, use_transformers=False)
    assert "meta-device" in meta.source and formula.source.startswith("formula")
    assert meta.n_params == sum(p.numel() for p in model.parameters()) == formula.n_params
    assert sorted((t.name, t.numel) for t in meta.tensors) == expected
    assert sorted((t.name, t.numel) for t in formula.tensors) == expected
    # the embedding is known as such (its states stay 32-bit with embeddings_32bit)
    emb = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    for m in (meta, formula):
        assert {t.name for t in m.tensors if t.embedding} == {f"{n}.weight" for n in emb}


def _make_optimizer(kind: str, params):
    if kind == "adamw_torch":
        return torch.optim.AdamW(params, lr=1e-3, fused=False)
    cls = {"adamw_8bit": pagedopt.AdamW8bit, "paged_adamw_8bit": pagedopt.PagedAdamW8bit,
           "adamw_32bit": pagedopt.AdamW32bit, "paged_adamw_32bit": pagedopt.PagedAdamW32bit,
           "lion_8bit": pagedopt.Lion8bit, "ademamix_8bit": pagedopt.AdEMAMix8bit,
           "ademamix_32bit": pagedopt.AdEMAMix32bit, "rmsprop_8bit": pagedopt.RMSprop8bit,
           "lars_8bit": pagedopt.LARS8bit, "lamb_8bit": pagedopt.LAMB8bit}[kind]
    return cls(params, lr=1e-3, min_8bit_size=MIN_8BIT, **({"momentum": 0.9} if kind == "lars_8bit" else {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["adamw_8bit", "paged_adamw_8bit", "adamw_32bit", "adamw_torch", "lion_8bit",
                                  "ademamix_8bit", "ademamix_32bit", "rmsprop_8bit", "lars_8bit", "lamb_8bit"])
def test_bytes_equal_a_real_step(tmp_path, kind, dtype):
    cfg = CONFIGS["gqa_untied"]
    model = _real_model(cfg, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a paged optimizer on the CPU warns that it is not paged
        opt = _make_optimizer(kind, model.parameters())
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    real_states = optimizer_state_bytes(opt)
    if kind == "adamw_torch":  # every state tensor of torch's AdamW, counted directly
        assert real_states == _tensor_bytes(v for s in opt.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor))
    else:  # both kinds of state occur
        widths = {s["state1"].dtype for s in opt.state.values()}
        assert widths == ({torch.uint8, torch.float32} if "8bit" in kind else {torch.float32})

    wname = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for use_transformers in (True, False):
        m = memory.model_from_config(_config_json(tmp_path, cfg), use_transformers=use_transformers)
        e = memory.estimate(m, kind, wname, min_8bit_size=MIN_8BIT)
        assert e.state_bytes == real_states
        assert e.weights == _tensor_bytes(model.parameters())
        assert e.gradients == _tensor_bytes(p.grad for p in model.parameters())
        if "8bit" in kind:
            assert e.params_8bit == sum(p.numel() for p in model.parameters() if opt.state[p]["state1"].dtype == torch.uint8)
        paged = kind.startswith("paged")
        assert (e.states_gpu, e.states_host) == ((0, real_states) if paged else (real_states, 0))


@pytest.mark.parametrize("offset", [0, 1], ids=["numel==min", "numel==min-1"])
def test_min_8bit_size_boundary(tmp_path, offset):
    """A tensor of exactly min_8bit_size elements gets 8-bit states, one element fewer 32-bit ones."""
    cfg = CONFIGS["gqa_untied"]
    model = _real_model(cfg)
    emb = model.model.embed_tokens.weight
    opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=emb.numel() + offset)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert (opt.state[emb]["state1"].dtype == torch.uint8) == (offset == 0)
    m = memory.model_from_config(_config_json(tmp_path, cfg))
    assert memory.estimate(m, "adamw_8bit", "fp32", min_8bit_size=emb.numel() + offset).state_bytes == \
        optimizer_state_bytes(opt)


def test_embeddings_32bit_matches_the_override(tmp_path):
    cfg = CONFIGS["gqa_untied"]
    model = _real_model(cfg)
    pagedopt.GlobalOptimManager.get_instance().register_module_override(model.model.embed_tokens, "weight",
                                                                        {"optim_bits": 32})
    opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=MIN_8BIT)
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert opt.state[model.model.embed_tokens.weight]["state1"].dtype == torch.float32
    m = memory.model_from_config(_config_json(tmp_path, cfg))
    e = memory.estimate(m, "adamw_8bit", "fp32", min_8bit_size=MIN_8BIT, embeddings_32bit=True)
    assert e.state_bytes == optimizer_state_bytes(opt)
    assert memory.estimate(m, "adamw_8bit", "fp32", min_8bit_size=MIN_8BIT).state_bytes != e.state_bytes


@pytest.mark.parametrize("mlp", [False, True], ids=["attention", "attention+mlp"])
def test_lora_trainable_parameters(tmp_path, mlp):
    cfg = CONFIGS["gqa_untied"]
    model = _real_model(cfg)
    r = 4
    targets = memory.ATTENTION_TARGETS + (memory.MLP_TARGETS if mlp else ())
    linears = [mod for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    expected = sum(r * (mod.in_features + mod.out_features) for mod in linears)
    m = memory.model_from_config(_config_json(tmp_path, cfg))
    e = memory.estimate(m, "adamw_32bit", "bf16", lora_rank=r, lora_mlp=mlp)
    assert e.n_trainable == expected
    assert e.gradients == 4 * expected  # fp32 adapters
    assert e.weights == 2 * sum(p.numel() for p in model.parameters()) + 4 * expected
    assert e.state_bytes == 8 * expected + 4 * 2 * len(linears)


def test_max_batch_and_activation_scaling():
    m = memory.model_from_config("llama3-8b", use_transformers=False)
    e1 = memory.estimate(m, "paged_adamw_8bit", "bf16", batch=1, seq=2048, gradient_checkpointing=True)
    e3 = memory.estimate(m, "paged_adamw_8bit", "bf16", batch=3, seq=2048, gradient_checkpointing=True)
    assert e3.activations == 3 * e1.activations
    no_ckpt = memory.estimate(m, "paged_adamw_8bit", "bf16", batch=1, seq=2048)
    assert no_ckpt.activations > e1.activations
    cap = 80 * memory.GIB
    b = e1.max_batch(cap)
    assert b >= 1
    fits = memory.estimate(m, "paged_adamw_8bit", "bf16", batch=b, seq=2048, gradient_checkpointing=True)
    over = memory.estimate(m, "paged_adamw_8bit", "bf16", batch=b + 1, seq=2048, gradient_checkpointing=True)
    assert fits.peak <= cap < over.peak
    assert memory.gpu_capacity("a100_80") == memory.gpu_capacity("A100-80")
    with pytest.raises(ValueError, match="unknown GPU"):
        memory.gpu_capacity("nonsense")


def test_cli_prints_the_table(tmp_path):
    cfg = CONFIGS["gqa_untied"]
    n = sum(p.numel() for p in _real_model(cfg).parameters())
    path = _config_json(tmp_path, cfg)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "pagedopt.memory", "--config", path, "--optimizer", "paged_adamw_8bit",
                          "--gpu", "24"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"{n:,} parameters" in text
    for row in ("weights", "gradients", "optimizer states (paged)", "activations (ESTIMATE)",
                "CUDA context (constant)", "PEAK (estimate)", "on 24 GiB GPU: fits"):
        assert row in text, row


def test_cli_json_equals_the_estimate(tmp_path, capsys):
    cfg = CONFIGS["mha_tied"]
    path = _config_json(tmp_path, cfg)
    assert memory.main(["--config", path, "--optimizer", "pagedopt_adamw_8bit", "--min-8bit-size", "1000",
                        "--weights", "fp32", "--json", "--gpu", "H200"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)
    e = memory.estimate(memory.model_from_config(path), "adamw_8bit", "fp32", min_8bit_size=1000)
    assert got["state_bytes"] == e.state_bytes and got["n_params"] == e.n_params and got["peak"] == e.peak
    with pytest.raises(SystemExit):
        memory.main(["--config", path, "--optimizer", "sgd"])


def test_cli_comparison_columns_line_up(capsys):
    """Every optimizer's line of "same run with each optimizer" has its figures in one column, the
    longest name (paged_ademamix_8bit) included."""
    assert memory.main(["--params", "7e9", "--gpu", "24"]) == 0
    text = capsys.readouterr().out
    lines = text.split("same run with each optimizer:\n", 1)[1].splitlines()
    rows = lines[:len(memory.OPTIMIZERS)]
    assert all(" states " in r for r in rows) and any("paged_ademamix_8bit " in r for r in rows)
    assert len({r.index(" states ") for r in rows}) == 1, "\n".join(rows)
    assert len({r.index(" peak ") for r in rows}) == 1, "\n".join(rows)
    for row, name in zip(rows, memory.OPTIMIZERS):
        assert row.split()[0] == name


def test_memory_report_and_log_memory():
    model = _real_model(CONFIGS["gqa_untied"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = pagedopt.PagedAdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=MIN_8BIT)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    lines = []
    assert memory.log_memory(3, every=2, optimizer=opt, log=lines.append) is None and lines == []
    rep = memory.log_memory(4, every=2, optimizer=opt, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("step 4:")
    assert rep["step"] == 4 and rep["optimizer_state_bytes"] == optimizer_state_bytes(opt)
    assert {"allocated_bytes", "reserved_bytes", "paged_resident_bytes", "paged_host_bytes"} <= rep.keys()
    stats = opt.paging_stats()
    assert rep["unpaged_bytes"] == stats.unpaged_bytes > 0  # on the CPU the states are not paged
    if not torch.cuda.is_available():
        assert rep["allocated_bytes"] == rep["reserved_bytes"] == 0


def test_trainer_callback_logs_every_n_steps(tmp_path):
    from transformers import Trainer, TrainingArguments

    from pagedopt.integrations.callbacks import MemoryReportCallback

    cfg = CONFIGS["gqa_untied"]
    model = _real_model(cfg)
    ids = torch.randint(1, cfg["vocab_size"], (16, 8), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": x, "labels": x} for x in ids]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = pagedopt.PagedAdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=MIN_8BIT)
    args = TrainingArguments(str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    seen = []
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                      callbacks=[MemoryReportCallback(every_n_steps=2, log_to=seen.append)])
    trainer.train()
    entries = [h for h in trainer.state.log_history if "mem/allocated_gib" in h]
    assert [h["step"] for h in entries] == [2, 4]
    assert seen == entries
    keys = {"mem/allocated_gib", "mem/reserved_gib", "mem/max_allocated_gib", "mem/optimizer_state_gib",
            "mem/paged_resident_gib", "mem/paged_host_gib", "mem/unpaged_gib", "step"}
    for h in entries:
        assert keys <= h.keys()
        assert h["mem/optimizer_state_gib"] == optimizer_state_bytes(opt) / memory.GIB
    with pytest.raises(ValueError):
        MemoryReportCallback(every_n_steps=0)


def test_attached_trainer_callback_reaches_the_reporters(tmp_path):
    """Passed in callbacks=[...], the callback comes after the reporters, which never see its
    figures; attached, it runs first and its figures ride on the Trainer's training log entries."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from pagedopt.integrations.callbacks import MemoryReportCallback

    class Reporter(TrainerCallback):  # what TensorBoard / W&B callbacks receive
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    cfg = CONFIGS["gqa_untied"]
    ids = torch.randint(1, cfg["vocab_size"], (16, 8), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": x, "labels": x} for x in ids]
    for attach in (False, True):
        model = _real_model(cfg)
        opt = pagedopt.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=MIN_8BIT)
        args = TrainingArguments(str(tmp_path / f"out{attach}"), max_steps=4, per_device_train_batch_size=4,
                                 use_cpu=True, report_to=[], logging_steps=2, save_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0)
        reporter, cb = Reporter(), MemoryReportCallback(every_n_steps=4)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                          callbacks=[reporter] if attach else [reporter, cb])
        if attach:
            assert cb.attach(trainer) is cb and trainer.callback_handler.callbacks[0] is cb
            assert sum(c is cb for c in trainer.callback_handler.callbacks) == 1
        trainer.train()
        training = [log for log in reporter.logs if "loss" in log]
        assert len(training) == 2  # steps 2 and 4
        if attach:
            for log in training:
                assert log["mem/optimizer_state_gib"] == optimizer_state_bytes(opt) / memory.GIB
                assert {"mem/allocated_gib", "mem/reserved_gib", "mem/max_allocated_gib"} <= log.keys()
        else:
            assert not any(k.startswith("mem/") for log in reporter.logs for k in log)
        # the every-N entries of the log history, either way
        assert [h["step"] for h in trainer.state.log_history if "mem/allocated_gib" in h] == [4]
