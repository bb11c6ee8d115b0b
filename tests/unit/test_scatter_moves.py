"""Scatter copies a segment's tensors into a history's outputs as plain byte moves where
every tensor lands as one contiguous block, and tensor by tensor where not; both give the
same bytes. The anonymous mappings the tiers use are private."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import pytest
import torch

from tieredkv._cache.gather import Scatter
from tieredkv.backends._buffers import anonymous, prefaulted
from tieredkv.payload import ALIGN, SegmentHeader, plan_segment


def turns(n: int, token_dim: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    out = []
    for t in range(n):
        tokens = 5 + 3 * t
        shape_k = [tokens, 4, 8]
        shape_v = [tokens, 33]
        if token_dim == 1:
            shape_k = [4, tokens, 8]
            shape_v = [33, tokens]
        out.append(
            {
                "k": torch.randn(*shape_k, generator=g).half(),
                "v": torch.randint(-9, 9, shape_v, generator=g, dtype=torch.int8),
                "none": torch.empty(tokens, 0) if token_dim == 0 else torch.empty(0, tokens),
            }
        )
    return out


def segments(
    parts: list[dict[str, torch.Tensor]], token_dim: int
) -> tuple[list[SegmentHeader], list[memoryview]]:
    headers: list[SegmentHeader] = []
    bufs: list[memoryview] = []
    for seq, part in enumerate(parts):
        plan = plan_segment("s", seq, part, token_dim=token_dim, answer_tokens=1)
        buf = memoryview(bytearray(plan.length))
        plan.write_into(buf)
        headers.append(plan.header)
        bufs.append(buf)
    return headers, bufs


def scatter_all(scatter: Scatter, bufs: list[memoryview]) -> None:
    for item, buf in enumerate(bufs):
        for k, (start, stop) in enumerate(scatter.spans[item]):
            scatter(item, k, buf[start:stop])


@pytest.mark.parametrize("span", [None, ALIGN])
def test_contiguous_outputs_get_byte_moves_and_the_exact_bytes(span: int | None) -> None:
    parts = turns(3, 0)
    headers, bufs = segments(parts, 0)
    want = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    out = {name: torch.full_like(t, 7) for name, t in want.items()}
    scatter = Scatter(headers, out, 0, span)
    scatter_all(scatter, bufs)
    for name, t in want.items():
        assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    assert all(plan is not None for plan in scatter._plans.values())


def test_outputs_longer_than_the_history_keep_their_tail() -> None:
    parts = turns(2, 0)
    headers, bufs = segments(parts, 0)
    want = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    out = {
        name: torch.full((t.shape[0] + 4, *t.shape[1:]), 3).to(t.dtype) for name, t in want.items()
    }
    scatter_all(Scatter(headers, out, 0, None), bufs)
    for name, t in want.items():
        assert torch.equal(out[name][: t.shape[0]], t)
        assert torch.equal(out[name][t.shape[0] :], torch.full_like(out[name][t.shape[0] :], 3))


@pytest.mark.parametrize("span", [None, ALIGN])
def test_turns_laid_out_alike_are_planned_once_per_load_and_land_in_their_places(
    span: int | None,
) -> None:
    """Turns of the same tensors and token count share their specs (``plan_segment``
    remembers layouts): a load cuts them into spans once and makes one template of moves
    per span, which each segment shifts to its own place along the outputs; the last
    turn, cut at a fork point (``takes``), gets its own. Every byte lands where it
    belongs."""
    g = torch.Generator().manual_seed(7)
    parts = [
        {
            "k": torch.randn(6, 4, 128, generator=g).half(),
            "v": torch.randint(-9, 9, (6, 1100), generator=g, dtype=torch.int8),
        }
        for _ in range(4)
    ]
    headers, bufs = segments(parts, 0)
    assert all(h.tensors is headers[0].tensors for h in headers)
    takes = [6, 6, 6, 2]
    want = {
        name: torch.cat([p[name][:take] for p, take in zip(parts, takes, strict=True)])
        for name in parts[0]
    }
    out = {
        name: torch.full((t.shape[0] + 3, *t.shape[1:]), 5).to(t.dtype) for name, t in want.items()
    }
    scatter = Scatter(headers, out, 0, span, takes=takes)
    assert all(s is scatter.spans[0] for s in scatter.spans)
    scatter_all(scatter, bufs)
    for name, t in want.items():
        assert torch.equal(out[name][: t.shape[0]], t), name
        assert torch.equal(out[name][t.shape[0] :], torch.full_like(out[name][t.shape[0] :], 5))
    spans = len(scatter.spans[0])
    assert span is None or spans > 1
    assert len(scatter._templates) == 2 * spans  # (6 tokens taken, 2 taken) x spans
    assert all(plan is not None for plan in scatter._plans.values())
    assert len(scatter._plans) == 4 * spans


def test_non_contiguous_outputs_and_other_token_dims_copy_tensor_by_tensor() -> None:
    parts = turns(3, 1)
    headers, bufs = segments(parts, 1)
    want = {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}
    out = {name: torch.zeros_like(t) for name, t in want.items()}
    scatter = Scatter(headers, out, 1, None)
    scatter_all(scatter, bufs)
    for name, t in want.items():
        assert torch.equal(out[name], t)
    assert scatter._plans == {}  # token dim 1: never planned as byte moves

    parts = turns(2, 0)
    headers, bufs = segments(parts, 0)
    want = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    wide = {
        name: torch.zeros(t.shape[0], 2, *t.shape[1:], dtype=t.dtype) for name, t in want.items()
    }
    out = {name: w[:, 0] for name, w in wide.items()}  # every other row: not contiguous
    scatter = Scatter(headers, out, 0, None)
    scatter_all(scatter, bufs)
    for name, t in want.items():
        assert torch.equal(out[name], t)
        assert not wide[name][:, 1].any()  # nothing written between the rows
    assert all(plan is None for plan in scatter._plans.values())


@pytest.mark.parametrize("make", [anonymous, prefaulted])
def test_anonymous_mappings_are_private(make: Callable[[int], mmap.mmap]) -> None:
    buf = make(4 * mmap.PAGESIZE)
    try:
        buf[:4] = b"pare"
        pid = os.fork()
        if pid == 0:  # the child writes; a shared mapping would show it to the parent
            buf[:4] = b"chld"
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert os.WEXITSTATUS(status) == 0
        assert buf[:4] == b"pare"
        assert bytes(buf[4 : 4 * mmap.PAGESIZE]) == bytes(4 * mmap.PAGESIZE - 4)
    finally:
        buf.close()
