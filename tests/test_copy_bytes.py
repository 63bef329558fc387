"""pagedopt::copy_bytes_ (csrc/copy_bytes.cpp): many byte copies in one call, for the host-resident
pager's runs. Byte for byte equal to copy_, pair by pair; every pair checked before any byte moves,
and the error names the pair; on CUDA, queued on the current stream."""
from __future__ import annotations

import pytest
import torch

import pagedopt  # noqa: F401  (loads the extension)



def test_every_build_has_the_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("pagedopt::copy_bytes_", "CompositeExplicitAutograd")


def _pairs(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (1, 7, 256, 4099)]
    srcs.append(torch.randn(33, 5, generator=g))  # any dtype: bytes are bytes
    dsts = [torch.zeros(s.numel() * s.element_size(), dtype=torch.uint8, device=device) for s in srcs]
    return dsts, srcs


def test_cpu_pairs_are_copied_byte_for_byte():
    dsts, srcs = _pairs()
    torch.ops.pagedopt.copy_bytes_(dsts, srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.reshape(-1).view(torch.uint8))
    torch.ops.pagedopt.copy_bytes_([], [])  # nothing to do


@pytest.mark.parametrize("bad", ["size", "count", "strided"])
def test_a_bad_pair_is_named_and_nothing_is_copied(bad):
    dsts, srcs = _pairs(1)
    before = [d.clone() for d in dsts]
    if bad == "size":
        dsts[3] = torch.zeros(dsts[3].numel() + 1, dtype=torch.uint8)
        before[3] = dsts[3].clone()
        match = "pair 3 copies 4099 bytes into 4100"
    elif bad == "count":
        srcs = srcs[:-1]
        match = "5 destinations for 4 sources"
    else:
        srcs[4] = srcs[4].t()
        match = "pair 4 is not contiguous"
    with pytest.raises(RuntimeError, match=match):
        torch.ops.pagedopt.copy_bytes_(dsts, srcs)
    for d, b in zip(dsts, before):
        assert torch.equal(d, b)  # the good pairs before the bad one did not move either


@pytest.mark.cuda
def test_cuda_pairs_in_both_directions_on_the_current_stream():
    from pagedopt.paging import paging_unavailable_reason

    reason = paging_unavailable_reason("cuda:0")
    if reason is not None:
        pytest.skip(reason)
    dsts, srcs = _pairs(2, device="cuda")
    pinned = [torch.ops.pagedopt.pinned_empty([s.numel() * s.element_size()], torch.uint8) for s in srcs]
    for p, s in zip(pinned, srcs):
        p.copy_(s.reshape(-1).view(torch.uint8))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the copies must wait for this, queued before them on the same stream
        torch.ops.pagedopt.copy_bytes_(dsts, pinned)  # host to device
        back = [torch.zeros_like(p) for p in pinned]
        torch.ops.pagedopt.copy_bytes_(back, dsts)  # device to (pageable) host
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    for d, b, s in zip(dsts, back, srcs):
        want = s.reshape(-1).view(torch.uint8)
        assert torch.equal(d.cpu(), want) and torch.equal(b, want)
    before = [d.clone() for d in dsts]
    with pytest.raises(RuntimeError, match="pair 1 copies 7 bytes into 8"):
        torch.ops.pagedopt.copy_bytes_([dsts[0], torch.zeros(8, dtype=torch.uint8, device="cuda")],
                                       [torch.zeros_like(pinned[0]), pinned[1]])
    assert all(torch.equal(d, b) for d, b in zip(dsts, before))  # pair 0 did not move
