"""A segment as pieces (``SegmentPlan.pieces``: its header, the tensors' own bytes and the
zero padding), what a Redis append sends instead of a serialized copy: joined, exactly the
bytes ``write_into`` serializes; the tensors' bytes are views of their memory, never
copies; and the pieces cut into values and framed in the Redis protocol byte for byte as
redis-py frames the joined value."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from redis.asyncio.connection import Connection

from tieredkv.backends._redis_client import Joined, _packed
from tieredkv.backends._redis_commit import cut
from tieredkv.errors import CorruptSegmentError
from tieredkv.payload import PREFIX, parse_header, plan_segment, verify_segment

MiB = 1 << 20


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _serialized(plan: object) -> bytes:
    buf = bytearray(plan.length)  # type: ignore[attr-defined]
    plan.write_into(memoryview(buf))  # type: ignore[attr-defined]
    return bytes(buf)


@pytest.mark.parametrize(
    ("tokens", "dtype", "width"),
    [
        (64, torch.bfloat16, 1024),  # tensors of 128 KiB: aligned for landing
        (3, torch.float32, 5),  # tiny tensors: 8-byte alignment only, padding between
        (77, torch.int8, 4097),  # odd sizes
        (1, torch.float64, 1),
    ],
)
def test_pieces_join_into_the_serialized_segment_and_view_the_tensors(
    tokens: int, dtype: torch.dtype, width: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    tensors = {
        f"l{i}.{w}": (torch.rand(tokens, width, generator=gen) * 100).to(dtype)
        for i in range(4)
        for w in "kv"
    }
    plan = plan_segment("s", 3, tensors, token_dim=0, answer_tokens=2, created=1.5)
    pieces = plan.pieces()
    assert pieces is not None
    joined = b"".join(pieces)
    assert joined == _serialized(plan)
    verify_segment(memoryview(joined), "pieces")
    # every tensor is one piece: a view of the tensor's own memory
    at = {_address(p): len(p) for p in pieces if len(p)}
    for t in tensors.values():
        assert at.get(t.data_ptr()) == t.nbytes


def test_unsealed_pieces_parse_refuse_to_verify_and_seal_into_the_segment() -> None:
    """``pieces(sealed=False)``: the same bytes but the prefix, which names a body hash of
    0 with a matching CRC (its header parses, a read refuses the body); ``seal`` writes
    the real hash, after which they join into the serialized segment."""
    tensors = {f"l{i}": torch.arange(i, i + 4096, dtype=torch.int32) for i in range(3)}
    plan = plan_segment("s", 1, tensors, token_dim=0, answer_tokens=1)
    pieces = plan.pieces(sealed=False)
    assert pieces is not None
    header, body_hash = parse_header(pieces[0], "unsealed")
    assert (header.session, header.seq, body_hash) == ("s", 1, 0)
    want = _serialized(plan)
    joined = b"".join(pieces)
    assert joined[PREFIX.size :] == want[PREFIX.size :]
    with pytest.raises(CorruptSegmentError, match="body checksum mismatch"):
        verify_segment(memoryview(joined), "unsealed")
    plan.seal(pieces)
    assert b"".join(pieces) == want
    plan.seal(pieces)  # (again: the same hash)
    assert b"".join(pieces) == want


def test_pieces_hash_the_bytes_as_they_are_when_asked() -> None:
    """A tensor changed after ``pieces`` hashed it: the joined bytes carry the change, and
    their hash, computed before, refuses them (never a mix that verifies)."""
    tensors = {"k": torch.arange(4096, dtype=torch.int32).reshape(64, 64)}
    plan = plan_segment("s", 0, tensors, token_dim=0, answer_tokens=1)
    pieces = plan.pieces()
    assert pieces is not None
    tensors["k"][10, 3] = -1
    joined = b"".join(pieces)
    now = _serialized(plan)  # (the segment of the tensors as they are now)
    assert joined[len(pieces[0]) :] == now[len(pieces[0]) :]
    assert joined[: len(pieces[0])] != now[: len(pieces[0])]  # (its hash: of before)
    with pytest.raises(CorruptSegmentError, match="body checksum mismatch"):
        verify_segment(memoryview(joined), "changed")


@pytest.mark.parametrize("kind", ["strided", "transposed", "negative view"])
def test_a_tensor_that_is_not_its_bytes_gets_no_pieces(kind: str) -> None:
    base = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    if kind == "strided":
        t = base[:, ::2]
    elif kind == "transposed":
        t = base.t()
    else:
        t = torch._neg_view(base)  # (its bytes are not its values)
    plan = plan_segment(
        "s", 0, {"a": torch.ones(t.shape[0], 4), "b": t}, token_dim=0, answer_tokens=1
    )
    assert plan.pieces() is None
    _serialized(plan)  # (written by copying, as before)


def test_cut_makes_values_of_the_pieces_without_copying() -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    pieces = [memoryview(data)[a:b] for a, b in [(0, 100), (100, 100), (100, 5000), (5000, 10240)]]
    values = cut(pieces, 4096)
    assert [b"".join(v) for v in values] == [data[i : i + 4096] for i in range(0, len(data), 4096)]
    assert all(len(p) for v in values for p in v)  # (no empty piece sent)
    assert [len(v) for v in values] == [2, 2, 1]
    assert all(p.obj is data for v in values for p in v)
    assert cut([], 4096) == []


def test_a_joined_value_is_framed_as_redis_py_frames_its_bytes() -> None:
    conn = Connection()
    small = bytes(range(200))
    large = memoryview(bytes(range(256)) * 1024)  # 256 KiB
    value = [memoryview(small), large, memoryview(b"\0" * 40), large[:70000]]
    joined = b"".join(value)
    commands = [
        ("SET", "k:0", Joined(value), "PX", 300_000, "NX"),
        ("SET", "k:1", large, "PX", 300_000, "NX"),
        ("EVALSHA", "abc", 1, "m", 7, b"\x00\xff"),
    ]
    plain: list[tuple[Any, ...]] = [
        ("SET", "k:0", joined, "PX", 300_000, "NX"),
        ("SET", "k:1", large, "PX", 300_000, "NX"),
        ("EVALSHA", "abc", 1, "m", 7, b"\x00\xff"),
    ]
    packed = _packed(conn, commands)
    assert b"".join(bytes(c) for c in packed) == b"".join(
        bytes(c) for c in conn.pack_commands(plain)
    )
    # the large pieces go out as they are, not copied into the framing
    sent = {id(c.obj) for c in packed if isinstance(c, memoryview)}
    assert id(large.obj) in sent
    assert sum(len(c) for c in packed if isinstance(c, bytes)) < 4096
