"""Accelerate, single process on the CPU: prepare() wraps a pagedopt optimizer, save_state() and
load_state() carry it through a checkpoint, and a resumed run equals an uninterrupted one."""
import pytest
import torch

import pagedopt

accelerate = pytest.importorskip("accelerate")

CLASSES = [pagedopt.AdamW8bit, pagedopt.PagedAdamW8bit, pagedopt.AdamW32bit]


def make_model():
    torch.manual_seed(0)
    # 64*96 = 6144 weights >= min_8bit_size: 8-bit states; biases keep 32-bit states
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def run(accelerator, model, opt, steps):
    for i in steps:
        x, y = batch(i)
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_prepare_save_state_load_state(cls, tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = make_model()
    model, opt = acc.prepare(model, cls(model.parameters(), lr=1e-2))
    assert isinstance(opt.optimizer, cls)  # prepare() keeps our optimizer inside its wrapper
    run(acc, model, opt, range(3))
    acc.save_state(str(tmp_path / "ckpt"))

    acc2 = Accelerator(cpu=True)
    model2 = make_model()
    opt2 = cls(model2.parameters(), lr=1e-2)
    model2, opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(str(tmp_path / "ckpt"))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for k, v in opt.optimizer.state[p].items():
            assert torch.equal(v, opt2.optimizer.state[q][k]), k

    run(acc, model, opt, range(3, 6))
    run(acc2, model2, opt2, range(3, 6))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    eight_bit = opt2.optimizer.state[model2[0].weight]["state1"].dtype == torch.uint8
    assert eight_bit == ("8bit" in cls.__name__)
