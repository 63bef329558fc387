"""Lightning: a LightningModule whose ``configure_optimizers`` returns a pagedopt optimizer and an LR
scheduler stepped every batch.

* ``Trainer.fit`` on the CPU, at 32-bit precision and with the ``bf16-mixed`` plugin (CPU autocast),
  gives the weights of the same steps written out by hand (``training_step`` under the plugin's
  autocast, ``backward``, ``opt.step()``, ``sched.step()``), and a new Trainer with a fresh module
  that resumes from the first epoch's checkpoint (``fit(..., ckpt_path=)``) ends with the
  uninterrupted run's weights, optimizer states and learning rate.
* ``16-mixed`` (fp16 autocast and Lightning's GradScaler) needs CUDA in Lightning
  (``precision="16-mixed"`` on the CPU turns into bf16-mixed with a warning). On the CPU its plugin
  is built explicitly (``MixedPrecision("16-mixed", "cpu")``, CPU fp16 autocast and
  ``torch.amp.GradScaler("cpu")``): Lightning hands our optimizer the scaler's ``grad_scale`` and
  ``found_inf`` (pagedopt optimizers set ``_step_supports_amp_scaling``, so Lightning leaves the
  unscaling to them), a batch with an inf input is skipped (weights and states unchanged, step
  counts one short, the scale halved) and the run equals the hand-written GradScaler loop. The
  same on a GPU with ``precision="16-mixed"`` is ``test_16_mixed_on_cuda`` (``@pytest.mark.cuda``).
* Gradient clipping: Lightning refuses ``gradient_clip_val`` under its mixed-precision plugins for an
  optimizer that unscales inside ``step()``; with ``opt._step_supports_amp_scaling = False`` (the
  README's advice) it clips, and equals the hand-written unscale_, clip_grad_norm_, step loop.

Tolerances: none. Lightning runs the same operations on the same tensors in the same order as the
hand-written loop; a checkpoint restores the optimizer (``load_state_dict``), the scheduler and the
loop position at an epoch boundary (a mid-epoch checkpoint restarts the data of its epoch from the
first batch unless the data loader is stateful, so it is not bit-exact by Lightning's design).
"""
import copy
import warnings

import pytest
import torch

import pagedopt

L = pytest.importorskip("lightning", reason="lightning is not installed (scripts/setup_tests.sh installs it)")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::pagedopt.paging.PagingFallbackWarning"),
              # Lightning's advice about dataloader workers, logging and the like; not under test
              pytest.mark.filterwarnings("ignore::UserWarning:lightning")]

EPOCHS, BATCHES, BATCH = 2, 4, 16
CLASSES = {"PagedAdamW8bit": dict(lr=1e-2, weight_decay=0.01), "AdamW32bit": dict(lr=1e-2, weight_decay=0.01),
           "Lion8bit": dict(lr=1e-3)}


class Net(L.LightningModule):
    """64 -> 128 -> 8 MLP: the first weight (8192 elements) gets 8-bit states from an 8-bit class."""

    def __init__(self, cls_name: str, seed: int = 0, amp_unscaling: bool = True):
        super().__init__()
        self.amp_unscaling = amp_unscaling
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
        self.cls_name = cls_name
        self.out_dtypes = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.out_dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self):
        opt = getattr(pagedopt, self.cls_name)(self.parameters(), **CLASSES[self.cls_name])
        if not self.amp_unscaling:  # GradScaler unscales the gradients before step(), so they can be clipped
            opt._step_supports_amp_scaling = False
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(inf_batch=None, device="cpu"):
    """BATCHES batches of BATCH random (x, y), in order; ``inf_batch``: that batch's first x is inf."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCHES * BATCH, 64, generator=g), torch.randn(BATCHES * BATCH, 8, generator=g)
    if inf_batch is not None:
        x[inf_batch * BATCH, 0] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.to(device), y.to(device)), batch_size=BATCH)


def trainer(root, epochs=EPOCHS, **kwargs):
    kwargs.setdefault("accelerator", "cpu")
    return L.Trainer(default_root_dir=str(root), max_epochs=epochs, devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def by_hand(module, loader, epochs, autocast_dtype=None, scaler=None, device="cpu", clip=None):
    """The steps Lightning makes, written out: returns the optimizer and scheduler."""
    module.to(device)
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            opt.zero_grad()
            with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = module.training_step(batch, i)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                if clip is not None:
                    scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            sched.step()
    return opt, sched


def assert_same_states(opt_a, opt_b, params_a, params_b):
    for p, q in zip(params_a, params_b):
        s, t = opt_a.state[p], opt_b.state[q]
        assert s.keys() == t.keys()
        for k in s:
            assert torch.equal(s[k].cpu(), t[k].cpu()), k  # Lightning moves the module back to the CPU after fit


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_fit_equals_hand_loop_and_resume_is_exact(tmp_path, cls_name, precision):
    module = Net(cls_name)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    first = trainer(tmp_path / "run", precision=precision, callbacks=[ckpt])
    first.fit(module, data())
    opt = first.optimizers[0]
    assert type(opt) is getattr(pagedopt, cls_name)
    assert module.out_dtypes == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    assert module.net[0].weight.dtype == torch.float32  # mixed precision keeps fp32 weights
    eight_bit = opt.state[module.net[0].weight]["state1"].dtype == torch.uint8
    assert eight_bit == ("8bit" in cls_name)
    assert [s["step"].item() for s in opt.state.values()] == [EPOCHS * BATCHES] * 4

    # the same steps by hand, from the same initial weights
    hand = Net(cls_name)
    hand_opt, hand_sched = by_hand(hand, data(), EPOCHS, torch.bfloat16 if precision == "bf16-mixed" else None)
    for (n, p), q in zip(module.named_parameters(), hand.parameters()):
        assert torch.equal(p, q), f"{n}: Lightning's fit differs from the hand-written loop"
    assert_same_states(opt, hand_opt, module.parameters(), hand.parameters())
    lr = first.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert lr == hand_sched.get_last_lr() and lr[0] < CLASSES[cls_name]["lr"]  # stepped every batch

    # resume from the end of the first epoch, in a new Trainer, with a module initialised elsewhere
    resumed_module = Net(cls_name, seed=7)
    resumed = trainer(tmp_path / "resumed", precision=precision)
    resumed.fit(resumed_module, data(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert resumed.global_step == first.global_step == EPOCHS * BATCHES
    for (n, p), q in zip(module.named_parameters(), resumed_module.parameters()):
        assert torch.equal(p, q), f"{n}: the resumed run differs from the uninterrupted one"
    assert_same_states(opt, resumed.optimizers[0], module.parameters(), resumed_module.parameters())
    assert resumed.lr_scheduler_configs[0].scheduler.get_last_lr() == lr
    # not trivially equal: the weights moved in the second epoch
    saved = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(saved["net.0.weight"], module.net[0].weight.detach())
    assert not torch.equal(saved["net.0.weight"], Net(cls_name, seed=7).net[0].weight.detach())


class Snapshots(Callback):
    """Weights and optimizer states before and after every batch, and the scaler's scale after it."""

    def __init__(self):
        self.before, self.after, self.scales = [], [], []

    @staticmethod
    def _take(pl_module, trainer):
        opt = trainer.optimizers[0]
        return ([p.detach().clone() for p in pl_module.parameters()],
                [{k: v.clone() for k, v in opt.state[p].items()} for p in pl_module.parameters() if p in opt.state])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(self._take(pl_module, trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self._take(pl_module, trainer))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def check_16_mixed(module, lightning_trainer, loader, hand_loader, device, skipped_batch):
    """Fit with the 16-mixed plugin and a batch of inf input: that step is skipped, the others are
    taken, and the whole run equals the hand-written GradScaler loop."""
    snaps = Snapshots()
    lightning_trainer.callbacks.append(snaps)
    init_scale = lightning_trainer.precision_plugin.scaler.get_scale()
    start = copy.deepcopy(module)  # the same initial weights for the loop by hand
    lightning_trainer.fit(module, loader)
    opt = lightning_trainer.optimizers[0]
    assert module.out_dtypes == {torch.float16}
    for i, ((w0, s0), (w1, s1)) in enumerate(zip(snaps.before, snaps.after)):
        same = all(torch.equal(a, b) for a, b in zip(w0, w1))
        assert same == (i == skipped_batch), f"batch {i}: weights unchanged = {same}"
        if i == skipped_batch:  # a skipped step changes no state either (the step counts included)
            for a, b in zip(s0, s1):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert snaps.scales[skipped_batch] == init_scale / 2 and snaps.scales[0] == init_scale
    assert [s["step"].item() for s in opt.state.values()] == [BATCHES - 1] * 4

    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    hand_opt, _ = by_hand(start, hand_loader, 1, torch.float16, scaler, device)
    for (n, p), q in zip(module.named_parameters(), start.parameters()):
        # Lightning's teardown moves the module back to the CPU; the loop by hand left it on the device
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"{n}: Lightning's 16-mixed fit differs from the GradScaler loop"
    assert_same_states(opt, hand_opt, module.parameters(), start.parameters())
    return snaps


@pytest.mark.parametrize("cls_name", ["PagedAdamW8bit", "AdamW32bit"])
def test_16_mixed_grad_scaler_path_on_cpu(tmp_path, cls_name):
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
    lightning_trainer = trainer(tmp_path, epochs=1, plugins=[plugin])
    check_16_mixed(Net(cls_name), lightning_trainer, data(inf_batch=2), data(inf_batch=2), "cpu", skipped_batch=2)


def precision_kwargs(precision):
    """Trainer arguments for a precision; "16-mixed" on the CPU through the explicit plugin."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    return dict(precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_gradient_clipping(tmp_path, precision):
    """Under Lightning's mixed-precision plugins, an optimizer that unscales inside step() (ours, as
    torch's fused ones) gets no gradient_clip_val: Lightning refuses it, because it would clip scaled
    gradients. With ``opt._step_supports_amp_scaling = False`` (the attribute GradScaler and
    Lightning read) the scaler unscales the gradients in place first, as for any torch optimizer, and
    skips steps with inf/NaN gradients itself; clipping then works and equals the hand-written
    unscale_, clip_grad_norm_, step. At 32-true precision clipping works as it is."""
    clip = 1e-3  # far below the gradients' norm (1.0 to 1.3 here): every step is clipped
    if precision != "32-true":
        with pytest.raises(RuntimeError, match="PagedAdamW8bit, does not allow for gradient clipping"):
            trainer(tmp_path / "refused", epochs=1, gradient_clip_val=clip,
                    **precision_kwargs(precision)).fit(Net("PagedAdamW8bit"), data())
    module = Net("PagedAdamW8bit", amp_unscaling=precision == "32-true")
    start = copy.deepcopy(module)
    lightning_trainer = trainer(tmp_path / "run", epochs=1, gradient_clip_val=clip, **precision_kwargs(precision))
    lightning_trainer.fit(module, data())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if precision == "16-mixed" else None
    dtype = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    hand_opt, _ = by_hand(start, data(), 1, dtype, scaler, clip=clip)
    for (n, p), q in zip(module.named_parameters(), start.parameters()):
        assert torch.equal(p, q), f"{n}: Lightning's clipped fit differs from the hand-written loop"
    assert_same_states(lightning_trainer.optimizers[0], hand_opt, module.parameters(), start.parameters())
    unclipped = Net("PagedAdamW8bit", amp_unscaling=precision == "32-true")
    by_hand(unclipped, data(), 1, dtype, copy.deepcopy(scaler))
    assert not torch.equal(unclipped.net[0].weight, module.net[0].weight)  # the clipping did something


@pytest.mark.cuda
@pytest.mark.parametrize("cls_name", ["PagedAdamW8bit", "AdamW32bit"])
def test_16_mixed_on_cuda(tmp_path, cls_name):
    """Trainer(accelerator="gpu", precision="16-mixed"): Lightning's own CUDA GradScaler."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer = trainer(tmp_path, epochs=1, accelerator="gpu", precision="16-mixed")
    assert isinstance(lightning_trainer.precision_plugin, MixedPrecision)
    snaps = check_16_mixed(Net(cls_name), lightning_trainer, data(inf_batch=2), data(inf_batch=2, device="cuda"),
                           "cuda", skipped_batch=2)
    # the states were on the GPU while it trained (the snapshots after the last batch); Lightning's
    # teardown moves the optimizer's states to the CPU once fit() ends, as it does the module
    last_states = snaps.after[-1][1]
    assert len(last_states) == 4 and all(s["state1"].is_cuda for s in last_states)


def test_16_mixed_on_the_cpu_becomes_bf16(tmp_path):
    """What Lightning does with precision="16-mixed" on the CPU (why the CPU test builds the plugin)."""
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        t = trainer(tmp_path, epochs=1, precision="16-mixed")
    assert t.precision_plugin.precision == "bf16-mixed" and t.precision_plugin.scaler is None
