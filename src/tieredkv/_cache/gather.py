"""Segments to tensors and back: filling a tier's slot, and scattering a history into outputs."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import torch

from .._copy import copy_tensor
from ..backends.arena import INLINE_COPY, close_mapping, prefaulted
from ..backends.base import (
    AddressableTier,
    FilledWriteTier,
    ReadCountingTier,
    SegmentKey,
    Tier,
)
from ..errors import InvalidArgumentError
from ..payload import (
    ALIGN,
    PartWriter,
    Schema,
    SegmentHeader,
    SegmentPlan,
    TensorSpec,
    align_up,
    dtype_of,
    segment_tensors,
    tensor_at,
)
from .outputs import OutputPool

__all__ = [
    "Staging",
    "StreamScatter",
    "Target",
    "check_into",
    "copy_out_addressable",
    "fill_cuts",
    "fresh",
    "scatter",
    "scratch",
    "span_plan",
    "write_new",
]

Target = Callable[[Schema, int], dict[str, torch.Tensor]]
"""Given a session's schema and token count, the tensors its history is copied into."""


def fresh(out: dict[str, torch.Tensor], pool: OutputPool) -> Target:
    """A target that allocates new host tensors (into ``out``, from ``pool``) for the whole
    history."""

    def alloc(schema: Schema, tokens: int) -> dict[str, torch.Tensor]:
        for name, dt, shape in zip(schema.names, schema.dtypes, schema.shapes, strict=True):
            full = tuple(tokens if d == -1 else d for d in shape)
            out[name] = pool.empty(full, dtype_of(dt))
        return out

    return alloc


def check_into(out: Mapping[str, torch.Tensor]) -> Target:
    """A target that checks caller-provided tensors fit the history (raises ``ValueError``)."""

    def check(schema: Schema, tokens: int) -> dict[str, torch.Tensor]:
        if set(out) != set(schema.names):
            raise InvalidArgumentError(
                f"out has tensors {sorted(out)}, the session stores {sorted(schema.names)}"
            )
        for name, dt, shape in zip(schema.names, schema.dtypes, schema.shapes, strict=True):
            t = out[name]
            want = dtype_of(dt)
            if t.dtype != want:
                raise InvalidArgumentError(f"out[{name!r}] is {t.dtype}, the session stores {want}")
            dim = schema.token_dim
            got = tuple(-1 if i == dim else d for i, d in enumerate(t.shape))
            if got != shape or t.shape[dim] < tokens:
                raise InvalidArgumentError(
                    f"out[{name!r}] has shape {tuple(t.shape)}; it needs "
                    f"{tuple(tokens if d == -1 else d for d in shape)} or more positions "
                    f"along dim {dim}"
                )
        return dict(out)

    return check


async def write_new(tier: Tier, key: SegmentKey, plan: SegmentPlan, staging: Staging) -> None:
    """Serialize a new segment straight into ``tier``'s reservation for ``key`` and commit it.

    An addressable tier's slot is filled in place; a :class:`FilledWriteTier` writes each
    part of the staging buffer while the next part is serialized (copy and checksum overlap
    the device's write); any other tier gets the whole buffer once it is filled.
    """
    length = plan.length
    if isinstance(tier, AddressableTier):
        await run(plan.write_into, tier.view(key), big=length > INLINE_COPY)
        tier.commit(key)
        return
    with staging.buffer(length) as view:
        if isinstance(tier, FilledWriteTier):
            cuts = fill_cuts(plan.header, tier.span_bytes)
            writer = PartWriter(plan, view, cuts, staging.hash_pool())
            try:
                await tier.write_filled(key, view, cuts, writer)
            finally:
                writer.wait()  # nothing may still read the buffer once it is reused
            return
        await run(plan.write_into, view, big=length > INLINE_COPY)
        await tier.write(key, view)


async def copy_out_addressable(
    tier: AddressableTier,
    parts: list[tuple[SegmentKey, SegmentHeader]],
    out: dict[str, torch.Tensor],
    dim: int,
) -> None:
    """Scatter every segment from ``tier``'s slots into ``out`` in one worker-thread hop.

    A history has one segment per turn, and each hop waits for the event loop (and the GIL)
    on a busy server. The caller keeps the slots from being freed until this returns.
    """
    cuda = any(t.is_cuda for t in out.values())
    views = [(tier.view(key), header) for key, header in parts]
    total = sum(header.length for _, header in parts)
    await run(_scatter_all, views, out, dim, cuda, big=total > INLINE_COPY)
    if isinstance(tier, ReadCountingTier):
        for _, header in parts:
            tier.note_read(header.length)
    if cuda:
        await anyio.to_thread.run_sync(torch.cuda.synchronize)


def scatter(
    buf: memoryview,
    header: SegmentHeader,
    out: dict[str, torch.Tensor],
    dim: int,
    offset: int,
    non_blocking: bool,
) -> None:
    """Copy one segment's tensors into ``out`` at token ``offset``."""
    # non_blocking only from the pinned arena, which stays valid until the final synchronize
    for name, view in segment_tensors(buf, header).items():
        copy_tensor(out[name].narrow(dim, offset, header.tokens), view, non_blocking=non_blocking)


class StreamScatter:
    """Copies a history's tensors into ``out`` as a :class:`StreamingReadTier` delivers its
    segments span by span (the ``consume`` of :meth:`StreamingReadTier.read_spans`).

    Each segment is cut into spans of about ``span`` bytes that hold whole tensors, so every
    tensor is copied once, from one span, straight into its place in ``out``.
    """

    def __init__(
        self,
        headers: list[SegmentHeader],
        out: dict[str, torch.Tensor],
        dim: int,
        span: int,
    ) -> None:
        self._headers = headers
        self._out = out
        self._dim = dim
        self.spans: list[list[tuple[int, int]]] = []
        self._groups: list[list[list[TensorSpec]]] = []
        self._offsets: list[int] = []
        offset = 0
        for header in headers:
            spans, groups = span_plan(header, span)
            self.spans.append(spans)
            self._groups.append(groups)
            self._offsets.append(offset)
            offset += header.tokens

    def __call__(self, item: int, k: int, view: memoryview) -> None:
        header = self._headers[item]
        start = self.spans[item][k][0]
        offset = self._offsets[item]
        for spec in self._groups[item][k]:
            if not spec.nbytes:
                continue
            src = tensor_at(view, spec, header.body_offset + spec.offset - start)
            dst = self._out[spec.name].narrow(self._dim, offset, header.tokens)
            copy_tensor(dst, src)


_RAMP = (1 << 20, 2 << 20, 4 << 20)
"""The first body parts' sizes in a part-by-part write: the device gets its first write
after a 1 MiB copy rather than a whole span's (about 1.5 ms sooner per 64 MiB append)."""


def fill_cuts(header: SegmentHeader, span: int) -> list[int]:
    """Where a segment written part by part (:class:`FilledWriteTier`) is cut: the header
    alone first (written last, once the checksum is known: a page, not a span's worth),
    then parts of whole tensors growing from 1 MiB to ``span`` bytes."""
    start = header.body_offset
    cuts = {0, start, header.length}
    parts = 0
    for spec in sorted(header.tensors, key=lambda s: s.offset):
        lo = header.body_offset + spec.offset
        if lo > start and lo - start >= min(_RAMP[parts] if parts < len(_RAMP) else span, span):
            cuts.add(lo)
            start = lo
            parts += 1
    return sorted(cuts)


def span_plan(
    header: SegmentHeader, span: int
) -> tuple[list[tuple[int, int]], list[list[TensorSpec]]]:
    """Cut a segment into read spans of about ``span`` bytes, each holding whole tensors.

    Returns the spans (4 KiB-aligned starts, consecutive ones overlapping by at most the
    page two tensors share; the first from 0, the last to the segment's end) and each span's
    tensors. A tensor larger than ``span`` gets a span of its own.
    """
    spans: list[tuple[int, int]] = []
    groups: list[list[TensorSpec]] = [[]]
    start = end = 0  # the current span, up to the end of its last tensor's page
    for spec in header.tensors:
        lo = header.body_offset + spec.offset
        hi = align_up(lo + spec.nbytes)
        if groups[-1] and hi > end and hi - start > span:
            spans.append((start, end))
            groups.append([])
            start = min(lo - lo % ALIGN, end)
        groups[-1].append(spec)
        end = max(end, hi)
    spans.append((start, header.length))
    return spans, groups


def _scatter_all(
    parts: list[tuple[memoryview, SegmentHeader]],
    out: dict[str, torch.Tensor],
    dim: int,
    non_blocking: bool,
) -> None:
    offset = 0
    for buf, header in parts:
        scatter(buf, header, out, dim, offset, non_blocking)
        offset += header.tokens


class Staging:
    """Reused, prefaulted, page-aligned buffers for segments on their way to or from a tier
    that has no addressable memory (the SSD tier).

    A fresh anonymous mapping per segment costs a page fault per 4 KiB on first touch (a
    64 MiB segment: 16,384 faults) on the critical path of every load and append. Buffers
    come back here after use and are handed out again; at most ``keep_bytes`` stay idle
    (256 MiB: two 64 MiB segments' worth for a pipelined load, and room for concurrent
    appends), or the last buffer used if it alone is larger, so an idle cache holds at most
    that much host memory beyond its tiers.
    """

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self._free: list[mmap.mmap] = []
        self._keep = keep_bytes
        self._hash_pool: ThreadPoolExecutor | None = None

    def hash_pool(self) -> ThreadPoolExecutor:
        """The thread that checksums segments being filled (one: parts hash in order), so
        a segment's copy and checksum run side by side."""
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="tieredkv-fill-hash")
        return self._hash_pool

    @contextlib.contextmanager
    def buffer(self, length: int) -> Iterator[memoryview]:
        """A buffer of exactly ``length`` bytes, valid inside the block."""
        fits = [b for b in self._free if length <= len(b) <= 2 * length]
        if fits:
            buf = min(fits, key=len)
            self._free.remove(buf)
        else:
            buf = prefaulted(max(-(-length // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE))
        view = memoryview(buf)[:length]
        try:
            yield view
        finally:
            try:
                view.release()
            except BufferError:  # a view still alive: let it free the mapping
                close_mapping(buf, "staging buffer")
            else:
                self._free.append(buf)
                # the newest buffer stays even if larger than the cap alone: a cache of
                # 256 MiB turns would otherwise map and fault one in for every append
                while len(self._free) > 1 and sum(len(b) for b in self._free) > self._keep:
                    close_mapping(self._free.pop(0), "staging buffer")

    def close(self) -> None:
        """Unmap every idle buffer and stop the hashing thread."""
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        while self._free:
            close_mapping(self._free.pop(), "staging buffer")


@contextlib.contextmanager
def scratch(length: int) -> Iterator[memoryview]:
    """A page-aligned temporary buffer (O_DIRECT-capable), unmapped when done."""
    buf = mmap.mmap(-1, length)
    view = memoryview(buf)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # a view still alive: freed with it
            view.release()
        close_mapping(buf, "scratch buffer")


async def run(fn: Callable[..., None], *args: Any, big: bool) -> None:
    """Run ``fn`` in a worker thread when the work is large, inline otherwise."""
    if big:
        await anyio.to_thread.run_sync(fn, *args)
    else:
        fn(*args)
