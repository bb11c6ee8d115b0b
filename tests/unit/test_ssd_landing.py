"""Spans read straight into a load's outputs (``preadv`` into the tensors' memory, no span
buffer and no copy): where the SSD tier does it, the bytes are exact, damage and I/O
errors are still caught, and a span it cannot land (old layout, unaligned outputs,
another token dimension) is read and copied as before."""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.cancellation import CANCELS, cancellable
from tests.faults import FaultInjector
from tests.hugepages import collapse_works
from tests.invariants import problems
from tieredkv import SSDTier, TieredKVCache
from tieredkv._cache.gather import Scatter, span_plan
from tieredkv._cache.outputs import POOLED_MIN_BYTES
from tieredkv.backends import _buffers
from tieredkv.backends.base import LandingConsumer
from tieredkv.backends.registry import tier_from_config
from tieredkv.backends.ssd import segment_file_name, stream
from tieredkv.backends.ssd.layout import preadv_full
from tieredkv.backends.ssd.reader import READ_DEPTH, VERIFYING
from tieredkv.errors import InvalidTypeError, SessionNotFoundError, TierIOError
from tieredkv.payload import LAND_ALIGN, LAND_MIN, plan_segment

CAPACITY = 256 << 20
SECRET = b"a secret of at least 16 bytes"
SPAN = 256 << 10
"""A span size that puts the big tensors in spans of their own (the small one's output, not
page-aligned, keeps its span from landing)."""


def turns(n: int, *, dim: int = 0, rows: int = 128) -> list[dict[str, torch.Tensor]]:
    """``n`` turns of four fp16 tensors of ``rows`` tokens and more (2 KiB per token: 256 KiB
    and more at the default), an int8 one (too small to land) and an empty one. A history
    of four or more is over 1 MiB per tensor (``POOLED_MIN_BYTES``), so a load's outputs
    come from the cache's pool of page-aligned memory; a shorter one's come from
    ``torch.empty``, whose 64-byte alignment lands a span in O_DIRECT's 512-byte alignment
    only by chance: a test that needs spans to land loads :data:`LANDS`."""
    g = torch.Generator().manual_seed(n)
    out = []
    for t in range(n):
        tokens = rows + 8 * t

        def shape(*rest: int, tokens: int = tokens) -> tuple[int, ...]:
            return (tokens, *rest) if dim == 0 else (rest[0], tokens, *rest[1:])

        turn = {f"l{i}": torch.randn(*shape(1024), generator=g).half() for i in range(4)}
        turn["small"] = torch.randint(-9, 9, shape(16), generator=g, dtype=torch.int8)
        turn["empty"] = torch.empty(shape(0))
        out.append(turn)
    return out


LANDS = 4
"""Turns whose history is large enough for its spans to land (see :func:`turns`)."""

WHOLE = 8 << 20
"""The default span size: every segment of :func:`landing_turns` is one span."""


def landing_turns(n: int) -> list[dict[str, torch.Tensor]]:
    """:func:`turns` without the small tensor, whose output (not page-aligned) would keep a
    segment read in one span from landing."""
    return [{k: v for k, v in part.items() if k != "small"} for part in turns(n)]


def landing(whole: bool) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Turns whose history lands, and the span size: segments of several spans (of which
    the small tensor's is copied), or, ``whole``, of one span each."""
    return (landing_turns(LANDS), WHOLE) if whole else (turns(LANDS), SPAN)


def joined(parts: list[dict[str, torch.Tensor]], dim: int = 0) -> dict[str, torch.Tensor]:
    return {name: torch.cat([p[name] for p in parts], dim=dim) for name in parts[0]}


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items()
    )


class Counting(Scatter):
    """A Scatter that counts the spans it was handed (the ones the tier did not land)."""

    consumed = 0
    landed_asked = 0

    def __call__(self, item: int, k: int, view: memoryview) -> None:
        type(self).consumed += 1
        super().__call__(item, k, view)

    def landing(self, item: int, k: int) -> list[tuple[int, int, int]] | None:
        type(self).landed_asked += 1
        return super().landing(item, k)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[Counting]:
    Counting.consumed = Counting.landed_asked = 0
    monkeypatch.setattr("tieredkv._cache.tierio.Scatter", Counting)
    return Counting


def test_a_history_of_lands_turns_comes_from_the_pool() -> None:
    """The tests that count landed spans load a history whose large outputs are pooled
    (page-aligned): with fewer turns they come from ``torch.empty`` and land by chance."""
    assert joined(turns(LANDS))["l0"].nbytes >= POOLED_MIN_BYTES
    assert joined(turns(LANDS - 1))["l0"].nbytes < POOLED_MIN_BYTES


def test_large_tensors_are_placed_for_landing() -> None:
    plan = plan_segment("s", 0, turns(1)[0], token_dim=0, answer_tokens=1)
    header = plan.header
    assert header.body_offset % LAND_ALIGN == 0
    for spec in header.tensors:
        if spec.nbytes >= LAND_MIN:
            assert (header.body_offset + spec.offset) % LAND_ALIGN == 0
    assert isinstance(Scatter([header], {}, 0, None), LandingConsumer)


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_a_load_lands_spans_in_the_outputs_with_exact_bytes(
    tmp_path: Path, counting: type[Counting], secret: bytes | None
) -> None:
    """Spans of large tensors only go straight into the outputs; the span holding the
    small tensor is copied. The tier probed O_DIRECT's alignment (512 on this SSD)."""
    parts = turns(5)
    tier = SSDTier(tmp_path, CAPACITY, chunk_size=SPAN, secret=secret)
    async with TieredKVCache([tier]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        got = await cache.load("s")
        assert same(got, joined(parts))
        assert tier.direct_io  # tmp_path is on the SSD here
        assert counting.landed_asked > 0
        assert counting.consumed < counting.landed_asked  # the big tensors' spans landed


async def test_old_layout_segments_are_read_and_copied(
    tmp_path: Path, counting: type[Counting]
) -> None:
    """Segments written before large tensors were aligned for landing (64-byte offsets)
    still load exactly, through the span buffers, next to new ones in one history."""
    parts = turns(4)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, chunk_size=SPAN)]) as cache:
        with pytest.MonkeyPatch.context() as old:
            old.setattr("tieredkv.payload._encode.LAND_MIN", 1 << 62)
            for i, part in enumerate(parts[:2]):
                await cache.append("s", part, answer_tokens=i)
        for i, part in enumerate(parts[2:]):
            await cache.append("s", part, answer_tokens=i)
        got = await cache.load("s")
        assert same(got, joined(parts))
        assert 0 < counting.consumed < counting.landed_asked  # old ones copied, new landed


async def test_other_token_dims_and_caller_tensors_are_copied(
    tmp_path: Path, counting: type[Counting]
) -> None:
    parts = turns(3, dim=1)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)], token_dim=1) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        assert same(await cache.load("s"), joined(parts, 1))
        out = {k: torch.zeros_like(v) for k, v in joined(parts, 1).items()}
        await cache.load_into("s", out)
        assert same(out, joined(parts, 1))
    assert counting.consumed > 0


async def test_buffered_io_lands_spans_at_any_alignment(
    tmp_path: Path, counting: type[Counting]
) -> None:
    parts = turns(3, rows=33)  # odd token counts: 66 KiB tensors, 512-aligned
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, direct_io=False)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        assert same(await cache.load("s"), joined(parts))
    assert counting.consumed < counting.landed_asked


def flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x55]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_damage_in_a_landed_tensor_is_caught(
    tmp_path: Path, counting: type[Counting], secret: bytes | None
) -> None:
    """A flipped byte in the middle of a large tensor of the second segment: the checksum
    covers what landed in the outputs, so the load is a counted miss (the damaged history
    is never returned) and the file is quarantined."""
    parts = turns(LANDS)
    async with TieredKVCache(
        [SSDTier(tmp_path, CAPACITY, chunk_size=SPAN, secret=secret)]
    ) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        header = plan_segment("s", 1, parts[1], token_dim=0, answer_tokens=1).header
        spec = header.tensors[2]
        path = tmp_path / "segments" / segment_file_name(("s", 1))
        flip(path, header.body_offset + spec.offset + spec.nbytes // 2)
        misses = cache.stats().misses
        with pytest.raises(SessionNotFoundError):
            await cache.load("s")
        assert cache.stats().misses == misses + 1
        assert counting.consumed < counting.landed_asked
    assert list((tmp_path / "quarantine").iterdir())


async def test_an_io_error_in_a_landed_read_is_a_tier_error(
    tmp_path: Path, counting: type[Counting]
) -> None:
    """EIO from the ``preadv`` of a landed span: TierIOError, nothing deleted, and the
    next load returns the history exactly."""
    parts = turns(LANDS)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, chunk_size=SPAN)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        with FaultInjector() as faults:
            faults.fail_nth("preadv", faults.calls["preadv"] + 2, errno.EIO)
            with pytest.raises(TierIOError):
                await cache.load("s")
        assert counting.consumed < counting.landed_asked
        assert same(await cache.load("s"), joined(parts))


@pytest.mark.parametrize("whole", [False, True], ids=["spans", "whole"])
@pytest.mark.parametrize("how", CANCELS)
async def test_a_landed_load_survives_cancellation(
    tmp_path: Path, counting: type[Counting], how: str, whole: bool
) -> None:
    """A load whose spans land in its outputs, cancelled at several points by each kind of
    cancellation: afterwards the cache, tier, channel and files agree, and the history
    loads back exactly (no read still writes into memory the next load is given). With
    ``whole``, every segment is one span, read, verified and closed in one reader job."""
    parts, chunk = landing(whole)
    want = joined(parts)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, chunk_size=chunk)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        for delay in (0.0, 0.0005, 0.002, 0.01):
            await cancellable(how, delay, lambda: cache.load("s"))
            assert problems(cache) == []
            assert same(await cache.load("s"), want)
    assert counting.consumed == 0 if whole else counting.consumed < counting.landed_asked


@pytest.mark.parametrize("whole", [False, True], ids=["spans", "whole"])
async def test_an_io_error_at_each_os_call_of_a_landed_load_loses_nothing(
    tmp_path: Path, counting: type[Counting], whole: bool
) -> None:
    """Fail each os call of a landed load in turn: the load raises (a miss or an I/O error)
    or returns the exact history, the cache stays consistent, and whatever is still stored
    loads back exactly. With ``whole``, every segment is one span (one ``preadv`` each)."""
    parts, chunk = landing(whole)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, chunk_size=chunk)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        with FaultInjector() as faults:
            with faults.paused():
                before = dict(faults.calls)
                await cache.load("s")
            calls = {site: n - before.get(site, 0) for site, n in faults.calls.items()}
        if whole:
            assert counting.consumed == 0
            assert calls.get("preadv", 0) == LANDS, calls
        else:
            assert counting.consumed < counting.landed_asked
            assert calls.get("preadv", 0) >= 3, calls
        await fail_each_call(cache, parts, calls, lambda: cache.load("s"))


async def fail_each_call(
    cache: TieredKVCache,
    parts: list[dict[str, torch.Tensor]],
    calls: dict[str, int],
    read: Callable[[], Awaitable[dict[str, torch.Tensor]]],
) -> None:
    """Fail each of the os ``calls`` one read of session ``s`` (``parts``) made, in turn,
    with EIO: ``read`` raises (a miss or an I/O error) or returns the exact history, the
    cache stays consistent, and whatever is still stored reads back exactly (a history lost
    to a damaged read is stored again before the next call fails)."""
    want = joined(parts)
    for site, count in calls.items():
        for nth in range(1, count + 1):
            if "s" not in cache:
                for i, part in enumerate(parts):
                    await cache.append("s", part, answer_tokens=i)
            with FaultInjector() as faults:
                faults.fail_nth(site, faults.calls[site] + nth, errno.EIO)
                try:
                    got = await read()
                except (TierIOError, SessionNotFoundError):
                    pass
                else:
                    assert same(got, want)
            assert problems(cache) == [], (site, nth)
            if "s" in cache:
                assert same(await read(), want)


# -- segments read whole: one span each, read and verified in one reader job ---------------


def whole_spans(parts: list[dict[str, torch.Tensor]]) -> list[int]:
    """How many spans each segment of ``parts`` is streamed in at :data:`WHOLE`."""
    headers = [
        plan_segment("s", i, p, token_dim=0, answer_tokens=i).header for i, p in enumerate(parts)
    ]
    return [len(span_plan(h, WHOLE)[0]) for h in headers]


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_whole_segments_land_with_exact_bytes(
    tmp_path: Path, counting: type[Counting], secret: bytes | None
) -> None:
    """Each segment one span: read straight into the outputs with one ``preadv`` and
    verified right after it, none consumed."""
    parts = landing_turns(LANDS)
    assert whole_spans(parts) == [1] * LANDS
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, secret=secret)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        assert same(await cache.load("s"), joined(parts))
    assert counting.landed_asked == LANDS
    assert counting.consumed == 0


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("where", ["header", "tensor", "padding"])
async def test_damage_in_a_whole_landed_segment_is_caught(
    tmp_path: Path, counting: type[Counting], secret: bytes | None, where: str
) -> None:
    """A flipped byte in the header, in a tensor that landed in the outputs, or in the
    padding at the end of the second segment (read whole, in one span): the load is a
    counted miss (the damaged history is never returned) and the file is quarantined."""
    parts = landing_turns(LANDS)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY, secret=secret)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        header = plan_segment("s", 1, parts[1], token_dim=0, answer_tokens=1).header
        spec = header.tensors[2]
        path = tmp_path / "segments" / segment_file_name(("s", 1))
        at = {
            "header": header.body_offset // 2,
            "tensor": header.body_offset + spec.offset + spec.nbytes // 2,
            "padding": path.stat().st_size - 1,
        }[where]
        flip(path, at)
        misses = cache.stats().misses
        with pytest.raises(SessionNotFoundError):
            await cache.load("s")
        assert cache.stats().misses == misses + 1
        assert "s" not in cache
        assert problems(cache) == []
    assert counting.landed_asked >= 1
    assert counting.consumed == 0
    assert list((tmp_path / "quarantine").iterdir())


async def test_a_truncated_whole_segment_is_a_miss(
    tmp_path: Path, counting: type[Counting]
) -> None:
    """The second segment's file cut a page short: the one ``preadv`` of its span comes
    back short, and the load is a counted miss, the file quarantined."""
    parts = landing_turns(LANDS)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        path = tmp_path / "segments" / segment_file_name(("s", 1))
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(SessionNotFoundError):
            await cache.load("s")
        assert cache.stats().misses == 1
        assert problems(cache) == []
    assert counting.consumed == 0
    assert list((tmp_path / "quarantine").iterdir())


async def test_verifying_whole_segments_does_not_hold_back_reads(
    tmp_path: Path, counting: type[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment read whole frees its read's slot as soon as the read returns: while the
    first segments' checksums are still being computed (held here until every read was
    issued), the stream goes on issuing reads, up to ``READ_DEPTH + VERIFYING`` jobs, but
    never more than ``READ_DEPTH`` reads at once; the history comes back exact."""
    n = READ_DEPTH + VERIFYING // 2  # more segments than reads in flight
    parts = landing_turns(n)
    assert whole_spans(parts) == [1] * n
    lock = threading.Lock()
    reads = {"issued": 0, "now": 0, "most": 0}
    all_issued = threading.Event()
    real_preadv = preadv_full
    real_hash = stream._SegmentRead.hash_here

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        with lock:
            reads["issued"] += 1
            reads["now"] += 1
            reads["most"] = max(reads["most"], reads["now"])
            if reads["issued"] == n:
                all_issued.set()
        try:
            return real_preadv(fd, views, offset)
        finally:
            with lock:
                reads["now"] -= 1

    waited: list[bool] = []

    def slow_hash(self: Any, pieces: list[memoryview], start: int, end: int) -> None:
        waited.append(all_issued.wait(10.0))
        real_hash(self, pieces, start, end)

    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        monkeypatch.setattr(stream, "preadv_full", preadv)
        monkeypatch.setattr(stream._SegmentRead, "hash_here", slow_hash)
        assert same(await cache.load("s"), joined(parts))
        assert problems(cache) == []
    assert reads["issued"] == n
    assert waited == [True] * n  # every read was issued while the first hashes waited
    assert 1 <= reads["most"] <= READ_DEPTH
    assert counting.consumed == 0


def unaligned_like(want: dict[str, torch.Tensor], off: int = 64) -> dict[str, torch.Tensor]:
    """Zeroed tensors shaped like ``want`` whose memory starts ``off`` bytes past a 512-byte
    boundary, as ``torch.empty``'s large tensors do (64 bytes into a page): no O_DIRECT
    read lands in them, whatever the allocator does."""
    out = {}
    for name, t in want.items():
        if not t.nbytes:
            out[name] = torch.empty_like(t)
            continue
        raw = torch.zeros(t.nbytes + 1024, dtype=torch.uint8)
        skip = (off - raw.data_ptr()) % 512
        out[name] = raw[skip : skip + t.nbytes].view(t.dtype).view(t.shape)
        assert out[name].data_ptr() % 512 == off
    return out


async def test_load_into_unaligned_tensors_reuses_its_span_buffers(
    tmp_path: Path, counting: type[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs no read can land in (a caller's ``torch.empty`` tensors) make every span a
    copied one, held in a span buffer until copied out: the stream then keeps no more of
    them than the tier keeps for the next stream, so a second ``load_into`` of a history
    of more segments than that maps no new buffer (it used to map six here, each faulted
    in whole by its read); the bytes are exact every time."""
    n = READ_DEPTH + VERIFYING + 4  # more segments than the tier keeps buffers
    parts = landing_turns(n)
    assert whole_spans(parts) == [1] * n
    want = joined(parts)
    mapped: list[int] = []
    real = _buffers.anonymous

    def counted(size: int, **kwargs: Any) -> Any:
        mapped.append(size)
        return real(size, **kwargs)

    monkeypatch.setattr(stream, "anonymous", counted)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        news = []
        for _ in range(3):
            out = unaligned_like(want)
            before = len(mapped)
            assert await cache.load_into("s", out) == want["l0"].shape[0]
            assert same(out, want)
            news.append(len(mapped) - before)
        assert problems(cache) == []
    assert news[0] > 0
    assert news[1:] == [0, 0]
    assert counting.consumed == 3 * n  # every span copied, none landed


async def settled(collapser: Any, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    for _ in range(1_000_000):  # a polled condition: the collapser's thread
        if collapser._worker is None or time.monotonic() >= deadline:
            break
        await anyio.sleep(0.01)


async def test_span_buffers_a_copied_span_filled_become_huge_pages(tmp_path: Path) -> None:
    """A span buffer that a copied span filled is collapsed into huge pages once the stream
    gives it back (where the kernel can), and the next load_into reads into it exactly;
    buffers of spans that landed (touched only for their header) are left alone."""
    n = READ_DEPTH
    # 5 MiB segments: the part of a buffer a copied span fills holds a whole huge page
    parts = [{k: v for k, v in p.items() if k != "small"} for p in turns(n, rows=640)]
    want = joined(parts)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        collapser = cache._core.tiers[0]._stream._collapser  # type: ignore[attr-defined]
        for _ in range(2):
            assert same(await cache.load("s"), want)  # lands: nothing to collapse
        await settled(collapser)
        assert collapser.collapsed == 0
        for _ in range(3):
            out = unaligned_like(want)
            await cache.load_into("s", out)
            assert same(out, want)
            await settled(collapser)
        if collapse_works():
            assert collapser.collapsed >= n  # at least one huge page per buffer filled
            assert collapser.failures == 0
        else:
            assert not collapser.active
        assert problems(cache) == []


async def test_span_buffers_stay_on_small_pages_with_huge_pages_false(tmp_path: Path) -> None:
    """``SSDTier(huge_pages=False)`` (or ``"huge_pages": false`` in a configuration) keeps
    its span buffers on 4 KiB pages: copied spans read exactly, nothing is collapsed."""
    parts = [{k: v for k, v in p.items() if k != "small"} for p in turns(READ_DEPTH, rows=640)]
    want = joined(parts)
    tier = tier_from_config(
        {"kind": "ssd", "directory": str(tmp_path), "capacity": CAPACITY, "huge_pages": False}
    )
    async with TieredKVCache([tier]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        collapser = tier._stream._collapser  # type: ignore[attr-defined]
        assert not collapser.active
        for _ in range(3):
            out = unaligned_like(want)
            await cache.load_into("s", out)
            assert same(out, want)
        assert collapser._worker is None
        assert collapser.collapsed == 0
        assert problems(cache) == []


def test_a_bad_huge_pages_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidTypeError, match="huge_pages must be a bool, not int"):
        SSDTier(tmp_path, CAPACITY, huge_pages=1)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing made


def copied_turns() -> list[dict[str, torch.Tensor]]:
    """More whole segments than reads in flight, of 5 MiB each: a ``load_into`` of them into
    unaligned outputs copies every span, lowers the stream's limit, reuses its buffers and
    has them collapsed into huge pages in the background meanwhile."""
    return [{k: v for k, v in p.items() if k != "small"} for p in turns(READ_DEPTH + 2, rows=640)]


@pytest.mark.parametrize("how", CANCELS)
async def test_a_copied_load_into_survives_cancellation(tmp_path: Path, how: str) -> None:
    """``load_into`` unaligned outputs (every span read into a span buffer and copied),
    cancelled at several points by each kind of cancellation, while the tier collapses the
    buffers earlier calls filled: afterwards the cache, tier, channel and files agree, and
    the history loads back exactly into fresh outputs."""
    parts = copied_turns()
    want = joined(parts)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        for delay in (0.0, 0.0005, 0.002, 0.01, 0.03):
            out = unaligned_like(want)
            await cancellable(how, delay, functools.partial(cache.load_into, "s", out))
            assert problems(cache) == []
            again = unaligned_like(want)
            await cache.load_into("s", again)
            assert same(again, want)


async def test_an_io_error_at_each_os_call_of_a_copied_load_into_loses_nothing(
    tmp_path: Path,
) -> None:
    """Fail each os call of a ``load_into`` whose spans are all copied, in turn: it raises
    (a miss or an I/O error) or fills the outputs exactly, the cache stays consistent, and
    whatever is still stored loads back exactly."""
    parts = copied_turns()
    want = joined(parts)
    async with TieredKVCache([SSDTier(tmp_path, CAPACITY)]) as cache:
        for i, part in enumerate(parts):
            await cache.append("s", part, answer_tokens=i)
        with FaultInjector() as faults:
            with faults.paused():
                before = dict(faults.calls)
                await cache.load_into("s", unaligned_like(want))
            calls = {site: n - before.get(site, 0) for site, n in faults.calls.items()}
        assert calls.get("preadv", 0) + calls.get("pread", 0) >= len(parts), calls

        async def read() -> dict[str, torch.Tensor]:
            out = unaligned_like(want)
            await cache.load_into("s", out)
            return out

        await fail_each_call(cache, parts, calls, read)
