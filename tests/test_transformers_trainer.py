"""Hugging Face Trainer ``optim=`` names (``pagedopt.integrations.transformers``), CPU only.

Runs on transformers 4.57 and 5.x (``make test-transformers-457`` runs this file on 4.57):

* every name trains a tiny Llama through the Trainer with its own class (derived here from the
  name), lr/betas/eps/weight decay from the TrainingArguments, 32-bit embedding states (8-bit
  with ``embeddings_32bit=false``) and 8-bit states on the other large matrices for 8-bit names;
  the names cover every optimizer class pagedopt exports;
* ``optim_args`` is parsed strictly, when the TrainingArguments are made and when it reaches the Trainer;
* ``import pagedopt`` alone names the optimizers, whichever of pagedopt and transformers is
  imported first (fresh processes); with PAGEDOPT_AUTO_REGISTER=0 only ``register()`` does; where
  the names cannot be added, the error names the route that needs none;
* on the CPU a paged name warns once, at the user's ``trainer.train()``;
* an HfArgumentParser built after ``register()`` takes the README's command line;
* resume, for three representative names: 6 uninterrupted steps (checkpoints at 3 and 6) against
  a new process that loads ``checkpoint-3/training_args.bin`` before anything has imported
  pagedopt (its unpickling registers the names), starts from a differently initialised model,
  resumes from checkpoint-3 and makes the 3 remaining steps: final weights bit for bit;
* the README section's snippets run (read from README.md).
"""
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no hub access
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import HfArgumentParser, Trainer, TrainingArguments  # noqa: E402

import pagedopt  # noqa: E402
from pagedopt.integrations import transformers as pagedopt_hf  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)
import _hf_tiny as tiny  # noqa: E402

# paged classes work unpaged off CUDA and say so once; that is not under test here
pytestmark = pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning")

NAMES = ["pagedopt_adam", "pagedopt_adamw", "pagedopt_adam_8bit", "pagedopt_adamw_8bit", "pagedopt_adam_32bit",
         "pagedopt_adamw_32bit", "pagedopt_paged_adam", "pagedopt_paged_adamw", "pagedopt_paged_adam_8bit",
         "pagedopt_paged_adamw_8bit", "pagedopt_paged_adam_32bit", "pagedopt_paged_adamw_32bit",
         "pagedopt_lion", "pagedopt_lion_8bit", "pagedopt_lion_32bit", "pagedopt_paged_lion",
         "pagedopt_paged_lion_8bit", "pagedopt_paged_lion_32bit", "pagedopt_ademamix", "pagedopt_ademamix_8bit",
         "pagedopt_ademamix_32bit", "pagedopt_paged_ademamix", "pagedopt_paged_ademamix_8bit",
         "pagedopt_paged_ademamix_32bit", "pagedopt_sgd", "pagedopt_sgd_8bit", "pagedopt_sgd_32bit", "pagedopt_rmsprop",
         "pagedopt_rmsprop_8bit", "pagedopt_rmsprop_32bit", "pagedopt_adagrad", "pagedopt_adagrad_8bit",
         "pagedopt_adagrad_32bit", "pagedopt_lars", "pagedopt_lars_8bit", "pagedopt_lars_32bit", "pagedopt_lamb",
         "pagedopt_lamb_8bit", "pagedopt_lamb_32bit", "pagedopt_adam_4bit", "pagedopt_adamw_4bit",
         "pagedopt_paged_adam_4bit", "pagedopt_paged_adamw_4bit", "pagedopt_lion_4bit", "pagedopt_paged_lion_4bit"]
VARIABLE_WIDTH = [n for n in NAMES if not n.endswith("bit")]  # the width is the optim_bits argument
SEED, DATA_SEED = 0, 1
# Hyperparameters unlike every default, so that each one is seen to come from the arguments.
HYPER = dict(learning_rate=2e-3, adam_beta1=0.85, adam_beta2=0.97, adam_epsilon=1e-7, weight_decay=0.05)


@pytest.fixture(scope="module", autouse=True)
def registered():
    pagedopt_hf.register()
    yield
    # the embedding overrides of this file's models stay in the process-wide manager otherwise
    pagedopt.GlobalOptimManager.get_instance().initialize()


def expected_class(name: str) -> type:
    """The class a name stands for, by the naming rule (pagedopt_paged_adamw_8bit -> PagedAdamW8bit)."""
    words = {"paged": "Paged", "adam": "Adam", "adamw": "AdamW", "lion": "Lion", "ademamix": "AdEMAMix", "sgd": "SGD",
             "rmsprop": "RMSprop", "adagrad": "Adagrad", "lars": "LARS", "lamb": "LAMB"}
    return getattr(pagedopt, "".join(words.get(w, w) for w in name[len("pagedopt_"):].split("_")))


def expected_keys(name: str) -> set:
    """The optim_args keys a name accepts, by the rule of the README."""
    keys = {"beta1", "beta2"} if "lion" in name else {"beta1", "beta2", "eps"}
    if "ademamix" in name:
        keys |= {"beta3", "alpha", "t_alpha", "t_beta3"}
    for algorithm, own in (("sgd", {"momentum", "dampening", "nesterov"}), ("rmsprop", {"alpha", "eps"}),
                           ("adagrad", {"eps"}), ("lars", {"momentum", "dampening", "nesterov", "max_unorm"}),
                           ("lamb", {"beta1", "beta2", "eps", "max_unorm", "bias_correction", "adam_w_mode"})):
        if algorithm in name:
            keys = set(own)
    if name in VARIABLE_WIDTH:
        keys.add("optim_bits")
    if not name.endswith("32bit"):
        keys |= {"min_8bit_size", "embeddings_32bit"}
    return keys | {"bf16_stochastic_round"}


def inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the Trainer's optimizer


def train(tmp_path, name, optim_args=None, steps=2, **kwargs):
    model = tiny.make_model(SEED)
    args = TrainingArguments(optim=name, optim_args=optim_args, **HYPER, **kwargs,
                             **tiny.run_kwargs(str(tmp_path / "run"), steps, steps, SEED))
    trainer = Trainer(model=model, args=args, train_dataset=tiny.Tokens(DATA_SEED))
    trainer.train()
    return model, args, trainer


# ------------------------------------------------------------------ every name, through the Trainer
def test_names_cover_every_class():
    classes = {getattr(pagedopt, n) for n in pagedopt.__all__}
    optimizers = {c for c in classes if isinstance(c, type) and issubclass(c, pagedopt.QuantizedOptimizer)
                  and c not in (pagedopt.AdamBase, pagedopt.QuantizedOptimizer)}
    assert sorted(pagedopt_hf.NAMES) == sorted(NAMES)
    assert {e.cls for e in pagedopt_hf.NAMES.values()} == optimizers
    for name in NAMES:
        assert pagedopt_hf.NAMES[name].cls is expected_class(name)
        assert set(pagedopt_hf.accepted_optim_args(name)) == expected_keys(name)


def with_momentum(name, optim_args):
    """SGD keeps states (the momentum buffers under test here) only with momentum."""
    if "sgd" not in name:
        return optim_args
    return "momentum=0.9" + (f",{optim_args}" if optim_args else "")


CASES = ([(n, with_momentum(n, None)) for n in NAMES] + [(n, with_momentum(n, "optim_bits=8")) for n in VARIABLE_WIDTH]
         + [("pagedopt_adamw_8bit", "embeddings_32bit=false"),
            ("pagedopt_paged_adam", "optim_bits=8,embeddings_32bit=False")])


@pytest.mark.parametrize("name,optim_args", CASES)
def test_trainer_name(tmp_path, name, optim_args):
    before = {k: v.clone() for k, v in tiny.make_model(SEED).state_dict().items()}
    model, args, trainer = train(tmp_path, name, optim_args)
    opt = inner(trainer.optimizer)
    assert type(opt) is expected_class(name)
    assert opt.defaults["lr"] == args.learning_rate
    if any(a in name for a in ("adam", "lion", "ademamix", "lamb")):
        betas = (args.adam_beta1, args.adam_beta2) + ((0.9999,) if "ademamix" in name else ())
        assert tuple(opt.defaults["betas"]) == betas
        assert opt.defaults.get("eps") == (None if "lion" in name else args.adam_epsilon)
    else:  # SGD, RMSprop, Adagrad take neither betas nor adam_epsilon (their own defaults, or optim_args)
        assert "betas" not in opt.defaults
        assert opt.defaults.get("eps") == {"sgd": None, "rmsprop": 1e-8, "adagrad": 1e-10, "lars": None}[name.split("_")[1]]
    assert sorted({g["weight_decay"] for g in opt.param_groups}) == [0.0, args.weight_decay]

    eight_bit = name.endswith(("_8bit", "_4bit")) or "optim_bits=8" in (optim_args or "")  # quantized states
    emb32 = "embeddings_32bit=false" not in (optim_args or "").lower()
    emb = model.get_input_embeddings().weight
    n8 = 0
    for p in model.parameters():
        dtype = opt.state[p]["state1"].dtype
        if p is emb:
            assert dtype == (torch.uint8 if eight_bit and not emb32 else torch.float32), name
        elif eight_bit and p.numel() >= 4096:  # the default min_8bit_size
            assert dtype == torch.uint8, name
        else:
            assert dtype == torch.float32, name
        n8 += dtype == torch.uint8
    assert (n8 > 0) == eight_bit
    # it trained: every parameter that gets a gradient moved
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before), name
    assert os.path.isfile(os.path.join(args.output_dir, "checkpoint-2", "optimizer.pt"))


def test_patch_free_route(tmp_path):
    model = tiny.make_model(SEED)
    args = TrainingArguments(**HYPER, optim_args="beta2=0.9", **tiny.run_kwargs(str(tmp_path), 2, 2, SEED))
    cls, kwargs = pagedopt_hf.optimizer_cls_and_kwargs("pagedopt_adam_8bit", args, model)
    trainer = Trainer(model=model, args=args, train_dataset=tiny.Tokens(DATA_SEED),
                      optimizer_cls_and_kwargs=(cls, kwargs))
    trainer.train()
    opt = inner(trainer.optimizer)
    assert type(opt) is pagedopt.Adam8bit and opt.defaults["betas"] == (args.adam_beta1, 0.9)
    assert opt.state[model.get_input_embeddings().weight]["state1"].dtype == torch.float32
    assert opt.state[model.get_output_embeddings().weight]["state1"].dtype == torch.uint8


# ------------------------------------------------------------------ optim_args
def test_optim_args_accepted():
    opts = pagedopt_hf.parse_optim_args(
        "pagedopt_paged_adam", " beta1=0.8, beta2=0.95,eps=1e-7,optim_bits=8,min_8bit_size=16384,embeddings_32bit=False")
    assert opts == {"beta1": 0.8, "beta2": 0.95, "eps": 1e-7, "optim_bits": 8, "min_8bit_size": 16384,
                    "embeddings_32bit": False}
    assert type(opts["optim_bits"]) is int and type(opts["min_8bit_size"]) is int
    args = TrainingArguments("unused", **HYPER, optim_args="beta1=0.8,eps=1e-6,optim_bits=8,min_8bit_size=16384")
    cls, kwargs = pagedopt_hf.optimizer_cls_and_kwargs("pagedopt_paged_adamw", args)
    assert cls is pagedopt.PagedAdamW
    assert kwargs == {"lr": args.learning_rate, "betas": (0.8, args.adam_beta2), "eps": 1e-6,
                      "weight_decay": args.weight_decay, "optim_bits": 8, "min_8bit_size": 16384}


BAD = [
    ("pagedopt_adamw_8bit", "lr=1e-3", "unknown key 'lr'"),
    ("pagedopt_adamw_8bit", "optim_bits=8", "unknown key 'optim_bits'"),
    ("pagedopt_adamw_32bit", "min_8bit_size=16", "unknown key 'min_8bit_size'"),
    ("pagedopt_paged_adam_32bit", "embeddings_32bit=false", "unknown key 'embeddings_32bit'"),
    ("pagedopt_adam", "beta2", "is not key=value"),
    ("pagedopt_adam", "beta2=", "is not key=value"),
    ("pagedopt_adam", "beta2=0.9,beta2=0.95", "given twice"),
    ("pagedopt_adam", "beta1=abc", "not a float"),
    ("pagedopt_adam", "eps=inf", "not a finite float"),
    ("pagedopt_adam", "optim_bits=16", "not 4, 8 or 32"),
    ("pagedopt_adam", "min_8bit_size=1.5", "not an integer"),
    ("pagedopt_adam", "embeddings_32bit=maybe", "not a boolean"),
]


@pytest.mark.parametrize("name,optim_args,message", BAD)
def test_optim_args_strict(name, optim_args, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        pagedopt_hf.parse_optim_args(name, optim_args)
    if "unknown key" in message or "key=value" in message:
        listed = re.search(r"accepted keys for \S+: ([a-z0-9_, ]+) \(", str(err.value)).group(1)
        assert set(listed.split(", ")) == expected_keys(name)


def test_optim_args_refused_when_the_arguments_are_made(tmp_path, monkeypatch):
    # "beta2" alone would fail in transformers' own parser with an unpacking error; ours runs first,
    # when the TrainingArguments are made, on the command line too
    kwargs = tiny.run_kwargs(str(tmp_path), 1, 1, SEED)
    with pytest.raises(ValueError, match=r"optim_args 'beta2': 'beta2' is not key=value; accepted keys"):
        TrainingArguments(optim="pagedopt_adamw_8bit", optim_args="beta2", **kwargs)
    with pytest.raises(ValueError, match=r"optim_args 'lr=1e-3': unknown key 'lr'; accepted keys"):
        TrainingArguments(optim="pagedopt_paged_lion_8bit", optim_args="lr=1e-3", **kwargs)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"unknown key 'optim_bits'"):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            args=["--output_dir", "out", "--use_cpu", "--optim", "pagedopt_adamw_8bit", "--optim_args", "optim_bits=8"])
    TrainingArguments(optim="adamw_torch", optim_args="anything=1", **kwargs)  # not ours: not checked
    # a value set afterwards is refused when the Trainer makes the optimizer
    args = TrainingArguments(optim="pagedopt_adamw_8bit", **kwargs)
    args.optim_args = "beta2"
    with pytest.raises(ValueError, match="is not key=value.*accepted keys"):
        Trainer(model=tiny.make_model(SEED), args=args, train_dataset=tiny.Tokens(DATA_SEED)).create_optimizer()
    with pytest.raises(ValueError, match="is not a pagedopt optimizer name"):
        pagedopt_hf.optimizer_cls_and_kwargs("adamw_torch", args)


def test_fallback_warning_names_the_trainer_line(tmp_path):
    """On the CPU a paged name's optimizer works unpaged and says so once, at trainer.train()."""
    import inspect
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, "pagedopt_paged_adamw_8bit")
    ours = [w for w in caught if issubclass(w.category, pagedopt.paging.PagingFallbackWarning)]
    source, first = inspect.getsourcelines(train)
    line = first + next(i for i, text in enumerate(source) if "trainer.train()" in text)
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)]


# ------------------------------------------------------------------ the names with no register()
# Each case in a fresh process: import pagedopt, and transformers before or after it.
AUTO_CHILD = textwrap.dedent("""
    import json, os, sys, warnings
    sys.path.insert(0, os.environ["TESTS_DIR"])
    case, out = sys.argv[1], {}
    caught = warnings.catch_warnings(record=True)
    got = caught.__enter__()
    warnings.simplefilter("always")
    if case == "transformers_first":
        from transformers import Trainer, TrainingArguments
    import pagedopt
    out["transformers_imported_by_pagedopt"] = case != "transformers_first" and "transformers" in sys.modules
    if case == "cannot":  # as if a future Python's enum refused the new members
        import pagedopt.integrations.transformers as integration
        def refuse(*args):
            raise RuntimeError("enum refused the member (simulated)")
        integration._add_enum_member = refuse
    from transformers import Trainer, TrainingArguments
    import transformers.trainer, transformers.training_args
    import _hf_tiny as tiny
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in got if w.category is RuntimeWarning]
    kwargs = tiny.run_kwargs(os.environ["OUT_DIR"], 1, 1, 0)
    def make(optim):
        try:
            args = TrainingArguments(optim=optim, **kwargs)
            opt = Trainer(model=tiny.make_model(0), args=args, train_dataset=tiny.Tokens(1)).create_optimizer()
            return type(getattr(opt, "optimizer", opt)).__name__
        except ValueError as e:
            return f"ValueError: {e}"
    out["pagedopt_paged_adamw_8bit"] = make("pagedopt_paged_adamw_8bit")
    out["adamw_torch"] = make("adamw_torch")
    out["nonsense"] = make("nonsense")
    if case == "off":
        import pagedopt.integrations.transformers as integration
        integration.register()
        out["after_register"] = make("pagedopt_paged_adamw_8bit")
    out["finders_left"] = [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("pagedopt")]
    from pagedopt.integrations import import_hooks
    out["awaited"] = sorted(import_hooks.awaited())  # modules not imported yet (deepspeed's integration)
    out["loaders"] = [type(m.__loader__).__name__ for m in (transformers.training_args, transformers.trainer)]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def auto_cases(tmp_path_factory):
    """{case: the child's report}, the four children run at once."""
    cases = {"pagedopt_first": {}, "transformers_first": {}, "off": {"PAGEDOPT_AUTO_REGISTER": "0"}, "cannot": {}}
    procs = {}
    for case, env in cases.items():
        env = {**os.environ, **env, "TESTS_DIR": TESTS_DIR, "OUT_DIR": str(tmp_path_factory.mktemp(case))}
        procs[case] = subprocess.Popen([sys.executable, "-c", AUTO_CHILD, case], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    reports = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{case}: {err[-4000:]}"
        reports[case] = json.loads(out.strip().splitlines()[-1])
    return reports


@pytest.mark.parametrize("case", ["pagedopt_first", "transformers_first"])
def test_import_pagedopt_names_the_optimizers(auto_cases, case):
    r = auto_cases[case]
    assert r["transformers_imported_by_pagedopt"] is False  # pagedopt waits for transformers' own import
    assert r["pagedopt_paged_adamw_8bit"] == "PagedAdamW8bit" and r["adamw_torch"] == "AdamW"
    assert "is not a valid OptimizerNames" in r["nonsense"]  # transformers' own message for other names
    assert r["warnings"] == [] and r["awaited"] in ([], ["deepspeed"])
    # the finder leaves sys.meta_path once nothing it waits for is still to be imported
    assert r["finders_left"] == (["_Finder"] if r["awaited"] else [])
    assert r["loaders"] == ["SourceFileLoader", "SourceFileLoader"]  # the modules keep their loaders


def test_names_off_until_register(auto_cases):
    r = auto_cases["off"]
    assert "pagedopt_paged_adamw_8bit is not a valid OptimizerNames" in r["pagedopt_paged_adamw_8bit"]
    assert r["after_register"] == "PagedAdamW8bit" and r["finders_left"] == []


def test_names_that_cannot_be_added_name_the_call_to_make(auto_cases):
    r = auto_cases["cannot"]
    assert len(r["warnings"]) == 1 and "enum refused the member (simulated)" in r["warnings"][0]
    message = r["pagedopt_paged_adamw_8bit"]
    assert message.startswith("ValueError: 'pagedopt_paged_adamw_8bit' is not a TrainingArguments optim name here")
    assert ("optimizer_cls_and_kwargs=pagedopt.integrations.transformers.optimizer_cls_and_kwargs"
            "('pagedopt_paged_adamw_8bit', args, model)") in message
    # other names as before, with transformers' own message
    assert r["adamw_torch"] == "AdamW" and "is not a valid OptimizerNames, please select one of" in r["nonsense"]


# ------------------------------------------------------------------ README section
def doc_section() -> str:
    """The README's "Hugging Face Trainer" section."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    m = re.search(r"^## Hugging Face Trainer\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "no '## Hugging Face Trainer' section in README.md"
    return m.group(1)


def test_command_line(tmp_path, monkeypatch):
    """The section's command line, through an HfArgumentParser built after register()."""
    (line,) = re.findall(r"```bash\n(.*?)\n```", doc_section(), re.S)
    argv = shlex.split(line)
    assert argv[:2] == ["python", "train.py"]
    monkeypatch.chdir(tmp_path)
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=argv[2:] + ["--use_cpu"])
    assert args.optim is transformers.training_args.OptimizerNames(argv[argv.index("--optim") + 1])
    given = dict(kv.split("=") for kv in argv[argv.index("--optim_args") + 1].split(","))
    model = tiny.make_model(SEED)
    opt = inner(Trainer(model=model, args=args, train_dataset=tiny.Tokens(DATA_SEED)).create_optimizer())
    assert type(opt) is expected_class(args.optim.value)
    assert opt.defaults["min_8bit_size"] == int(given["min_8bit_size"])
    assert opt.defaults["betas"] == (args.adam_beta1, float(given["beta2"]))


def test_readme_snippets(tmp_path, monkeypatch):
    """Every python block of the section, in order, in one namespace (given model and train_dataset)."""
    blocks = re.findall(r"```python\n(.*?)```", doc_section(), re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    ns = {"model": tiny.make_model(SEED), "train_dataset": tiny.Tokens(DATA_SEED)}
    for block in blocks:
        exec(compile(block, "README: Hugging Face Trainer", "exec"), ns)
    assert isinstance(ns["args"], TrainingArguments)


# ------------------------------------------------------------------ resume in a new process
RESUME = [("pagedopt_paged_adamw_8bit", None), ("pagedopt_adam", "optim_bits=8,min_8bit_size=2048,beta1=0.8"),
          ("pagedopt_adamw_32bit", None),
          # the engine's families: stacked states and warm-up schedules, a norm-scaled update, momentum buffers
          ("pagedopt_paged_ademamix_8bit", "beta3=0.999,t_alpha=4,t_beta3=5"), ("pagedopt_lamb_8bit", None),
          ("pagedopt_sgd_8bit", "momentum=0.9,nesterov=true")]
STEPS, AT = 6, 3
OTHER_SEED = 12345  # the resumed process starts from another initialisation: only the checkpoint can undo it

CHILD = textwrap.dedent("""
    import json, os, sys
    cfg = json.loads(sys.argv[1])
    sys.path.insert(0, cfg["tests_dir"])
    import torch
    import _hf_tiny as tiny
    from transformers import Trainer
    from transformers.training_args import OptimizerNames
    out = {"pagedopt_imported_first": "pagedopt" in sys.modules}
    for case in cfg["cases"]:
        # no register(), no import of pagedopt: unpickling the OptimizerNames member must do it
        args = torch.load(os.path.join(case["checkpoint"], "training_args.bin"), weights_only=False)
        r = {"optim": [type(args.optim).__name__, args.optim.value, args.optim is OptimizerNames(case["name"])],
             "optim_args": args.optim_args}
        args.output_dir = case["resume_dir"]
        model = tiny.make_model(cfg["other_seed"])
        counter = tiny.CountSteps()
        trainer = Trainer(model=model, args=args, train_dataset=tiny.Tokens(cfg["data_seed"]), callbacks=[counter])
        trainer.train(resume_from_checkpoint=case["checkpoint"])
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        r.update(steps=counter.steps, global_step=trainer.state.global_step, cls=type(opt).__name__)
        torch.save(model.state_dict(), case["result"])
        out[case["name"]] = r
    with open(cfg["report"], "w") as f:
        json.dump(out, f)
""")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    cases, uninterrupted = [], {}
    for name, optim_args in RESUME:
        d = root / name
        model = tiny.make_model(SEED)
        args = TrainingArguments(optim=name, optim_args=optim_args, **HYPER,
                                 **tiny.run_kwargs(str(d / "run"), STEPS, AT, SEED))
        Trainer(model=model, args=args, train_dataset=tiny.Tokens(DATA_SEED)).train()
        uninterrupted[name] = {k: v.clone() for k, v in model.state_dict().items()}
        cases.append({"name": name, "checkpoint": str(d / "run" / f"checkpoint-{AT}"),
                      "resume_dir": str(d / "resumed"), "result": str(d / "resumed.pt")})
    cfg = {"tests_dir": TESTS_DIR, "cases": cases, "other_seed": OTHER_SEED, "data_seed": DATA_SEED,
           "report": str(root / "report.json")}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(cfg["report"]) as f:
        report = json.load(f)
    return report, cases, uninterrupted


def test_training_args_bin_loads_in_fresh_process(resumed):
    report, cases, _ = resumed
    assert report["pagedopt_imported_first"] is False
    for (name, optim_args), case in zip(RESUME, cases):
        assert report[name]["optim"] == ["OptimizerNames", name, True]
        assert report[name]["optim_args"] == optim_args


@pytest.mark.parametrize("name", [n for n, _ in RESUME])
def test_resume_in_new_process_is_exact(resumed, name):
    report, cases, uninterrupted = resumed
    case = next(c for c in cases if c["name"] == name)
    r = report[name]
    assert r["cls"] == expected_class(name).__name__
    assert (r["steps"], r["global_step"]) == (STEPS - AT, STEPS)
    final = torch.load(case["result"], weights_only=True)
    want = uninterrupted[name]
    assert final.keys() == want.keys()
    # bit for bit: same data order, same RNG states, same optimizer states (all restored from the
    # checkpoint), the same deterministic CPU kernels -- no tolerance
    different = [k for k in want if not torch.equal(final[k], want[k])]
    assert not different, f"{name}: resumed weights differ from the uninterrupted run's in {different}"
    # and that equality is not trivial: the weights moved after the checkpoint, and the resumed
    # process started from other weights
    from safetensors.torch import load_file

    at_checkpoint = load_file(os.path.join(case["checkpoint"], "model.safetensors"))
    assert all(not torch.equal(at_checkpoint[k], want[k]) for k in at_checkpoint)
    other = tiny.make_model(OTHER_SEED).state_dict()
    assert all(not torch.equal(other[k], at_checkpoint[k]) for k in at_checkpoint)


def test_plain_sgd_name_keeps_no_state(tmp_path):
    """pagedopt_sgd without momentum: torch's plain SGD, every parameter's state only its step."""
    before = {k: v.clone() for k, v in tiny.make_model(SEED).state_dict().items()}
    model, args, trainer = train(tmp_path, "pagedopt_sgd_8bit")
    opt = inner(trainer.optimizer)
    assert opt.defaults["momentum"] == 0
    for p in model.parameters():
        assert set(opt.state[p]) == {"step"} and opt.state[p]["step"].item() == 2
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
