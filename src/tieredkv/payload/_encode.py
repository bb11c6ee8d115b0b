"""Encoding: one turn's tensors checked and laid out as a segment (:func:`plan_segment`),
then written into a buffer whole or part by part (:class:`PartWriter`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch
import xxhash

from .._checks import check_cuts, check_int
from .._copy import copy_bytes, copy_tensor, plain_cpu
from ..errors import InvalidArgumentError, InvalidTypeError
from ._format import (
    _DTYPES,
    _TENSOR_ALIGN,
    LAND_ALIGN,
    LAND_MIN,
    MAX_SESSION_KEY_BYTES,
    PREFIX,
    RETIRED_CODEC,
    RETIRED_SEQ,
    SEGMENT_ID_BYTES,
    Schema,
    SegmentHeader,
    TensorSpec,
    _header_encoder,
    _pack_prefix,
    align_up,
    hash_body,
    header_schema,
)

__all__ = ["PartWriter", "SegmentPlan", "plan_segment"]


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
        base = dest.data_ptr()  # valid while ``dest`` holds ``buf``
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
            if at + spec.nbytes > len(dest):
                raise ValueError(f"tensor {spec.name!r} runs past the {len(dest)}-byte buffer")
            # a contiguous CPU tensor's bytes straight to their place (one memmove); any
            # other tensor through a typed view of its place
            if spec.nbytes and not copy_bytes(base + at, tensor, spec.nbytes):
                slot = dest[at : at + spec.nbytes].view(tensor.dtype).view(tensor.shape)
                copy_tensor(slot, tensor)
            cursor = at + spec.nbytes
        if hi > cursor:
            dest[cursor:hi].zero_()

    def finish(self, buf: memoryview, body_hash: int) -> None:
        """Write the prefix (magic, header length, CRC, ``body_hash``) once the body is in."""
        _pack_prefix(buf, self.header_bytes, body_hash)

    def pieces(self, *, sealed: bool = True) -> list[memoryview] | None:
        """The segment's bytes as consecutive pieces, without copying a tensor: its prefix
        and header (a new buffer), then the tensors' own bytes (views of their memory) and
        the zero padding between them, in order; they join into exactly the bytes
        :meth:`write_into` writes. ``None`` where a tensor is not a contiguous CPU tensor
        whose bytes are its values (serialize it with :meth:`write_into` instead).

        The body hash in the prefix is computed over the pieces, here, which reads every
        byte: run it in a worker thread. With ``sealed=False`` it is not: the prefix names
        a body hash of 0 (a valid prefix, whose header parses, but whose hash the body does
        not match) until :meth:`seal` computes it, so a tier can send the body while the
        hash is computed and the first piece once it is. A segment stored unsealed is
        refused on read as damaged, never served.

        The views are valid while this plan holds its tensors (keep the plan until the
        pieces are written). A tensor the caller changes after the hash is taken is stored
        as it is when sent, which its hash no longer matches: a read refuses the segment
        rather than serving a mix.
        """
        h = self.header
        start = PREFIX.size + len(self.header_bytes)
        body: list[memoryview] = []
        cursor = start
        for spec, tensor in zip(h.tensors, self.tensors, strict=True):
            at = h.body_offset + spec.offset
            if at > cursor:
                body.append(_zeros(at - cursor))
            if spec.nbytes:
                if not (plain_cpu(tensor) and tensor.nbytes == spec.nbytes):
                    return None
                raw = (ctypes.c_char * spec.nbytes).from_address(tensor.data_ptr())
                body.append(memoryview(raw).cast("B"))
            cursor = at + spec.nbytes
        if self.length > cursor:
            body.append(_zeros(self.length - cursor))
        head = bytearray(start)
        head[PREFIX.size :] = self.header_bytes
        pieces = [memoryview(head), *body]
        if sealed:
            self.seal(pieces)
        else:
            _pack_prefix(head, self.header_bytes, 0)
        return pieces

    def seal(self, pieces: Sequence[memoryview]) -> None:
        """Write the body hash of ``pieces`` (from :meth:`pieces` with ``sealed=False``)
        into the prefix, the start of the first piece. Hashes every byte of the body, with
        the GIL released: run it in a worker thread."""
        hasher = xxhash.xxh3_64()
        for piece in pieces[1:]:
            hasher.update(piece)
        _pack_prefix(pieces[0], self.header_bytes, hasher.intdigest())


_ZEROS = memoryview(bytes(1 << 16))


def _zeros(n: int) -> memoryview:
    """``n`` zero bytes (read-only: never written into)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else memoryview(bytes(n))


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


def _encode_laid_out(header: SegmentHeader) -> tuple[SegmentHeader, bytes]:
    """``header`` with the body offset its encoding needs, and that encoding."""
    # body_offset depends on the header's size, which does not depend on body_offset's
    # value as long as it stays within the same msgpack int width: encode until stable.
    header_bytes = _header_encoder.encode(header)
    land = any(spec.nbytes >= LAND_MIN for spec in header.tensors)
    for _ in range(3):
        body_offset = align_up(
            PREFIX.size + len(header_bytes), LAND_ALIGN if land else _TENSOR_ALIGN
        )
        header = msgspec.structs.replace(header, body_offset=body_offset)
        encoded = _header_encoder.encode(header)
        if len(encoded) == len(header_bytes):
            return header, encoded
        header_bytes = encoded
    return header, header_bytes


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


class _Layout(NamedTuple):
    """What :func:`plan_segment` found for one set of tensors: their specs at ``tokens``
    tokens, the token dimension (non-negative) and the schema. A turn's own fields (session,
    seq, times, forks) are encoded anew for each plan."""

    specs: tuple[TensorSpec, ...]
    token_dim: int
    tokens: int
    schema: Schema


class _Layouts:
    """The layouts of the last few tensor sets planned, by :func:`_layout_key`. In serving,
    every turn of a model has the same tensors but for their token count, so a turn's plan
    checks only what differs (the token counts) and, for another token count, lays out the
    same specs at new sizes. Bounded; shared by every thread (reads take no lock)."""

    MAX = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict[Hashable, _Layout] = {}

    def get(self, key: Hashable) -> _Layout | None:
        return self._layouts.get(key)

    def put(self, key: Hashable, layout: _Layout) -> None:
        with self._lock:
            self._layouts.pop(key, None)  # (the newest last)
            while len(self._layouts) >= self.MAX:
                del self._layouts[next(iter(self._layouts))]  # the oldest
            self._layouts[key] = layout

    def clear(self) -> None:
        with self._lock:
            self._layouts.clear()


_layouts = _Layouts()


def _layout_key(tensors: Mapping[str, Any], token_dim: int, codec: str) -> Hashable | None:
    """What a segment's layout and its tensors' checks depend on, but for the token count:
    per tensor (in order) its name, dtype, shape without the token dimension and device,
    with the token dimension and codec. ``None`` where that cannot be told this cheaply
    (numpy arrays, tensor subclasses, sparse tensors, a token dimension out of range):
    those are planned in full. A tensor's strides are not part of it: the layout does not
    depend on them, and each write copies a tensor by what its strides are then."""
    key: list[Hashable] = [token_dim, codec]
    for name, value in tensors.items():
        if type(value) is not torch.Tensor or value.layout is not torch.strided:
            return None
        shape = value.shape
        if not -len(shape) <= token_dim < len(shape):
            return None
        dim = token_dim % len(shape)
        key.append((name, value.dtype, shape[:dim], shape[dim + 1 :], value.device))
    return tuple(key)


def _remembered(
    layout: _Layout, values: tuple[torch.Tensor, ...]
) -> tuple[tuple[TensorSpec, ...], int] | None:
    """``layout``'s specs for ``values`` (tensors matching its key) and their token count;
    ``None`` where their token counts differ or are 0 (the full checks say so)."""
    dim = layout.token_dim
    tokens = int(values[0].shape[dim])
    if not tokens or any(t.shape[dim] != tokens for t in values):
        return None
    if tokens == layout.tokens:
        return layout.specs, tokens
    was = layout.tokens
    return _specs(
        [s.name for s in layout.specs],
        [s.dtype for s in layout.specs],
        [tuple(t.shape) for t in values],
        [s.nbytes // was * tokens for s in layout.specs],  # (nbytes: tokens x bytes per token)
    ), tokens


def _specs(
    names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], sizes: list[int]
) -> tuple[TensorSpec, ...]:
    """The specs of tensors laid out one after another in a segment's body."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, dtype, shape, nbytes in zip(names, dtypes, shapes, sizes, strict=True):
        if nbytes >= LAND_MIN:  # see LAND_ALIGN (the body offset is aligned as well)
            offset = align_up(offset, LAND_ALIGN)
        specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
        offset = align_up(offset + nbytes, _TENSOR_ALIGN)
    return tuple(specs)


def plan_segment(
    session: str,
    seq: int,
    tensors: Mapping[str, Any],
    *,
    token_dim: int,
    answer_tokens: int,
    codec: str = "kv",
    created: float = 0.0,
    base: tuple[tuple[str, int, int], ...] = (),
    parent: str = "",
    base_ids: tuple[bytes, ...] = (),
) -> SegmentPlan:
    """Validate one turn's tensors and lay out its segment.

    A set of tensors like one of the last few planned (the same names in the same order,
    dtypes, shapes but for the token count, and devices; the same token dimension and
    codec) reuses their checks and schema, and their layout at the new token count.

    :param tensors: named torch tensors or numpy arrays, all with the same size along
        ``token_dim`` (negative counts from the end, per tensor)
    :param base: a fork's first turn: the earlier turns it references (see
        :class:`SegmentHeader`)
    :param parent: a fork's first turn: the conversation it was forked from, if not the
        owner of the last turn ``base`` lists (see :class:`SegmentHeader`)
    :param base_ids: a fork's first turn: the :func:`~tieredkv.payload.segment_id` of each
        turn ``base`` lists (see :class:`SegmentHeader`)
    :raises TypeError: for values that are not dense tensors of a storable dtype on the CPU
        or a CUDA device
    :raises ValueError: for an empty mapping, mismatched token counts, or bad arguments
    """
    if not isinstance(tensors, Mapping) or not tensors:
        raise InvalidArgumentError("tensors must be a non-empty mapping of name -> tensor")
    _check_count("answer_tokens", answer_tokens)
    _check_count("seq", seq)
    if not isinstance(parent, str) or (parent and not base):
        raise InvalidArgumentError(
            f"parent names the conversation a fork's first turn was forked from (a str, "
            f"with base listing the turns it inherits), not {parent!r} with base {base!r}"
        )
    if not isinstance(base_ids, tuple) or (
        base_ids
        and (
            len(base_ids) != len(base)
            or any(not isinstance(i, bytes) or len(i) != SEGMENT_ID_BYTES for i in base_ids)
        )
    ):
        raise InvalidArgumentError(
            f"base_ids names the segments a fork's first turn inherits (a tuple of one "
            f"16-byte segment_id per entry of base), not {base_ids!r} with base {base!r}"
        )
    if isinstance(token_dim, bool) or not isinstance(token_dim, int):
        raise InvalidArgumentError(f"token_dim must be an int, not {token_dim!r}")
    if not isinstance(codec, str) or not codec:
        raise InvalidArgumentError(f"codec must be a non-empty string, not {codec!r}")
    key_bytes = len(session.encode("utf-8"))
    if key_bytes > MAX_SESSION_KEY_BYTES:
        raise InvalidArgumentError(
            f"session key is {key_bytes:,} bytes of UTF-8; keep it under {MAX_SESSION_KEY_BYTES:,}"
        )
    key = _layout_key(tensors, token_dim, codec)
    layout = None if key is None else _layouts.get(key)
    laid = None
    if layout is not None:  # (tensors like these passed _to_tensor: what it does to them)
        values = tuple(t.detach() if t.requires_grad else t for t in tensors.values())
        laid = _remembered(layout, values)
    if laid is None:
        values, specs, dim, tokens = _lay_out(tensors, token_dim)
    else:
        assert layout is not None
        (specs, tokens), dim = laid, layout.token_dim
    header = SegmentHeader(
        session=session,
        seq=seq,
        tokens=tokens,
        token_dim=dim,
        answer_tokens=answer_tokens,
        codec=codec,
        tensors=specs,
        body_offset=0,
        body_len=specs[-1].offset + specs[-1].nbytes,
        created=created,
        base=base,
        parent=parent,
        base_ids=base_ids,
    )
    header, header_bytes = _encode_laid_out(header)
    if layout is None or layout.tokens != tokens:
        schema = header_schema(header) if layout is None else layout.schema
        layout = _Layout(specs, dim, tokens, schema)
        if key is not None:
            _layouts.put(key, layout)
    return SegmentPlan(header, header_bytes, layout.schema, values)


def _lay_out(
    tensors: Mapping[str, Any], token_dim: int
) -> tuple[tuple[torch.Tensor, ...], tuple[TensorSpec, ...], int, int]:
    """Check ``tensors`` (see :func:`plan_segment`) and lay them out in a segment's body:
    the tensors, their specs, the token dimension (non-negative) and the token count."""
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
    specs = _specs(
        names,
        [str(t.dtype).removeprefix("torch.") for t in values],
        [tuple(t.shape) for t in values],
        [t.numel() * t.element_size() for t in values],
    )
    return tuple(values), specs, dims[0], tokens


def plan_retirement(session: str) -> SegmentPlan:
    """The retirement marker of ``session`` (see :data:`~tieredkv.payload.RETIRED_SEQ`)."""
    return plan_segment(
        session,
        RETIRED_SEQ,
        {"retired": torch.zeros(1, dtype=torch.uint8)},
        token_dim=0,
        answer_tokens=0,
        codec=RETIRED_CODEC,
    )


def _check_count(what: str, value: object) -> None:
    # a ValueError even for a wrong type: what plan_segment has always raised here
    check_int(what, value, wrong_type=InvalidArgumentError)
