"""Segments to tensors and back: filling a tier's slot, and scattering a history into outputs."""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import anyio
import torch

from .._copy import copy_tensor, memmove, plain_cpu
from ..backends._buffers import address, anonymous, close_mapping
from ..backends._hugepages import huge_aligned, huge_page_size
from ..errors import InvalidArgumentError, InvalidTypeError
from ..payload import (
    ALIGN,
    Schema,
    SegmentHeader,
    TensorSpec,
    align_up,
    dtype_of,
    tensor_at,
)
from .outputs import OutputPool

__all__ = [
    "Scatter",
    "Staging",
    "Target",
    "check_apart",
    "check_into",
    "fill_cuts",
    "fresh",
    "run",
    "scratch",
    "span_plan",
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
    if not isinstance(out, Mapping):
        raise InvalidTypeError(
            f"out must map the session's tensor names to tensors, not a {type(out).__name__}"
        )

    def check(schema: Schema, tokens: int) -> dict[str, torch.Tensor]:
        if set(out) != set(schema.names):
            raise InvalidArgumentError(
                f"out has tensors {sorted(out)}, the session stores {sorted(schema.names)}"
            )
        for name, dt, shape in zip(schema.names, schema.dtypes, schema.shapes, strict=True):
            t = out[name]
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"out[{name!r}] is a {type(t).__name__}: pass torch tensors")
            if t.device.type == "meta":
                raise InvalidArgumentError(
                    f"out[{name!r}] is on the meta device, which holds no data: pass "
                    f"tensors on the CPU or a CUDA device"
                )
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
            if overlaps_itself(t, dim, tokens):
                raise InvalidArgumentError(
                    f"out[{name!r}] overlaps itself in memory (strides {t.stride()} for shape "
                    f"{tuple(t.shape)}, as expand() makes): its positions would overwrite "
                    f"each other; pass a tensor with memory of its own for each position"
                )
        check_apart(out, schema.token_dim, tokens)
        return dict(out)

    return check


def overlaps_itself(t: torch.Tensor, dim: int, tokens: int) -> bool:
    """Whether two of ``t``'s leading ``tokens`` positions along ``dim`` may share memory.
    Exact for the layouts views make (dense, permuted, sliced: each dimension's stride
    beyond the reach of the smaller ones); one that interleaves dimensions otherwise is
    counted as overlapping."""
    extent = [tokens if i == dim % max(t.dim(), 1) else n for i, n in enumerate(t.shape)]
    reach = 0
    for stride, n in sorted((st, n) for n, st in zip(extent, t.stride(), strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (n - 1)
    return False


def check_apart(out: Mapping[str, torch.Tensor], dim: int, tokens: int) -> None:
    """Refuse outputs whose places for the history overlap in memory (the same tensor under
    two names, or overlapping slices of one buffer): each tensor's bytes would overwrite
    another's (``InvalidArgumentError``, before anything is moved). Checked exactly for
    contiguous tensors, whose leading ``tokens`` positions along ``dim`` lie within one
    byte range; others (such as K and V interleaved in one buffer) are left as they are."""
    spans: list[tuple[int, int, str, torch.device]] = []
    for name, t in out.items():
        if not t.is_contiguous() or not t.numel() or not tokens:
            continue
        extent = [tokens if i == dim % t.dim() else n for i, n in enumerate(t.shape)]
        last = sum((n - 1) * st for n, st in zip(extent, t.stride(), strict=True))
        start = t.data_ptr()
        spans.append((start, start + (last + 1) * t.element_size(), name, t.device))
    spans.sort(key=lambda x: (str(x[3]), x[0]))
    # sorted by start: if any two overlap, so do two consecutive ones
    for (_, hi, a, dev), (lo2, _, b, dev2) in itertools.pairwise(spans):
        if dev == dev2 and lo2 < hi:
            raise InvalidArgumentError(
                f"out[{a!r}] and out[{b!r}] overlap in memory: each would overwrite the "
                f"other's history; pass separate tensors (or non-overlapping slices)"
            )


class Scatter:
    """Copies a history's tensors into ``out`` as a tier delivers its segments, span by span
    (the ``consume`` of :meth:`~tieredkv.backends.base.Tier.read`).

    Each segment is cut into spans of about ``span`` bytes that hold whole tensors (one
    span, the whole segment, when ``span`` is ``None``), so every tensor is copied once,
    from one span, straight into its place in ``out``. ``non_blocking`` copies into CUDA
    tensors without waiting: only from memory that stays valid until the caller
    synchronizes (a pinned tier's slots).
    """

    def __init__(
        self,
        headers: list[SegmentHeader],
        out: dict[str, torch.Tensor],
        dim: int,
        span: int | None,
        *,
        non_blocking: bool = False,
        takes: list[int] | None = None,
    ) -> None:
        self._headers = headers
        self._takes = takes if takes is not None else [h.tokens for h in headers]
        self._out = out
        self._dim = dim
        self._non_blocking = non_blocking
        self.spans: list[list[tuple[int, int]]] = []
        self._groups: list[list[list[TensorSpec]]] = []
        self._offsets: list[int] = []
        # segments laid out alike (a turn planned like the one before it shares its specs:
        # ``plan_segment`` remembers layouts) are cut alike: planned once per load, by the
        # identity of their specs (``headers`` keeps them alive, so no id is reused)
        cuts: dict[tuple[int, int, int], tuple[list[tuple[int, int]], list[list[TensorSpec]]]]
        cuts = {}
        offset = 0
        for header, take in zip(headers, self._takes, strict=True):
            same = (id(header.tensors), header.body_offset, header.length)
            planned = cuts.get(same)
            if planned is None:
                planned = span_plan(header, header.length if span is None else span)
                cuts[same] = planned
            self.spans.append(planned[0])
            self._groups.append(planned[1])
            self._offsets.append(offset)
            offset += take
        self._plans: dict[tuple[int, int], tuple[list[tuple[int, int, int]], int] | None] = {}
        self._templates: dict[tuple[int, int, int, int, int, int], _Template | None] = {}
        self._facts: dict[str, tuple[int, torch.dtype, tuple[int, ...], int] | None] = {}

    def __call__(self, item: int, k: int, view: memoryview) -> None:
        plan = self._moves(item, k)
        if plan is not None and plan[1] <= len(view):
            base = address(view)
            for to, rel, nbytes in plan[0]:
                memmove(to, base + rel, nbytes)
            return
        header = self._headers[item]
        start = self.spans[item][k][0]
        offset = self._offsets[item]
        take = self._takes[item]
        for spec in self._groups[item][k]:
            if not spec.nbytes:
                continue
            src = tensor_at(view, spec, header.body_offset + spec.offset - start)
            if take != header.tokens:  # a fork point inside this turn: its first tokens
                src = src.narrow(self._dim, 0, take)
            dst = self._out[spec.name].narrow(self._dim, offset, take)
            copy_tensor(dst, src, non_blocking=self._non_blocking)

    def landing(self, item: int, k: int) -> list[tuple[int, int, int]] | None:
        """Where span ``k`` of segment ``item`` goes, as byte moves (a
        :class:`~tieredkv.backends.base.LandingConsumer`): the moves :meth:`__call__` makes,
        so that a tier can read the bytes straight into the outputs."""
        plan = self._moves(item, k)
        return None if plan is None else plan[0]

    def _moves(self, item: int, k: int) -> tuple[list[tuple[int, int, int]], int] | None:
        """Span ``k`` of segment ``item`` as plain byte moves (destination address, offset in
        the span, length) and the span length they need, where every tensor of it lands as
        one contiguous block of a contiguous CPU output along its first dimension (a ctypes
        ``memmove`` each: no tensor or view made per tensor per span, which cost about
        15 us apiece); ``None`` where any does not, and :meth:`__call__` copies tensor by
        tensor. Segments laid out alike share a template (:meth:`_template`): each adds
        only its own place along the outputs."""
        if self._dim != 0:
            return None
        key = (item, k)
        if key in self._plans:
            return self._plans[key]
        plan: tuple[list[tuple[int, int, int]], int] | None = None
        offset, take = self._offsets[item], self._takes[item]
        template = self._template(item, k)
        if template is not None and offset + take <= template.rows:
            moves = [(at + offset * row, rel, row * take) for at, row, rel in template.places]
            plan = (moves, template.need)
        self._plans[key] = plan
        return plan

    def _template(self, item: int, k: int) -> _Template | None:
        """What span ``k`` of segment ``item`` moves, but for where along the outputs the
        segment goes: per tensor its output's address and bytes per row and its offset in
        the span; ``None`` where some tensor cannot land as one block. Made once per
        layout (the identity of the header's specs, its body offset, length and token
        count), the token count taken and the span."""
        header = self._headers[item]
        take = self._takes[item]
        key = (id(header.tensors), header.body_offset, header.length, header.tokens, take, k)
        if key in self._templates:
            return self._templates[key]
        start = self.spans[item][k][0]
        places: list[tuple[int, int, int]] = []
        need = 0
        rows = sys.maxsize
        template: _Template | None = None
        for spec in self._groups[item][k]:
            if not spec.nbytes:
                continue
            out = self._output(spec.name)
            if (
                out is None
                or out[1] != dtype_of(spec.dtype)
                or len(out[2]) != len(spec.shape)
                or out[2][1:] != tuple(spec.shape[1:])
                or spec.shape[0] != header.tokens
            ):
                break
            row = out[3]
            if spec.nbytes != row * header.tokens:
                break
            rel = header.body_offset + spec.offset - start
            if rel < 0:
                break
            places.append((out[0], row, rel))
            need = max(need, rel + row * take)
            rows = min(rows, out[2][0])
        else:
            template = _Template(places, need, rows)
        self._templates[key] = template
        return template

    def _output(self, name: str) -> tuple[int, torch.dtype, tuple[int, ...], int] | None:
        """Output ``name`` as its address, dtype, shape and bytes per row along dimension 0,
        looked up once per load rather than once per segment; ``None`` where it is missing,
        has no dimension, or is not a contiguous CPU tensor that plain byte moves can fill."""
        if name in self._facts:
            return self._facts[name]
        out = self._out.get(name)
        facts = None
        if out is not None and out.dim() and plain_cpu(out):
            shape = tuple(out.shape)  # (bytes per row from the shape: no view made)
            facts = (out.data_ptr(), out.dtype, shape, math.prod(shape[1:]) * out.element_size())
        self._facts[name] = facts
        return facts


class _Template(NamedTuple):
    """A span's moves for every segment laid out alike (:meth:`Scatter._template`)."""

    places: list[tuple[int, int, int]]
    """Per tensor: its output's address, the output's bytes per row, the offset in the span."""
    need: int
    """The span length the moves need."""
    rows: int
    """The fewest rows of the outputs (a segment's rows must end within it)."""


_RAMP = (1 << 20, 2 << 20, 4 << 20)
"""The first body parts' sizes in a part-by-part write: the device gets its first write
after a 1 MiB copy rather than a whole span's (about 1.5 ms sooner per 64 MiB append)."""


def fill_cuts(header: SegmentHeader, span: int) -> list[int]:
    """Where a segment written part by part (a streaming tier's ``write_filled``) is cut: the header
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
    tensors. A tensor larger than ``span`` gets a span of its own. A last span that would
    hold less than ``span // 8`` bytes of its own joins the one before it: a turn of
    exactly ``span`` bytes of tensors (plus its header) is one read, not a full one and a
    small one.
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
    if len(spans) > 1 and header.length - spans[-2][1] < span // _TAIL:
        spans[-2:] = [(spans[-2][0], header.length)]
        groups[-2:] = [groups[-2] + groups[-1]]
    return spans, groups


_TAIL = 8
"""A last span of under ``span // _TAIL`` bytes of its own joins the one before it
(:func:`span_plan`)."""


class _Buffer(NamedTuple):
    """A staging buffer: ``size`` bytes of the mapping ``mm`` from ``offset``."""

    mm: mmap.mmap
    offset: int
    size: int


class Staging:
    """Reused page-aligned buffers for segments on their way to or from a tier that has no
    addressable memory (the SSD tier's appends, plain tiers' reads and writes), on huge
    pages where the kernel gives them.

    A fresh anonymous mapping per segment costs a page fault per 4 KiB on first touch (a
    64 MiB segment: 16,384 faults) on the critical path of every load and append. Buffers
    come back here after use and are handed out again; at most ``keep_bytes`` stay idle
    (256 MiB: two 64 MiB segments' worth for a pipelined load, and room for concurrent
    appends), or the last buffer used if it alone is larger, so an idle cache holds at most
    that much host memory beyond its tiers.

    A new buffer is handed out unpopulated: its pages fault in where it is first written,
    in the worker thread that serializes a segment into it or reads one into it (a
    streamed append: part by part, while the parts before are written). Populating it
    here, as this class once did, faulted every page in on the event loop's thread
    (``madvise(MADV_POPULATE_WRITE)``): 2.6 ms for an 8 MiB turn and 22-32 ms for a 64 MiB
    one, during which no other request of the server moved.

    **Huge pages.** With ``huge_pages``, a buffer of a huge page (2 MiB) or more is mapped
    from a huge-page boundary and asks for transparent huge pages
    (``madvise(MADV_HUGEPAGE)``), so it faults in 2 MiB at a time and an O_DIRECT write
    from it is cut into fewer device requests (each carries a bounded number of physically
    contiguous segments). On the 2-core VM (6 December 2026,
    ``benchmarks/_staging_pages.py``): an 8 MiB ``pwrite`` + ``fsync`` in the SSD
    writer's parts took a median of 3.71 ms from huge pages against 4.58 ms from 4 KiB
    pages; the first copy of 8 MiB into a new buffer took 1.1-1.9 ms against 3.5-5.0 ms,
    but 22 ms for one buffer of twenty (that VM's balloon takes free 2 MiB blocks back, so
    a new huge page can fault on the host too). A load's outputs, made for every load, do
    not ask for huge pages when made, for that reason (:mod:`tieredkv._cache.outputs`); a
    staging buffer is made once and then reused by every append, so its first use pays
    that at most once.
    """

    def __init__(self, keep_bytes: int = 256 << 20, *, huge_pages: bool = True) -> None:
        self._free: list[_Buffer] = []
        self._keep = keep_bytes
        self._huge = huge_page_size() if huge_pages else 0

    def _new(self, length: int) -> _Buffer:
        """A new buffer of at least ``length`` bytes (a whole number of pages)."""
        size = max(-(-length // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)
        huge = self._huge if size >= self._huge > 0 else 0
        mm, offset = huge_aligned(size, huge)
        if huge:
            with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB ones
                mm.madvise(mmap.MADV_HUGEPAGE, offset, size - size % huge)
        return _Buffer(mm, offset, size)

    @contextlib.contextmanager
    def buffer(self, length: int) -> Iterator[memoryview]:
        """A buffer of exactly ``length`` bytes, valid inside the block."""
        fits = [b for b in self._free if length <= b.size <= 2 * length]
        if fits:
            block = min(fits, key=lambda b: b.size)
            self._free.remove(block)
        else:
            block = self._new(length)
        buf = block.mm
        view = memoryview(buf)[block.offset : block.offset + length]
        try:
            yield view
        finally:
            try:
                view.release()
            except BufferError:  # a view still alive: let it free the mapping
                if sys.exc_info()[1] is None:
                    close_mapping(buf, "staging buffer")
                # else the failure on its way out holds it (views in its traceback's
                # frames): the mapping goes with that error, not one for the application
            else:
                self._free.append(block)
                # the newest buffer stays even if larger than the cap alone: a cache of
                # 256 MiB turns would otherwise map and fault one in for every append
                while len(self._free) > 1 and sum(b.size for b in self._free) > self._keep:
                    close_mapping(self._free.pop(0).mm, "staging buffer")

    def close(self) -> None:
        """Unmap every idle buffer (collecting garbage first where a view of one is still
        alive: a failed write's traceback holds views of its buffer in a reference cycle,
        as for a tier's memory)."""
        while self._free:
            close_mapping(self._free.pop().mm, "staging buffer", collect=True)


@contextlib.contextmanager
def scratch(length: int) -> Iterator[memoryview]:
    """A page-aligned temporary buffer (O_DIRECT-capable), unmapped when done."""
    buf = anonymous(length)
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
