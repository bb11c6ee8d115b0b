"""Real segments for tier tests: built with :func:`tieredkv.payload.plan_segment` (the
segments, buffers and ``store``/``read_back`` are the contract kit's, :mod:`tieredkv.testing`).

A :class:`Segment` owns an anonymous ``mmap`` (page-aligned, as the cache's buffers are)
holding the serialized segment, and remembers its exact bytes so a test can compare what a
tier gives back byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from tieredkv.payload import (
    PREFIX,
    _encode_laid_out,
    _pack_prefix,
    align_up,
    hash_body,
    parse_header,
)
from tieredkv.testing import (
    Segment,
    aligned_buffer,
    make_segment,
    read_back,
    store,
    unaligned_buffer,
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
