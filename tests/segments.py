"""Real segments for tier tests: built with :func:`tieredkv.payload.plan_segment`.

A :class:`Segment` owns an anonymous ``mmap`` (page-aligned, as the cache's buffers are)
holding the serialized segment, and remembers its exact bytes so a test can compare what a
tier gives back byte for byte.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import torch

from tieredkv.backends.base import SegmentKey, Tier
from tieredkv.payload import (
    PREFIX,
    SegmentHeader,
    _encode_laid_out,
    _pack_prefix,
    align_up,
    hash_body,
    parse_header,
    plan_segment,
)

__all__ = [
    "Segment",
    "forge",
    "SegmentFactory",
    "aligned_buffer",
    "make_segment",
    "read_back",
    "seg",
    "store",
    "unaligned_buffer",
]

TOKEN_BYTES = 2 * 64 * 2
"""Bytes per token of :func:`make_segment`'s two int16 tensors of width 64."""


class Segment:
    """One serialized segment in an anonymous mmap, plus its expected bytes."""

    def __init__(self, session: str, seq: int, tokens: int, *, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tensors = {
            name: torch.randint(-(2**15), 2**15, (tokens, 64), dtype=torch.int16, generator=gen)
            for name in ("k", "v")
        }
        plan = plan_segment(session, seq, tensors, token_dim=0, answer_tokens=seq + 1)
        self.key: SegmentKey = (session, seq)
        self.header: SegmentHeader = plan.header
        self.length = plan.length
        self._mm = mmap.mmap(-1, plan.length)
        self.view = memoryview(self._mm)
        plan.write_into(self.view)
        self.data = bytes(self.view)

    def close(self) -> None:
        self.view.release()
        self._mm.close()


def forge(data: bytes, **changes: Any) -> bytes:
    """The segment ``data`` with its header's fields changed, as a forger who can write the
    directory would make it: the header laid out afresh, the original body bytes after it,
    the file as long as that body needs, and a correct CRC and body hash. So only what the
    header says can give it away."""
    old, _ = parse_header(data, "original")
    header, header_bytes = _encode_laid_out(msgspec.structs.replace(old, **changes))
    body = data[old.body_offset : old.body_offset + old.body_len]
    buf = bytearray(align_up(header.body_offset + len(body)))
    buf[PREFIX.size : PREFIX.size + len(header_bytes)] = header_bytes
    buf[header.body_offset : header.body_offset + len(body)] = body
    _pack_prefix(buf, header_bytes, hash_body(bytes(buf[PREFIX.size + len(header_bytes) :])))
    return bytes(buf)


def make_segment(session: str, seq: int, tokens: int, *, seed: int = 0) -> Segment:
    """A segment of ``tokens`` tokens (``TOKEN_BYTES`` each) with seeded random content."""
    return Segment(session, seq, tokens, seed=seed)


@contextmanager
def aligned_buffer(length: int) -> Iterator[memoryview]:
    """A page-aligned, zeroed, writable buffer of ``length`` bytes."""
    mm = mmap.mmap(-1, length)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        mm.close()


@contextmanager
def unaligned_buffer(length: int) -> Iterator[memoryview]:
    """A writable buffer of ``length`` bytes that starts 1 byte past a page boundary."""
    mm = mmap.mmap(-1, length + 4096)
    whole = memoryview(mm)
    view = whole[1 : 1 + length]
    try:
        yield view
    finally:
        view.release()
        whole.release()
        mm.close()


SegmentFactory = Callable[..., Segment]


@pytest.fixture
def seg() -> Iterator[SegmentFactory]:
    """Build real segments; their buffers are closed after the test."""
    made: list[Segment] = []

    def make(session: str = "s", seq: int = 0, tokens: int = 8, seed: int = 0) -> Segment:
        s = make_segment(session, seq, tokens, seed=seed)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


async def store(tier: Tier, s: Segment) -> None:
    """Reserve and write ``s`` (the reservation must succeed)."""
    assert tier.reserve(s.key, s.length)
    await tier.write(s.key, s.view)


async def read_back(tier: Tier, s: Segment, *, aligned: bool = True) -> bytes:
    """The bytes ``tier`` holds for ``s``, read into an aligned or unaligned buffer."""
    buffer = aligned_buffer if aligned else unaligned_buffer
    with buffer(tier.length(s.key)) as out:
        await tier.read([s.key], [out])
        return bytes(out)
