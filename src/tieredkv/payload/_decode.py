"""Decoding: a segment's prefix, header and body checked before anything is read from it
(a header is validated even when its CRC matches: see :mod:`tieredkv.payload`), and
zero-copy views of its tensors."""

from __future__ import annotations

import math
import zlib
from typing import Any

import msgspec
import torch

from .._checks import MAX_COUNT
from ..errors import CorruptSegmentError, UnknownFormatError
from ._format import (
    _DTYPES,
    _ITEMSIZE,
    _TENSOR_ALIGN,
    INCARNATION_BYTES,
    MAC_BYTES,
    MAGIC,
    MAX_SESSION_KEY_BYTES,
    PREFIX,
    SEGMENT_ID_BYTES,
    SegmentHeader,
    TensorSpec,
    _header_decoder,
    hash_body,
    hashed_from,
)

__all__ = [
    "check_prefix",
    "parse_header",
    "segment_tensors",
    "tensor_at",
    "validate_header",
    "verify_segment",
]

_MAX_RANK = 64
_MAX_DIM = 2**40
"""Bound on one dimension of an empty tensor (a non-empty one is bounded by its bytes)."""


def parse_header(
    buf: memoryview | bytes, where: str, size: int | None = None
) -> tuple[SegmentHeader, int]:
    """Check the prefix and header of a segment; return the header and the body hash.

    ``buf`` must hold at least the prefix and the header. The header's contents are
    checked with :func:`validate_header` (against ``size``, the segment's length in bytes,
    when given), so nothing it describes reaches outside the segment.

    :raises ~tieredkv.errors.CorruptSegmentError: on any inconsistency
    """
    raw, body_hash = check_prefix(buf, where)
    end = PREFIX.size + len(raw)
    try:
        header = _header_decoder.decode(raw)
    except msgspec.DecodeError as exc:  # CRC matched but content is not ours: a bug, not a flip
        raise CorruptSegmentError(where, f"undecodable header: {exc}") from exc
    if header.body_offset < end:
        raise CorruptSegmentError(where, "header offsets are inconsistent")
    validate_header(header, where, size)
    return header, int(body_hash)


def check_prefix(buf: memoryview | bytes, where: str) -> tuple[bytes, int]:
    """Check a segment's magic and header CRC without decoding the header; return the
    header's bytes and the body hash.

    :raises ~tieredkv.errors.CorruptSegmentError: if either is wrong
    """
    if len(buf) < PREFIX.size:
        raise CorruptSegmentError(where, f"only {len(buf)} bytes, shorter than the prefix")
    magic, hlen, crc, body_hash = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptSegmentError(where, "bad magic (not a tieredkv segment, or torn)")
    end = PREFIX.size + hlen
    if end > len(buf):
        raise CorruptSegmentError(where, f"header of {hlen} bytes runs past the data")
    raw = bytes(buf[PREFIX.size : end])
    if zlib.crc32(raw + body_hash.to_bytes(8, "little")) != crc:
        raise CorruptSegmentError(where, "header checksum mismatch")
    return raw, int(body_hash)


def validate_header(header: SegmentHeader, where: str, size: int | None = None) -> None:
    """Check that a decoded header describes a segment that could exist.

    Every count is within range; every tensor has a known dtype, a shape whose byte size
    is its ``nbytes``, the header's token count along ``token_dim``, and lies inside the
    body, after the tensor before it; the body ends where the last tensor does; and the
    segment's length is ``size`` when given. So a header that passes cannot make a reader
    allocate more than the segment's own bytes, or index outside them.

    :raises ~tieredkv.errors.CorruptSegmentError: naming the first inconsistency
    """

    def bad(detail: str) -> CorruptSegmentError:
        return CorruptSegmentError(where, f"header is inconsistent: {detail}")

    if header.version != 1:
        raise UnknownFormatError(where, header.version)
    for what, value in (
        ("seq", header.seq),
        ("answer_tokens", header.answer_tokens),
        ("body_len", header.body_len),
        ("body_offset", header.body_offset),
    ):
        if not 0 <= value <= MAX_COUNT:
            raise bad(f"{what} {value} is out of range")
    if not 1 <= header.tokens <= MAX_COUNT:
        raise bad(f"tokens {header.tokens} is out of range")
    if header.body_offset % _TENSOR_ALIGN:
        raise bad(f"body_offset {header.body_offset} is not a multiple of {_TENSOR_ALIGN}")
    if len(header.session.encode("utf-8", "surrogatepass")) > MAX_SESSION_KEY_BYTES:
        raise bad("the session key is too long")
    if not header.codec or not math.isfinite(header.created):
        raise bad("empty codec or non-finite creation time")
    if (
        len(header.incarnation) != INCARNATION_BYTES
        or len(header.body_mac) != MAC_BYTES
        or len(header.mac) != MAC_BYTES
    ):
        raise bad("authentication fields of the wrong size")
    if header.base_ids and (
        len(header.base_ids) != len(header.base)
        or any(len(i) != SEGMENT_ID_BYTES for i in header.base_ids)
    ):
        raise bad("base_ids do not name one segment per entry of base")
    if size is not None and header.length != size:
        raise bad(f"it describes {header.length} bytes, the segment is {size}")
    if not header.tensors:
        raise bad("no tensors")
    names: set[str] = set()
    end = 0
    token_dim, tokens, body_len = header.token_dim, header.tokens, header.body_len
    numels: dict[tuple[int, ...], int] = {}  # shapes already found in range (most repeat)
    for spec in header.tensors:  # one condition per tensor: a restart checks every header
        shape, offset, nbytes = spec.shape, spec.offset, spec.nbytes
        itemsize = _ITEMSIZE.get(spec.dtype, 0)
        numel = numels.get(shape, -1)
        if numel < 0 and shape and min(shape) >= 0 and max(shape) <= _MAX_DIM:
            numel = numels[shape] = math.prod(shape)
        if (
            not itemsize
            or numel < 0
            or not token_dim < len(shape) <= _MAX_RANK
            or shape[token_dim] != tokens
            or numel * itemsize != nbytes
            or offset % _TENSOR_ALIGN
            or offset < end
            or offset + nbytes > body_len
            or not spec.name
            or spec.name in names
        ):
            _explain_tensor(spec, header, names, end, bad)
        names.add(spec.name)
        end = offset + nbytes
    if end != header.body_len:
        raise bad(f"the body is {header.body_len} bytes, its tensors end at {end}")


def _explain_tensor(
    spec: TensorSpec,
    header: SegmentHeader,
    names: set[str],
    end: int,
    bad: Any,
) -> None:
    """Raise ``bad(...)`` naming what is wrong with a tensor that failed validation."""
    name = spec.name
    if not name or name in names:
        raise bad(f"tensor name {name!r} is empty or repeated")
    names.add(name)
    dtype = _DTYPES.get(spec.dtype)
    if dtype is None:
        raise bad(f"tensor {name!r} has unknown dtype {spec.dtype!r}")
    if not 1 <= len(spec.shape) <= _MAX_RANK or header.token_dim >= len(spec.shape):
        raise bad(f"tensor {name!r} has rank {len(spec.shape)} (token_dim {header.token_dim})")
    if spec.shape[header.token_dim] != header.tokens:
        raise bad(f"tensor {name!r} has {spec.shape[header.token_dim]} tokens, not {header.tokens}")
    if any(not 0 <= d <= _MAX_DIM for d in spec.shape):
        raise bad(f"tensor {name!r} has shape {spec.shape}")
    if math.prod(spec.shape) * dtype.itemsize != spec.nbytes:
        raise bad(f"tensor {name!r} of shape {spec.shape} is not {spec.nbytes} bytes")
    if spec.offset % _TENSOR_ALIGN or spec.offset < end:
        raise bad(f"tensor {name!r} starts at {spec.offset}, overlapping or unaligned")
    if spec.offset + spec.nbytes > header.body_len:
        raise bad(f"tensor {name!r} runs past the body")
    raise bad(f"tensor {name!r} is inconsistent")  # not reached: one of the above applies


def verify_segment(buf: memoryview, where: str) -> SegmentHeader:
    """Check a whole segment (header and body hash); return its header."""
    header, body_hash = parse_header(buf, where, len(buf))
    if hash_body(buf[hashed_from(buf) :]) != body_hash:
        raise CorruptSegmentError(where, "body checksum mismatch")
    return header


def segment_tensors(buf: memoryview, header: SegmentHeader) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views of a segment's body (valid while ``buf`` is)."""
    out: dict[str, torch.Tensor] = {}
    for spec in header.tensors:
        dtype = _DTYPES[spec.dtype]
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        out[spec.name] = tensor_at(buf, spec, header.body_offset + spec.offset)
    return out


def tensor_at(buf: memoryview, spec: TensorSpec, at: int) -> torch.Tensor:
    """A zero-copy view of the tensor ``spec`` describes, its bytes at offset ``at`` of
    ``buf`` (a whole segment, or a span of one); ``spec.nbytes`` must not be 0."""
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=spec.nbytes, offset=at)
    return raw.view(_DTYPES[spec.dtype]).view(spec.shape)
