"""The tier contract kit: check that a tier of your own keeps the :class:`~tieredkv.Tier`
protocol, from your own tests.

:func:`check_tier` opens tiers from your factory and runs every check of :data:`CHECKS` on a
fresh one: real segments (:func:`~tieredkv.payload.plan_segment`) written, read back and
compared byte for byte; reservations, release, delete and the byte budget; the errors the
protocol names; exact statistics; closing and reopening; a cancelled write or read leaving
nothing behind; the vectored read with spans, a consumer and an order; and, for an
:class:`~tieredkv.AddressableTier`, its in-place views. These are the checks tieredkv's own
tiers pass in its test suite.

In a pytest suite (``pytest-asyncio`` or anyio's plugin runs the coroutine)::

    from tieredkv.testing import check_tier

    async def test_my_tier_keeps_the_contract(tmp_path):
        await check_tier(lambda capacity: MyTier(tmp_path / "tier", capacity))

or one test per check, to see each pass or fail by name::

    @pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
    async def test_contract(check, tmp_path):
        await run_check(check, lambda capacity: MyTier(tmp_path / "tier", capacity))

Only for tests: the checks inspect memory and buffers directly and take seconds.
"""

from __future__ import annotations

import contextlib
import mmap
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import torch

from .backends.base import AddressableTier, SegmentKey, Tier
from .errors import ClosedError
from .payload import ALIGN, SegmentHeader, plan_segment

__all__ = [
    "CHECKS",
    "Check",
    "Segment",
    "TierContractError",
    "TierFactory",
    "aligned_buffer",
    "check_tier",
    "make_segment",
    "read_back",
    "run_check",
    "store",
    "unaligned_buffer",
]

TierFactory = Callable[[int], Tier]
"""Makes a new, unopened tier of the given capacity in bytes, on empty storage: each check
runs on a tier of its own, so a persistent tier needs a fresh place per call (a new
directory, a new key prefix), or the check finds the last one's segments."""


class TierContractError(AssertionError):
    """A tier broke the contract: the message names the check and what differed."""


# -- real segments ------------------------------------------------------------------------


class Segment:
    """One serialized segment in an anonymous ``mmap`` (page-aligned, as the cache's buffers
    are), plus its exact bytes to compare what a tier gives back. ``base``: a fork's
    first segment, listing the ``(owner, seq, tokens)`` it inherits (and ``base_ids``,
    their :func:`~tieredkv.payload.segment_id`, where given)."""

    def __init__(
        self,
        session: str,
        seq: int,
        tokens: int,
        *,
        seed: int,
        base: tuple[tuple[str, int, int], ...] = (),
        base_ids: tuple[bytes, ...] = (),
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        tensors = {
            name: torch.randint(-(2**15), 2**15, (tokens, 64), dtype=torch.int16, generator=gen)
            for name in ("k", "v")
        }
        plan = plan_segment(
            session, seq, tensors, token_dim=0, answer_tokens=seq + 1, base=base, base_ids=base_ids
        )
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


def make_segment(session: str, seq: int, tokens: int, *, seed: int = 0) -> Segment:
    """A segment of ``tokens`` tokens (two int16 tensors of width 64: 256 bytes a token)
    with seeded random content."""
    return Segment(session, seq, tokens, seed=seed)


@contextlib.contextmanager
def aligned_buffer(length: int) -> Iterator[memoryview]:
    """A page-aligned, zeroed, writable buffer of ``length`` bytes."""
    mm = mmap.mmap(-1, length)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        mm.close()


@contextlib.contextmanager
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


async def store(tier: Tier, s: Segment) -> None:
    """Reserve and write ``s`` (the reservation must succeed)."""
    _ok(tier.reserve(s.key, s.length), f"reserve({s.key}, {s.length}) refused")
    await tier.write(s.key, s.view)


async def read_back(tier: Tier, s: Segment, *, aligned: bool = True) -> bytes:
    """The bytes ``tier`` holds for ``s``, read into an aligned or unaligned buffer."""
    buffer = aligned_buffer if aligned else unaligned_buffer
    with buffer(tier.length(s.key)) as out:
        await tier.read([s.key], [out])
        return bytes(out)


# -- the checks ---------------------------------------------------------------------------


class Context:
    """What a check gets besides its tier: the capacity, segments, and the factory."""

    def __init__(self, make: TierFactory, capacity: int) -> None:
        self.make = make
        self.capacity = capacity
        self._made: list[Segment] = []

    def seg(self, session: str = "s", seq: int = 0, tokens: int = 8, seed: int = 0) -> Segment:
        s = make_segment(session, seq, tokens, seed=seed)
        self._made.append(s)
        return s

    def close(self) -> None:
        for s in self._made:
            s.close()


Check = Callable[[Tier, Context], Awaitable[None]]
"""One check: given an open tier and the :class:`Context`, raises AssertionError (or what
the tier raised) where the tier breaks the contract."""


def _ok(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _eq(got: object, want: object, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except kind as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(
                f"{kind.__name__} raised, but its message {str(exc)!r} does not match {match!r}"
            ) from exc
    else:
        raise AssertionError(f"expected {kind.__name__}; nothing was raised")


async def implements_the_protocol(tier: Tier, c: Context) -> None:
    """It satisfies the runtime-checkable Tier protocol, with the capacity asked, empty."""
    _ok(isinstance(tier, Tier), f"{type(tier).__name__} does not satisfy tieredkv.Tier")
    _eq(tier.capacity, c.capacity, "capacity")
    _eq(tier.used, 0, "used of a new tier")


async def write_then_read_is_byte_exact(tier: Tier, c: Context) -> None:
    """reserve + write + read returns exactly the segment's bytes, small and large, into
    aligned and unaligned buffers."""
    for tokens in (1, 8, 1200, 8000):
        s = c.seg(f"t{tokens}", 0, tokens, seed=tokens)
        await store(tier, s)
        _ok(await read_back(tier, s) == s.data, f"{tokens} tokens: bytes differ")
        _ok(await read_back(tier, s, aligned=False) == s.data, f"{tokens} tokens, unaligned")


async def sessions_stay_apart(tier: Tier, c: Context) -> None:
    """Several sessions and seqs written interleaved each read back as written."""
    segs = [c.seg(f"user-{i % 3}", i // 3, 50 + 97 * i, seed=i) for i in range(9)]
    for s in segs:
        await store(tier, s)
    for s in reversed(segs):
        _ok(await read_back(tier, s) == s.data, f"{s.key}: bytes differ")


async def contains_and_length_follow_commit(tier: Tier, c: Context) -> None:
    """A reservation is not contained; a committed segment is, with its stored length."""
    s = c.seg(tokens=1200)
    _ok(not tier.contains(s.key), "contains() before reserve")
    with _raises(KeyError):
        tier.length(s.key)
    _ok(tier.reserve(s.key, s.length), "reserve refused")
    _ok(not tier.contains(s.key), "contains() of a reservation")
    with _raises(KeyError):
        tier.length(s.key)
    await tier.write(s.key, s.view)
    _ok(tier.contains(s.key), "not contains() after write")
    _eq(tier.length(s.key), s.length, "length()")
    _ok(not tier.contains((s.key[0], s.key[1] + 1)), "contains() of another seq")
    _ok(not tier.contains(("other", s.key[1])), "contains() of another session")


async def reserve_beyond_capacity_returns_false(tier: Tier, c: Context) -> None:
    """A reservation that does not fit returns False and changes nothing; used <= capacity;
    the budget is counted in bytes exactly."""
    _ok(not tier.reserve(("big", 0), c.capacity + 4096), "reserve beyond capacity granted")
    _eq(tier.used, 0, "used after a refused reserve")
    s = c.seg(tokens=3000)
    granted = 0
    for i in range(c.capacity // s.length + 2):
        ok = tier.reserve(("fill", i), s.length)
        _ok(tier.used <= tier.capacity, "used above capacity")
        if not ok:
            break
        granted += 1
    _eq(granted, c.capacity // s.length, "reservations granted")
    _eq(tier.used, granted * s.length, "used")
    _ok(not tier.reserve(("fill", granted), s.length), "reserve granted when full")


async def release_gives_space_back(tier: Tier, c: Context) -> None:
    """release() returns a reservation's bytes; a second release and one of an unknown key
    are no-ops; the key can be reserved again."""
    s = c.seg(tokens=1200)
    _ok(tier.reserve(s.key, s.length), "reserve refused")
    _eq(tier.used, s.length, "used after reserve")
    tier.release(s.key)
    _eq(tier.used, 0, "used after release")
    tier.release(s.key)
    tier.release(("never", 0))
    _eq(tier.used, 0, "used after releases of nothing")
    await store(tier, s)
    _ok(await read_back(tier, s) == s.data, "bytes differ after release and store")


async def release_of_committed_keeps_it(tier: Tier, c: Context) -> None:
    """release() after a successful write is a no-op: the segment and its bytes stay."""
    s = c.seg(tokens=8)
    await store(tier, s)
    tier.release(s.key)
    _ok(tier.contains(s.key), "release() dropped a committed segment")
    _eq(tier.used, s.length, "used")
    _ok(await read_back(tier, s) == s.data, "bytes differ")


async def delete_frees_space(tier: Tier, c: Context) -> None:
    """delete() removes a committed segment and its bytes; deleting an absent key is a
    no-op; the key can be written again."""
    a, b = c.seg(seq=0, tokens=1200, seed=1), c.seg(seq=1, tokens=8, seed=2)
    await store(tier, a)
    await store(tier, b)
    _eq(tier.used, a.length + b.length, "used")
    await tier.delete(a.key)
    _ok(not tier.contains(a.key), "contains() after delete")
    _eq(tier.used, b.length, "used after delete")
    with _raises(KeyError):
        await read_back(tier, a)
    await tier.delete(a.key)
    await tier.delete(("never", 3))
    _eq(tier.used, b.length, "used after deletes of nothing")
    _ok(await read_back(tier, b) == b.data, "the other segment's bytes differ")
    await store(tier, a)
    _ok(await read_back(tier, a) == a.data, "bytes differ after writing again")


async def double_reserve_is_an_error(tier: Tier, c: Context) -> None:
    """Reserving a key that is reserved or committed raises ValueError ("already ...")."""
    s = c.seg(tokens=8)
    _ok(tier.reserve(s.key, s.length), "reserve refused")
    with _raises(ValueError, "already"):
        tier.reserve(s.key, s.length)
    _eq(tier.used, s.length, "used")
    await tier.write(s.key, s.view)
    with _raises(ValueError, "already"):
        tier.reserve(s.key, s.length)
    _eq(tier.used, s.length, "used")


async def write_without_reservation_is_an_error(tier: Tier, c: Context) -> None:
    """write() of a key never reserved raises ValueError ("...reserv...") and commits
    nothing."""
    s = c.seg(tokens=8)
    with _raises(ValueError, "reserv"):
        await tier.write(s.key, s.view)
    _ok(not tier.contains(s.key), "committed without a reservation")
    _eq(tier.used, 0, "used")
    _eq(tier.stats().writes, 0, "stats().writes")


async def write_of_wrong_length_is_an_error(tier: Tier, c: Context) -> None:
    """write() of data longer than the reservation raises ValueError ("...bytes..."); the
    reservation stays until released."""
    s, big = c.seg(tokens=8), c.seg(tokens=100, seq=1)
    _ok(tier.reserve(s.key, s.length), "reserve refused")
    with _raises(ValueError, "bytes"):
        await tier.write(s.key, big.view)
    _ok(not tier.contains(s.key), "committed data of the wrong length")
    _eq(tier.used, s.length, "used")
    tier.release(s.key)
    _eq(tier.used, 0, "used after release")


async def bad_buffers_and_absent_keys_are_errors(tier: Tier, c: Context) -> None:
    """read() into a buffer of another length raises ValueError ("...bytes..."); a read of a
    key never written, or only reserved, raises KeyError."""
    s, t = c.seg(tokens=8), c.seg(seq=1, tokens=8)
    await store(tier, s)
    with aligned_buffer(s.length + 4096) as out, _raises(ValueError, "bytes"):
        await tier.read([s.key], [out])
    with aligned_buffer(t.length) as out:
        with _raises(KeyError):
            await tier.read([t.key], [out])
        _ok(tier.reserve(t.key, t.length), "reserve refused")
        with _raises(KeyError):
            await tier.read([t.key], [out])


async def stats_counters_are_exact(tier: Tier, c: Context) -> None:
    """bytes_read, bytes_written, reads, writes, segments and used count exactly."""
    a, b = c.seg(seq=0, tokens=1200, seed=3), c.seg(seq=1, tokens=8000, seed=4)
    st = tier.stats()
    _eq((st.bytes_read, st.bytes_written, st.reads, st.writes, st.segments), (0,) * 5, "stats")
    _eq(st.name, tier.name, "stats().name")
    _eq(st.capacity, c.capacity, "stats().capacity")
    await store(tier, a)
    await store(tier, b)
    await read_back(tier, a)
    await read_back(tier, a)
    await read_back(tier, b)
    st = tier.stats()
    _eq(st.writes, 2, "stats().writes")
    _eq(st.bytes_written, a.length + b.length, "stats().bytes_written")
    _eq(st.reads, 3, "stats().reads")
    _eq(st.bytes_read, 2 * a.length + b.length, "stats().bytes_read")
    _eq((st.segments, st.used, st.corrupt), (2, a.length + b.length, 0), "segments, used")
    await tier.delete(a.key)
    st = tier.stats()
    _eq((st.segments, st.used, st.writes, st.reads), (1, b.length, 2, 3), "after a delete")


async def use_after_aclose_raises_closed_error(tier: Tier, c: Context) -> None:
    """After aclose() (idempotent), reserve, write, read and delete raise ClosedError."""
    s, t = c.seg(seq=0, tokens=8), c.seg(seq=1, tokens=8)
    await store(tier, s)
    _ok(tier.reserve(t.key, t.length), "reserve refused")
    await tier.aclose()
    await tier.aclose()
    with _raises(ClosedError):
        tier.reserve(("x", 0), 4096)
    with _raises(ClosedError):
        await tier.write(t.key, t.view)
    with aligned_buffer(s.length) as out, _raises(ClosedError):
        await tier.read([s.key], [out])
    with _raises(ClosedError):
        await tier.delete(s.key)


async def reopens_after_aclose(tier: Tier, c: Context) -> None:
    """A closed tier opens again: a volatile one empty, a persistent one with its segments
    (``open()`` returns their headers) and their exact bytes."""
    s = c.seg(tokens=1200)
    await store(tier, s)
    await tier.aclose()
    recovered = await tier.open()
    if tier.persistent:
        _eq([(h.session, h.seq) for h in recovered], [s.key], "segments recovered")
        _ok(await read_back(tier, s) == s.data, "bytes differ after reopening")
    else:
        _eq(recovered, [], "a volatile tier's recovered segments")
        _ok(not tier.contains(s.key), "a volatile tier kept a segment across a close")
        _eq(tier.used, 0, "used after reopening")


async def cancelled_write_is_all_or_nothing(tier: Tier, c: Context) -> None:
    """A write cancelled at any point committed the exact bytes, or left only its
    reservation, which release() frees."""
    for i, delay in enumerate((0.0, 0.0005, 0.003, 0.02)):
        s = c.seg(f"c{i}", 0, 8000, seed=7 + i)
        _ok(tier.reserve(s.key, s.length), "reserve refused")
        with anyio.move_on_after(delay):
            await tier.write(s.key, s.view)
        if tier.contains(s.key):
            _ok(await read_back(tier, s) == s.data, f"cancelled after {delay} s: bytes differ")
        else:
            tier.release(s.key)
            await store(tier, s)
            _ok(await read_back(tier, s) == s.data, "bytes differ after writing again")
        await tier.delete(s.key)
        _eq(tier.used, 0, f"used after a write cancelled after {delay} s")


def three_spans(length: int) -> list[tuple[int, int]]:
    """Spans of a segment as a read allows them: the first two pages (the whole header), a
    second span that re-reads the first's last page, then the rest."""
    half = length // 2 // ALIGN * ALIGN
    return [(0, 2 * ALIGN), (ALIGN, half), (half, length)]


async def one_read_of_several_segments(tier: Tier, c: Context) -> None:
    """One read of three segments into three buffers: exact bytes, one read each; an empty
    read is no error."""
    segs = [c.seg(seq=i, tokens=300 + 700 * i, seed=20 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs]
        await tier.read([s.key for s in segs], outs)
        _ok([bytes(o) for o in outs] == [s.data for s in segs], "bytes differ")
    _eq(tier.stats().reads, 3, "stats().reads")
    _eq(tier.stats().bytes_read, sum(s.length for s in segs), "stats().bytes_read")
    await tier.read([], [])
    _eq(tier.stats().reads, 3, "stats().reads after an empty read")


async def read_hands_every_span_to_consume(tier: Tier, c: Context) -> None:
    """With spans and a consumer, each span of each segment reaches ``consume`` once, a
    segment's spans in order, with exactly its bytes; into buffers or the tier's memory, in
    segment order or layer order."""
    segs = [c.seg(seq=i, tokens=3000 + 500 * i, seed=30 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    spans = [three_spans(s.length) for s in segs]
    for into in (False, True):
        for order in (None, [(i, k) for k in range(3) for i in range(3)]):
            got: dict[tuple[int, int], bytes] = {}
            seen: list[tuple[int, int]] = []

            def consume(i: int, k: int, view: memoryview, seen: Any = seen, got: Any = got) -> None:
                seen.append((i, k))
                got[i, k] = bytes(view)

            with contextlib.ExitStack() as stack:
                outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs]
                await tier.read(
                    [s.key for s in segs], outs if into else None, spans=spans,
                    consume=consume, order=order,
                )  # fmt: skip
                if into:
                    _ok([bytes(o) for o in outs] == [s.data for s in segs], "buffers differ")
            _eq(sorted(seen), [(i, k) for i in range(3) for k in range(3)], "spans consumed")
            for i in range(3):
                _eq([k for j, k in seen if j == i], [0, 1, 2], f"segment {i}'s span order")
            for (i, k), data in got.items():
                start, end = spans[i][k]
                _ok(data == segs[i].data[start:end], f"span {k} of segment {i}: bytes differ")


async def bad_reads_are_refused_before_any_io(tier: Tier, c: Context) -> None:
    """Unaligned spans, a gap, spans that stop short, an order that skips or repeats a
    span, buffers or span lists that do not match the keys: ValueError; an absent key among
    present ones: KeyError; nothing read."""
    s, t = c.seg(seq=0, tokens=3000, seed=40), c.seg(seq=1, tokens=3000, seed=41)
    await store(tier, s)
    await store(tier, t)
    n = s.length
    keys = [s.key, t.key]
    ok = three_spans(n)
    for spans, order in [
        ([[(0, 100), (100, n)], ok], None),
        ([[(0, 2 * ALIGN), (3 * ALIGN, n)], ok], None),
        ([[(0, 2 * ALIGN)], ok], None),
        ([ok], None),
        ([ok, ok], [(0, 1), (0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]),
        ([ok, ok], [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]),
        ([ok, ok], [(0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]),
    ]:
        with _raises(ValueError):
            await tier.read(keys, spans=spans, consume=lambda *a: None, order=order)
    with aligned_buffer(n) as out, _raises(ValueError):
        await tier.read(keys, [out])
    with aligned_buffer(n) as a, aligned_buffer(n) as b, _raises(KeyError):
        await tier.read([s.key, ("absent", 0), t.key], [a, b, b])
    _eq(tier.stats().reads, 0, "stats().reads after refused reads")
    _ok(await read_back(tier, s) == s.data, "bytes differ")


async def a_failing_consumer_keeps_the_segment(tier: Tier, c: Context) -> None:
    """What ``consume`` raises comes out of the read as it is; the segment stays, intact."""
    s = c.seg(tokens=3000, seed=50)
    await store(tier, s)

    def consume(i: int, k: int, view: memoryview) -> None:
        if k == 1:
            raise RuntimeError("consumer gave up")

    with _raises(RuntimeError, "consumer gave up"):
        await tier.read([s.key], spans=[three_spans(s.length)], consume=consume)
    _ok(tier.contains(s.key), "the segment was dropped")
    _eq(tier.stats().corrupt, 0, "stats().corrupt")
    _ok(await read_back(tier, s) == s.data, "bytes differ")


async def a_cancelled_read_writes_nothing_afterwards(tier: Tier, c: Context) -> None:
    """A read cancelled at any point leaves its buffers alone once the cancellation is
    through (nothing still writes into them), and the segments read back exactly."""
    segs = [c.seg(seq=i, tokens=4000, seed=60 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    for delay in (0.0, 0.0005, 0.003, 0.02):
        with contextlib.ExitStack() as stack:
            outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs]
            with anyio.move_on_after(delay):
                await tier.read([s.key for s in segs], outs)
            after = [bytes(o) for o in outs]
            await anyio.sleep(0.05)
            _ok([bytes(o) for o in outs] == after, f"buffers changed after a cancel at {delay}")
    for s in segs:
        _ok(await read_back(tier, s) == s.data, "bytes differ")


async def addressable_views_round_trip(tier: Tier, c: Context) -> None:
    """An AddressableTier (others pass): view(key) filled in place and commit() (idempotent)
    store a segment; views of unreserved keys raise ValueError; slots do not overlap."""
    if not isinstance(tier, AddressableTier):
        return
    with _raises(ValueError, "reserv"):
        tier.view(("none", 0))
    with _raises(ValueError, "reserv"):
        tier.commit(("none", 0))
    segs = [c.seg(seq=i, tokens=300 * (i + 1), seed=i) for i in range(5)]
    for s in segs:
        _ok(tier.reserve(s.key, s.length), "reserve refused")
    for s in segs:
        slot = tier.view(s.key)
        _eq(len(slot), s.length, "len(view())")
        slot[:] = s.view
        _ok(not tier.contains(s.key), "contains() before commit")
        tier.commit(s.key)
        tier.commit(s.key)
    _eq(tier.stats().writes, 5, "stats().writes (a commit counts once)")
    await tier.delete(segs[1].key)
    again = c.seg("t", 0, 300, seed=99)
    await store(tier, again)
    for s in [again, segs[0], *segs[2:]]:
        _ok(bytes(tier.view(s.key)) == s.data, f"{s.key}: slot bytes differ")
        _ok(await read_back(tier, s) == s.data, f"{s.key}: bytes differ")


CHECKS: tuple[Check, ...] = (
    implements_the_protocol,
    write_then_read_is_byte_exact,
    sessions_stay_apart,
    contains_and_length_follow_commit,
    reserve_beyond_capacity_returns_false,
    release_gives_space_back,
    release_of_committed_keeps_it,
    delete_frees_space,
    double_reserve_is_an_error,
    write_without_reservation_is_an_error,
    write_of_wrong_length_is_an_error,
    bad_buffers_and_absent_keys_are_errors,
    stats_counters_are_exact,
    use_after_aclose_raises_closed_error,
    reopens_after_aclose,
    cancelled_write_is_all_or_nothing,
    one_read_of_several_segments,
    read_hands_every_span_to_consume,
    bad_reads_are_refused_before_any_io,
    a_failing_consumer_keeps_the_segment,
    a_cancelled_read_writes_nothing_afterwards,
    addressable_views_round_trip,
)
"""Every check, in the order :func:`check_tier` runs them."""


@contextlib.asynccontextmanager
async def _opened(make: TierFactory, capacity: int) -> AsyncIterator[Tier]:
    tier = make(capacity)
    recovered = await tier.open()
    try:
        _eq(recovered, [], "open() of a new tier")
        yield tier
    finally:
        await tier.aclose()


async def run_check(check: Check, make: TierFactory, *, capacity: int = 4 << 20) -> None:
    """Run one check on a new tier from ``make``, opened, and closed afterwards.

    :raises TierContractError: where the tier breaks the contract (the message names the
        check and what differed; the tier's own exception, if any, is its cause)
    """
    c = Context(make, capacity)
    try:
        async with _opened(make, capacity) as tier:
            await check(tier, c)
    except TierContractError:
        raise
    except Exception as exc:
        raise TierContractError(
            f"{check.__name__}: {type(exc).__name__}: {exc} ({(check.__doc__ or '').strip()})"
        ) from exc
    finally:
        c.close()


async def check_tier(make: TierFactory, *, capacity: int = 4 << 20) -> list[str]:
    """Run every check of :data:`CHECKS`, each on a new tier from ``make``; returns the
    names of the checks run (all passed).

    :param make: makes a new, unopened tier of the capacity it is given (see
        :data:`TierFactory`)
    :param capacity: the tiers' capacity, bytes (the checks write segments of up to 2 MiB)
    :raises TierContractError: at the first check the tier fails
    """
    for check in CHECKS:
        await run_check(check, make, capacity=capacity)
    return [check.__name__ for check in CHECKS]
