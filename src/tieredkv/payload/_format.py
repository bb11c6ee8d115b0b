"""The segment format: the prefix, the header and its fields, the dtypes a segment can
hold, and the body hash (the layout is drawn in :mod:`tieredkv.payload`)."""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import msgspec
import torch
import xxhash

__all__ = [
    "ALIGN",
    "INCARNATION_BYTES",
    "LAND_ALIGN",
    "LAND_MIN",
    "MAC_BYTES",
    "MAGIC",
    "MAX_SESSION_KEY_BYTES",
    "PREFIX",
    "RETIRED_CODEC",
    "RETIRED_SEQ",
    "SEGMENT_ID_BYTES",
    "Schema",
    "SegmentHeader",
    "TensorSpec",
    "align_up",
    "dtype_of",
    "hash_body",
    "hashed_from",
    "header_schema",
    "inherits",
    "is_retirement",
    "plain_header",
    "segment_id",
]

MAGIC = b"TKVSEG\x00\x01"
PREFIX = struct.Struct("<8sII Q")
"""magic, header length, header CRC, body hash."""
ALIGN = 4096
"""Stored segments are padded to a multiple of this (the O_DIRECT block size)."""
_TENSOR_ALIGN = 64
LAND_ALIGN = 512
"""Where a tensor of at least :data:`LAND_MIN` bytes starts in a segment: a multiple of this
from the segment's start (the body offset of such a segment is one too). A read can then
land the tensor's bytes straight in their place in an output with O_DIRECT, which needs
file offsets, lengths and addresses in multiples of the device's logical block size
(512 bytes on most SSDs), instead of landing them in a buffer and copying them."""
LAND_MIN = 64 << 10
"""Tensors at least this large are placed at multiples of :data:`LAND_ALIGN` (the padding,
at most 448 bytes more than before, is under 0.7% of such a tensor)."""
MAX_SESSION_KEY_BYTES = 65536
RETIRED_CODEC = "tieredkv-retired"
RETIRED_SEQ = 2**31 - 1
"""A *retirement marker* is the segment ``(session, RETIRED_SEQ)`` with codec
:data:`RETIRED_CODEC` (one token of one byte): ``session`` left (dropped, or its last copy
evicted) while forks still list some of its turns, which stay stored, under its key, for
them only. A persistent tier that holds such a turn holds the marker too, so that a
restart does not bring the conversation back."""
INCARNATION_BYTES = 16
SEGMENT_ID_BYTES = 16
"""The length of a :func:`segment_id` (what a fork's first turn lists in ``base_ids``)."""
MAC_BYTES = 32
_NO_INCARNATION = bytes(INCARNATION_BYTES)
_NO_MAC = bytes(MAC_BYTES)

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


_ITEMSIZE: dict[str, int] = {name: d.itemsize for name, d in _DTYPES.items()}


def align_up(n: int, to: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return -(-n // to) * to


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor in a segment: name, dtype name, shape, offset in the body, byte length."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SegmentHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Self-description of a stored segment (enough to rebuild the index after a restart).

    :param session: the session key
    :param seq: the segment's turn index within the session, from 0
    :param tokens: tokens in this segment
    :param token_dim: the dimension along which segments join (non-negative)
    :param answer_tokens: the model's answer length recorded with this turn
    :param codec: what the tensors hold (``"kv"``, or a storage-efficient codec's name)
    :param tensors: the tensors, in append order
    :param body_offset: where the body starts in the segment
    :param body_len: body length in bytes
    :param created: wall-clock time the segment was written (seconds since the epoch)
    :param incarnation: the session's residency in an authenticated tier (zeros otherwise)
    :param body_mac: keyed BLAKE2b of everything after the header (zeros if not
        authenticated)
    :param mac: keyed BLAKE2b of this header with ``mac`` zeroed (zeros if not authenticated)
    :param base: on the first turn a fork stores, the history it starts from, by reference:
        one ``(session, seq, tokens)`` per earlier turn (the segment stored under that key,
        of which the first ``tokens`` are part of this history); empty otherwise
    :param parent: on the first turn a fork stores, the conversation it was forked from,
        where that is not the owner of the last turn ``base`` lists (a fork of a fork at a
        point inside the turns it inherited); empty otherwise
    :param base_ids: on the first turn a fork stores, per ``base`` entry, the
        :func:`segment_id` of the segment the fork inherits there: what tells it from
        another history's turn stored later under the same key (its parent dropped, or a
        server that restarted empty, and a new conversation started under the parent's
        key). Empty in forks written before it existed, and otherwise
    """

    version: int = 1
    session: str
    seq: int
    tokens: int
    token_dim: int
    answer_tokens: int
    codec: str = "kv"
    tensors: tuple[TensorSpec, ...]
    body_offset: int
    body_len: int
    created: float = 0.0
    incarnation: bytes = _NO_INCARNATION
    body_mac: bytes = _NO_MAC
    mac: bytes = _NO_MAC
    base: tuple[tuple[str, int, int], ...] = ()
    parent: str = ""
    base_ids: tuple[bytes, ...] = ()

    @property
    def length(self) -> int:
        """Bytes the segment occupies in a tier (padded to :data:`ALIGN`)."""
        return align_up(self.body_offset + self.body_len)

    @property
    def authenticated(self) -> bool:
        """Whether the header carries a MAC (it may still be a wrong one)."""
        return self.mac != _NO_MAC


class Schema(msgspec.Struct, frozen=True):
    """What every segment of one session must agree on: names, dtypes, non-token shapes."""

    token_dim: int
    codec: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    """Each tensor's shape with the token dimension set to -1."""

    def describe_difference(self, other: Schema) -> str | None:
        """A sentence naming the first difference from ``other``, or ``None`` if they agree."""
        if self.names != other.names:
            return f"tensor names {list(other.names)} differ from earlier {list(self.names)}"
        if self.token_dim != other.token_dim:
            return f"token_dim {other.token_dim} differs from earlier {self.token_dim}"
        if self.codec != other.codec:
            return f"codec {other.codec!r} differs from earlier {self.codec!r}"
        for name, da, db in zip(self.names, self.dtypes, other.dtypes, strict=True):
            if da != db:
                return f"tensor {name!r} has dtype {db} where earlier segments had {da}"
        for name, sa, sb in zip(self.names, self.shapes, other.shapes, strict=True):
            if sa != sb:
                return (
                    f"tensor {name!r} has non-token shape {_shape_str(sb)} where earlier "
                    f"segments had {_shape_str(sa)}"
                )
        return None


def _shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join("T" if d == -1 else str(d) for d in shape) + ")"


class _HeaderEncoder:
    """Encodes a header without the fields it leaves empty among those added since the
    format's first segments (``base``, then ``parent``, then ``base_ids``), so that a
    header encodes byte for byte as it did before they existed: one that references no
    earlier history (every segment but a fork's first) without any, a fork's first turn
    without ``base_ids`` (written before they existed) or ``parent`` (it names none)
    without those."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._plain = self._without("_PlainHeader", {"base", "parent", "base_ids"})
        self._fork = self._without("_ForkHeader", {"parent", "base_ids"})
        self._named = self._without("_NamedForkHeader", {"base_ids"})

    @staticmethod
    def _without(name: str, left: set[str]) -> tuple[type, list[str]]:
        fields = [f for f in msgspec.structs.fields(SegmentHeader) if f.name not in left]
        kind = msgspec.defstruct(
            name,
            [(f.name, f.type) if f.required else (f.name, f.type, f.default) for f in fields],
            kw_only=True,
        )
        return kind, [f.name for f in fields]

    def encode(self, header: SegmentHeader) -> bytes:
        if header.base_ids:
            return self._encoder.encode(header)
        if header.parent:
            kind, names = self._named
        else:
            kind, names = self._fork if header.base else self._plain
        return self._encoder.encode(kind(**{n: getattr(header, n) for n in names}))


_header_encoder = _HeaderEncoder()
_header_decoder = msgspec.msgpack.Decoder(SegmentHeader)


def header_schema(header: SegmentHeader) -> Schema:
    """The schema a segment's header implies (what every segment of its session shares)."""
    return Schema(
        token_dim=header.token_dim,
        codec=header.codec,
        names=tuple(t.name for t in header.tensors),
        dtypes=tuple(t.dtype for t in header.tensors),
        shapes=tuple(
            tuple(-1 if i == header.token_dim else d for i, d in enumerate(t.shape))
            for t in header.tensors
        ),
    )


def plain_header(header: SegmentHeader) -> SegmentHeader:
    """``header`` without the fields authentication sets (MACs, incarnation): the same
    segment as one tier authenticated it and as another holds it compare equal."""
    return msgspec.structs.replace(
        header, incarnation=_NO_INCARNATION, body_mac=_NO_MAC, mac=_NO_MAC
    )


def segment_id(header: SegmentHeader) -> bytes:
    """What tells the segment ``header`` describes from any other stored under its key:
    :data:`SEGMENT_ID_BYTES` of BLAKE2b over its :func:`plain_header` (so one segment has
    one id in every tier, authenticated or not). A fork's first turn lists the ids of the
    segments it inherits (``base_ids``)."""
    encoded = _header_encoder.encode(plain_header(header))
    return hashlib.blake2b(encoded, digest_size=SEGMENT_ID_BYTES).digest()


def inherits(first: SegmentHeader, inherited: Sequence[SegmentHeader]) -> bool:
    """Whether ``inherited`` are the segments a fork's first turn ``first`` lists in its
    ``base``: the same keys, each with at least the tokens the fork takes of it, and (where
    the fork names them: ``base_ids``) the very segments, not another history's turns
    stored under their keys since."""
    if len(first.base) != len(inherited):
        return False
    ids: Sequence[bytes | None] = first.base_ids or (None,) * len(inherited)
    return all(
        (h.session, h.seq) == (owner, seq)
        and take <= h.tokens
        and (want is None or segment_id(h) == want)
        for (owner, seq, take), h, want in zip(first.base, inherited, ids, strict=True)
    )


def is_retirement(header: SegmentHeader) -> bool:
    """Whether ``header`` is a retirement marker (see :data:`RETIRED_SEQ`)."""
    return header.seq == RETIRED_SEQ and header.codec == RETIRED_CODEC


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a stored dtype name."""
    return _DTYPES[name]


def _pack_prefix(buf: memoryview | bytearray, header_bytes: bytes, body_hash: int) -> None:
    crc = zlib.crc32(header_bytes + body_hash.to_bytes(8, "little"))
    PREFIX.pack_into(buf, 0, MAGIC, len(header_bytes), crc, body_hash)


def hash_body(body: memoryview | bytes) -> int:
    """xxh3-64 of a segment's bytes after its header (see :func:`hashed_from`)."""
    return int(xxhash.xxh3_64_intdigest(body))


def hashed_from(buf: memoryview | bytes) -> int:
    """Offset where the hashed part of a segment starts: right after its header."""
    _, hlen, _, _ = PREFIX.unpack_from(buf, 0)
    return int(PREFIX.size + hlen)
