"""Segments: one turn's named tensors as bytes, with a header and a checksum.

Every tier stores a segment as the same byte string, so moving it between tiers is a plain
copy (host arena -> SSD file is one ``pwrite`` from the arena, SSD -> arena one
``preadv`` into it) and the bytes a test reads back from a file are the bytes written.

Layout (all integers little-endian)::

    0   8  magic  b"TKVSEG\\x00\\x01"
    8   4  header length H
    12  4  CRC-32 of (header bytes + body hash)
    16  8  body hash: xxh3-64 of every byte after the header (padding included)
    24  H  header: msgpack of :class:`SegmentHeader`
    ... zero padding up to body_offset (a multiple of 64)
    body: each tensor's bytes at its offset (each a multiple of 64 from body_offset)
    ... zero padding up to a multiple of :data:`ALIGN` (4096): the stored length

The header CRC catches a torn or damaged header cheaply (a restart scans only headers);
the body hash (xxh3, over 10 GB/s on one core) covers everything after the header, so a
flipped byte anywhere in a segment is caught on read. Both are checked before a segment
read from a capacity tier is served.

A header whose CRC matches can still lie (anyone who can write a tier's directory can
write one): :func:`parse_header` therefore checks its contents against each other and
against the segment's length (:func:`validate_header`) before anyone allocates memory from
it, so every tensor it describes lies inside the segment.

Authentication (optional, per tier): with a secret, the header's ``body_mac`` is a keyed
BLAKE2b of everything after the header and its ``mac`` a keyed BLAKE2b of the header itself
(with ``mac`` zeroed), so a segment cannot be forged or altered without the secret; its
``incarnation`` names one residency of the session in that tier, so a stale copy of one
segment from an earlier residency stands out among the others. Every segment carries these
three fields (zeroed when not authenticated), so authenticating one is a patch of its header
bytes that leaves its length and layout unchanged (:func:`authenticated_head`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

from ._copy import copy_tensor
from .errors import CorruptSegmentError, InvalidArgumentError, InvalidTypeError

__all__ = [
    "ALIGN",
    "INCARNATION_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "MAX_COUNT",
    "PREFIX",
    "PartWriter",
    "Schema",
    "SegmentHeader",
    "SegmentPlan",
    "TensorSpec",
    "align_up",
    "authenticated_head",
    "body_mac_hasher",
    "check_body_mac",
    "check_body_mac_digest",
    "check_header_mac",
    "check_cuts",
    "check_int",
    "check_manifest_mac",
    "check_prefix",
    "derive_key",
    "hash_body",
    "hashed_from",
    "header_schema",
    "manifest_mac",
    "parse_header",
    "plan_segment",
    "segment_tensors",
    "tensor_at",
    "validate_header",
    "verify_segment",
]

MAGIC = b"TKVSEG\x00\x01"
PREFIX = struct.Struct("<8sII Q")
"""magic, header length, header CRC, body hash."""
ALIGN = 4096
"""Stored segments are padded to a multiple of this (the O_DIRECT block size)."""
_TENSOR_ALIGN = 64
MAX_SESSION_KEY_BYTES = 65536
MAX_COUNT = 2**63 - 1
"""The largest token count, answer length or turn index a segment header can record."""
_MAX_RANK = 64
_MAX_DIM = 2**40
"""Bound on one dimension of an empty tensor (a non-empty one is bounded by its bytes)."""
INCARNATION_BYTES = 16
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


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(SegmentHeader)


class SegmentPlan:
    """A validated segment, ready to be written into a buffer of :attr:`length` bytes."""

    __slots__ = ("header", "header_bytes", "length", "schema", "tensors")

    def __init__(
        self,
        header: SegmentHeader,
        header_bytes: bytes,
        schema: Schema,
        tensors: tuple[torch.Tensor, ...],
    ) -> None:
        self.header = header
        self.header_bytes = header_bytes
        self.schema = schema
        self.tensors = tensors
        self.length = header.length

    def write_into(self, buf: memoryview) -> None:
        """Serialize into ``buf`` (exactly :attr:`length` bytes, zeroed padding included).

        Copies each tensor once, straight into ``buf``; tensors on a GPU are copied from the
        device. Releases the GIL for the large copies, so run it in a worker thread.
        """
        if len(buf) != self.length:
            raise ValueError(f"buffer holds {len(buf)} bytes, segment needs {self.length}")
        self.fill_part(buf, 0, self.length)
        start = PREFIX.size + len(self.header_bytes)
        _pack_prefix(buf, self.header_bytes, hash_body(buf[start:]))

    def fill_part(self, buf: memoryview, lo: int, hi: int) -> None:
        """Serialize the segment's bytes ``[lo, hi)`` into the same bytes of ``buf`` (the
        whole segment's buffer), all but the prefix (:meth:`finish` writes it).

        ``lo`` and ``hi`` are 0, the segment's length, or where a tensor's data starts: each
        tensor starting in the range is copied whole, and every gap is zeroed.
        """
        h = self.header
        dest = torch.frombuffer(buf, dtype=torch.uint8)  # length >= ALIGN: never empty
        cursor = lo
        if lo == 0:
            start = PREFIX.size + len(self.header_bytes)
            buf[PREFIX.size : start] = self.header_bytes
            cursor = start
        for spec, tensor in zip(h.tensors, self.tensors, strict=True):
            at = h.body_offset + spec.offset
            if not lo <= at < hi:
                continue
            if at > cursor:
                dest[cursor:at].zero_()
            if spec.nbytes:
                slot = dest[at : at + spec.nbytes].view(tensor.dtype).view(tensor.shape)
                copy_tensor(slot, tensor)
            cursor = at + spec.nbytes
        if hi > cursor:
            dest[cursor:hi].zero_()

    def finish(self, buf: memoryview, body_hash: int) -> None:
        """Write the prefix (magic, header length, CRC, ``body_hash``) once the body is in."""
        _pack_prefix(buf, self.header_bytes, body_hash)


def check_cuts(cuts: Sequence[int], length: int) -> list[int]:
    """``cuts`` as a list, if they cut ``length`` bytes into parts: strictly rising from 0
    to ``length`` (at least one part); ``ValueError`` otherwise."""
    cut = list(cuts)
    if len(cut) < 2 or cut[0] != 0 or cut[-1] != length or sorted(set(cut)) != cut:
        raise ValueError(f"cuts must rise from 0 to {length}, not {cut}")
    return cut


class PartWriter:
    """Fills a segment's buffer part by part, hashing each part as it is filled, so a tier
    can write part k while part k + 1 is serialized.

    ``writer(k)`` fills bytes ``[cuts[k], cuts[k + 1])`` (:meth:`SegmentPlan.fill_part`);
    the last call also writes the prefix, whose hash covers the whole body: the first part's
    bytes are final only then. With ``hash_pool`` (a single-thread executor: the parts must
    be hashed in order) each part is hashed there while the next is copied; call
    :meth:`wait` before reusing the buffer if a call raised.
    """

    def __init__(
        self,
        plan: SegmentPlan,
        buf: memoryview,
        cuts: list[int],
        hash_pool: Executor | None = None,
    ) -> None:
        check_cuts(cuts, plan.length)
        self._plan = plan
        self._buf = buf
        self.cuts = cuts
        self._hasher = xxhash.xxh3_64()
        self._hashed = PREFIX.size + len(plan.header_bytes)
        self._pool = hash_pool
        self._pending: list[Future[None]] = []

    def __call__(self, k: int) -> None:
        lo, hi = self.cuts[k], self.cuts[k + 1]
        self._plan.fill_part(self._buf, lo, hi)
        if hi > self._hashed:
            part = self._buf[self._hashed : hi]
            if self._pool is None:
                self._hasher.update(part)
            else:
                self._pending.append(self._pool.submit(self._hasher.update, part))
            self._hashed = hi
        if k == len(self.cuts) - 2:
            self.wait()
            self._plan.finish(self._buf, self._hasher.intdigest())

    def wait(self) -> None:
        """Wait for the hashing handed to ``hash_pool`` (raising its first error)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


def _pack_prefix(buf: memoryview | bytearray, header_bytes: bytes, body_hash: int) -> None:
    crc = zlib.crc32(header_bytes + body_hash.to_bytes(8, "little"))
    PREFIX.pack_into(buf, 0, MAGIC, len(header_bytes), crc, body_hash)


def _encode_laid_out(header: SegmentHeader) -> tuple[SegmentHeader, bytes]:
    """``header`` with the body offset its encoding needs, and that encoding."""
    # body_offset depends on the header's size, which does not depend on body_offset's
    # value as long as it stays within the same msgpack int width: encode until stable.
    header_bytes = _header_encoder.encode(header)
    for _ in range(3):
        body_offset = align_up(PREFIX.size + len(header_bytes), _TENSOR_ALIGN)
        header = msgspec.structs.replace(header, body_offset=body_offset)
        encoded = _header_encoder.encode(header)
        if len(encoded) == len(header_bytes):
            return header, encoded
        header_bytes = encoded
    return header, header_bytes


def hash_body(body: memoryview | bytes) -> int:
    """xxh3-64 of a segment's bytes after its header (see :func:`hashed_from`)."""
    return int(xxhash.xxh3_64_intdigest(body))


def hashed_from(buf: memoryview | bytes) -> int:
    """Offset where the hashed part of a segment starts: right after its header."""
    _, hlen, _, _ = PREFIX.unpack_from(buf, 0)
    return int(PREFIX.size + hlen)


def _to_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray):
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        except TypeError as exc:
            raise InvalidTypeError(
                f"tensor {name!r}: numpy dtype {value.dtype} has no torch equivalent; "
                f"convert it to one of {sorted(_DTYPES)}"
            ) from exc
    else:
        raise InvalidTypeError(
            f"tensor {name!r} is a {type(value).__name__}; pass torch tensors or numpy arrays"
        )
    if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
        raise InvalidTypeError(
            f"tensor {name!r} has dtype {tensor.dtype}, which tieredkv cannot store; "
            f"use one of {sorted(_DTYPES)}"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise InvalidTypeError(f"tensor {name!r} is not a dense (strided) tensor; pass a dense one")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidTypeError(
            f"tensor {name!r} is on a {tensor.device.type!r} device, which holds no data "
            f"tieredkv can copy; pass a tensor on the CPU or a CUDA device"
        )
    # a strided view (a slice of a model cache's buffer) is not copied here: write_into
    # copies it once, straight into the segment, in the worker thread that writes it
    return tensor


def plan_segment(
    session: str,
    seq: int,
    tensors: Mapping[str, Any],
    *,
    token_dim: int,
    answer_tokens: int,
    codec: str = "kv",
    created: float = 0.0,
) -> SegmentPlan:
    """Validate one turn's tensors and lay out its segment.

    :param tensors: named torch tensors or numpy arrays, all with the same size along
        ``token_dim`` (negative counts from the end, per tensor)
    :raises TypeError: for values that are not dense tensors of a storable dtype on the CPU
        or a CUDA device
    :raises ValueError: for an empty mapping, mismatched token counts, or bad arguments
    """
    if not isinstance(tensors, Mapping) or not tensors:
        raise InvalidArgumentError("tensors must be a non-empty mapping of name -> tensor")
    _check_count("answer_tokens", answer_tokens)
    _check_count("seq", seq)
    if isinstance(token_dim, bool) or not isinstance(token_dim, int):
        raise InvalidArgumentError(f"token_dim must be an int, not {token_dim!r}")
    if not isinstance(codec, str) or not codec:
        raise InvalidArgumentError(f"codec must be a non-empty string, not {codec!r}")
    names: list[str] = []
    values: list[torch.Tensor] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise InvalidTypeError(f"tensor names must be non-empty strings, not {name!r}")
        names.append(name)
        values.append(_to_tensor(name, value))
    dims: list[int] = []
    tokens: int | None = None
    for name, tensor in zip(names, values, strict=True):
        if tensor.dim() == 0:
            raise InvalidArgumentError(f"tensor {name!r} is a scalar; it needs a token dimension")
        if not -tensor.dim() <= token_dim < tensor.dim():
            raise InvalidArgumentError(
                f"token_dim {token_dim} is out of range for tensor {name!r} of shape "
                f"{tuple(tensor.shape)}"
            )
        dim = token_dim % tensor.dim()
        dims.append(dim)
        n = int(tensor.shape[dim])
        if tokens is None:
            tokens = n
        elif n != tokens:
            raise InvalidArgumentError(
                f"tensor {name!r} has {n} tokens along dim {token_dim}, others have {tokens}"
            )
    assert tokens is not None
    if tokens == 0:
        raise InvalidArgumentError("the segment has 0 tokens; append only turns that produced KV")
    if len(set(dims)) != 1:
        raise InvalidArgumentError(
            f"token_dim {token_dim} points at different dimensions {sorted(set(dims))} in "
            f"tensors of different rank; use a non-negative token_dim"
        )
    specs: list[TensorSpec] = []
    offset = 0
    for name, tensor in zip(names, values, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(
            TensorSpec(
                name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes
            )
        )
        offset = align_up(offset + nbytes, _TENSOR_ALIGN)
    body_len = specs[-1].offset + specs[-1].nbytes
    key_bytes = len(session.encode("utf-8"))
    if key_bytes > MAX_SESSION_KEY_BYTES:
        raise InvalidArgumentError(
            f"session key is {key_bytes:,} bytes of UTF-8; keep it under {MAX_SESSION_KEY_BYTES:,}"
        )
    header = SegmentHeader(
        session=session,
        seq=seq,
        tokens=tokens,
        token_dim=dims[0],
        answer_tokens=answer_tokens,
        codec=codec,
        tensors=tuple(specs),
        body_offset=0,
        body_len=body_len,
        created=created,
    )
    header, header_bytes = _encode_laid_out(header)
    return SegmentPlan(header, header_bytes, header_schema(header), tuple(values))


def _check_count(what: str, value: object) -> None:
    # a ValueError even for a wrong type: what plan_segment has always raised here
    check_int(what, value, wrong_type=InvalidArgumentError)


def check_int(
    what: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int = MAX_COUNT,
    wrong_type: type[InvalidArgumentError | InvalidTypeError] = InvalidTypeError,
) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]``.

    :raises ~tieredkv.errors.InvalidTypeError: (or ``wrong_type``) for a float, a bool or
        anything else that is not an int
    :raises ~tieredkv.errors.InvalidArgumentError: for an int out of range
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(f"{what} must be an int, not {value!r}")
    if not minimum <= value <= maximum:
        upper = "2**63 - 1" if maximum == MAX_COUNT else f"{maximum:,}"
        raise InvalidArgumentError(f"{what} must be from {minimum:,} to {upper}, not {value:,}")
    return value


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
        raise bad(f"unknown format version {header.version}")
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


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a stored dtype name."""
    return _DTYPES[name]


# -- authenticated segments ----------------------------------------------------------------

MIN_SECRET_BYTES = 16


def derive_key(secret: bytes) -> bytes:
    """The BLAKE2b key for a user's secret (any length from 16 bytes).

    :raises ~tieredkv.errors.InvalidTypeError: if ``secret`` is not bytes
    :raises ~tieredkv.errors.InvalidArgumentError: if it is shorter than 16 bytes
    """
    if not isinstance(secret, bytes | bytearray):
        raise InvalidTypeError(f"the secret must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"the secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
            f"(os.urandom(32), say)"
        )
    return hashlib.blake2b(bytes(secret), digest_size=64, person=b"tieredkv-key").digest()


def body_mac_hasher(key: bytes) -> Any:
    """An incremental body MAC: ``update`` it with a segment's bytes after its header, in
    order; its ``digest()`` is then what :func:`check_body_mac` compares."""
    return hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=b"tieredkv-body")


def _body_mac(body: memoryview | bytes, key: bytes) -> bytes:
    mac = body_mac_hasher(key)
    mac.update(body)
    return bytes(mac.digest())


def _header_mac(header: SegmentHeader, key: bytes) -> bytes:
    zeroed = _header_encoder.encode(msgspec.structs.replace(header, mac=_NO_MAC))
    return hashlib.blake2b(zeroed, key=key, digest_size=MAC_BYTES, person=b"tieredkv-head").digest()


def authenticated_head(buf: memoryview, key: bytes, incarnation: bytes) -> bytes:
    """The prefix and header of the segment in ``buf``, authenticated.

    Returns the first :func:`hashed_from` bytes of the segment with the header's
    ``incarnation``, ``body_mac`` and ``mac`` set (and the prefix's CRC updated); the rest of
    the segment is unchanged, so writing these bytes over the start of ``buf``'s segment
    gives the authenticated segment. Hashes the whole segment: run it in a worker thread.

    :param key: from :func:`derive_key`
    :param incarnation: :data:`INCARNATION_BYTES` bytes naming the session's residency
    :raises ~tieredkv.errors.CorruptSegmentError: if ``buf`` is not a valid segment
    :raises ~tieredkv.errors.InvalidArgumentError: for a segment written before segments
        had authentication fields (its header has no room for them)
    """
    header, body_hash = parse_header(buf, "the segment to authenticate", len(buf))
    start = hashed_from(buf)
    authed = msgspec.structs.replace(
        header, incarnation=incarnation, body_mac=_body_mac(buf[start:], key), mac=_NO_MAC
    )
    authed = msgspec.structs.replace(authed, mac=_header_mac(authed, key))
    header_bytes = _header_encoder.encode(authed)
    if PREFIX.size + len(header_bytes) != start:
        raise InvalidArgumentError(
            f"segment {header.seq} of session {header.session[:80]!r} has no room for "
            f"authentication fields (written by an older tieredkv); store it again"
        )
    head = bytearray(start)
    head[PREFIX.size :] = header_bytes
    _pack_prefix(head, header_bytes, body_hash)
    return bytes(head)


def check_header_mac(header: SegmentHeader, key: bytes, where: str) -> None:
    """Check an authenticated segment's header MAC (not its body: see
    :func:`check_body_mac`).

    :raises ~tieredkv.errors.CorruptSegmentError: if the header has no MAC, or a wrong one
        (forged, altered, or written with another secret)
    """
    if not header.authenticated:
        raise CorruptSegmentError(where, "not authenticated (written without the secret)")
    if not hmac.compare_digest(_header_mac(header, key), header.mac):
        raise CorruptSegmentError(
            where, "header MAC mismatch (forged, altered, or written with another secret)"
        )


def check_body_mac(buf: memoryview | bytes, header: SegmentHeader, key: bytes, where: str) -> None:
    """Check the body MAC of the whole segment in ``buf`` against its (checked) header.

    :raises ~tieredkv.errors.CorruptSegmentError: on a mismatch
    """
    check_body_mac_digest(_body_mac(buf[hashed_from(buf) :], key), header, where)


def check_body_mac_digest(digest: bytes, header: SegmentHeader, where: str) -> None:
    """Check a body MAC computed elsewhere (incrementally: :func:`body_mac_hasher`) against
    the segment's (checked) header.

    :raises ~tieredkv.errors.CorruptSegmentError: on a mismatch
    """
    if not hmac.compare_digest(digest, header.body_mac):
        raise CorruptSegmentError(where, "body MAC mismatch (forged or altered)")


def manifest_mac(data: bytes, key: bytes) -> bytes:
    """The keyed BLAKE2b of a shared tier's manifest (its canonical bytes), so that a
    client of the store without the secret can neither forge one nor remove an entry."""
    return hashlib.blake2b(data, key=key, digest_size=MAC_BYTES, person=b"tieredkv-mnfst").digest()


def check_manifest_mac(data: bytes, mac: bytes, key: bytes, where: str) -> None:
    """Check a manifest's MAC (see :func:`manifest_mac`).

    :raises ~tieredkv.errors.CorruptSegmentError: if it is missing or wrong
    """
    if not mac:
        raise CorruptSegmentError(
            where, "the manifest is not authenticated (written without the secret)"
        )
    if not hmac.compare_digest(manifest_mac(data, key), mac):
        raise CorruptSegmentError(
            where, "manifest MAC mismatch (forged, altered, or written with another secret)"
        )
