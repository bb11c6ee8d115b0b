"""An invariant checker for TieredKVCache: the index, the tiers, the files, the channel and
the policies must agree (see ``tieredkv._cache.state``), and every acknowledged byte must
load back exactly.

Used after every fault and cancellation campaign. It reads the cache's private state on
purpose: the point is to compare every copy of the truth with every other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tieredkv import SSDTier, TieredKVCache
from tieredkv.backends.arena import ArenaTier
from tieredkv.backends.base import SegmentKey, Tier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.payload import RETIRED_SEQ

Model = dict[str, list[dict[str, torch.Tensor]]]
"""What the test believes is stored: session -> the acknowledged turns, in order."""


def tier_keys(tier: Tier) -> dict[SegmentKey, int]:
    """Committed keys of a real tier, with their lengths, from the tier's own index."""
    if isinstance(tier, SSDTier):
        return {k: tier.length(k) for k in tuple(tier.keys())}
    if isinstance(tier, ArenaTier):
        return {k: slot.length for k, slot in tier._slots.items() if slot.committed}
    raise TypeError(f"no index reader for {type(tier).__name__}")


def problems(cache: TieredKVCache) -> list[str]:
    """Every disagreement between the cache's parts (empty when all is well).

    Call it with no operation in flight and background copies flushed.
    """
    core = getattr(cache, "_core", None)
    if core is None:
        return ["this cache has no _core: not the split TieredKVCache"]
    found: list[str] = []
    held_by_tier: list[dict[SegmentKey, int]] = [{} for _ in core.tiers]
    complete_by_tier = [0 for _ in core.tiers]
    for key, s in core.sessions.items():
        if [seg.header.seq for seg in s.segs] != list(range(len(s.segs))):
            found.append(f"{key}: segments are not 0..n-1")
        if s.stopping:  # (a drop stops its copies; one that did nothing restarts them)
            found.append(f"{key}: its background copies stopped for a drop that did not happen")
        completes = [t for t in range(len(core.tiers)) if s.complete(t)]
        if (s.primary is None) != (not completes):
            found.append(f"{key}: primary {s.primary} but complete copies in {completes}")
        if s.primary is not None and s.primary not in completes:
            found.append(f"{key}: primary {s.primary} is not a complete copy")
        found.extend(
            f"{key}: lists segment {seg.key} but is not among its users"
            for seg in s.segs
            if s not in seg.users
        )
        for t in range(len(core.tiers)):
            # a segment held at rest is part of a complete copy of some conversation listing
            # it (a fork's, its parent's, or its own)
            idle = [g.key for g in s.holds(t) if not any(u.complete(t) for u in g.users)]
            if idle:
                found.append(f"{key}: partial copy in tier {t} at rest ({sorted(idle)})")
            if s.complete(t):
                complete_by_tier[t] += 1
            for seg in s.holds(t):
                held_by_tier[t][seg.key] = seg.length
        meta = cache.channel.get(key)
        if s.primary is None:
            if meta is not None and meta.tier is not None:
                found.append(f"{key}: lost, but the channel says {meta.tier}")
            continue
        if meta is None:
            found.append(f"{key}: stored in {s.primary} but unknown to the channel")
            continue
        names = [core.tiers[t].name for t in completes]
        want = (core.tiers[s.primary].name, s.nbytes(), s.tokens(), len(s.segs))
        got = (meta.tier, meta.nbytes, meta.tokens, meta.turns)
        if got != want or sorted(meta.copies) != sorted(names) or meta.copies[0] != want[0]:
            found.append(f"{key}: channel says {got} copies {meta.copies}, index {want} {names}")
        if meta.in_flight is not None:
            found.append(f"{key}: a transfer still marked in flight at rest")
    found.extend(unowned(cache))
    for name in cache.channel:
        if name not in core.sessions:
            meta = cache.channel.get(name)
            if meta is not None and meta.tier is not None:
                found.append(f"{name}: in the channel ({meta.tier}) but not in the index")
    if core.busy:
        found.append(f"sessions still marked busy at rest: {dict(core.busy)}")
    for t, tier in enumerate(core.tiers):
        actual = tier_keys(tier)
        orphans = {key for u, key in core.orphans if u == t}
        markers = {(owner, RETIRED_SEQ) for owner, r in core.retired.items() if t in r.markers}
        expected = set(held_by_tier[t]) | orphans | markers
        for owner, r in core.retired.items():
            held_here = [g.key for g in r.segs if t in g.tiers]
            if held_here and tier.persistent and t not in r.markers:
                found.append(f"tier {tier.name}: holds {held_here} of retired {owner!r}, no marker")
            if t in r.markers and (t, (owner, RETIRED_SEQ)) in core.orphans:
                # (an orphan is deleted at the next chance: the marker would stand for nothing)
                found.append(f"tier {tier.name}: marker of retired {owner!r} listed, an orphan")
        if set(actual) != expected:
            extra = sorted(set(actual) - expected)[:5]
            missing = sorted(expected - set(actual))[:5]
            found.append(f"tier {tier.name}: index has extra {extra}, lacks {missing}")
        for key, length in held_by_tier[t].items():
            if key in actual and actual[key] != length:
                found.append(f"tier {tier.name}: {key} is {actual[key]} bytes, index {length}")
        if tier.used != sum(actual.values()):
            found.append(f"tier {tier.name}: used {tier.used}, segments {sum(actual.values())}")
        if len(core.policies[t]) != complete_by_tier[t]:
            found.append(
                f"tier {tier.name}: policy tracks {len(core.policies[t])} sessions, "
                f"{complete_by_tier[t]} have a copy there"
            )
        if isinstance(tier, SSDTier):
            found.extend(_files_agree(tier, set(actual)))
    return found


def unowned(cache: TieredKVCache) -> list[str]:
    """The segments some conversation lists that neither their owner (the conversation
    whose key they are stored under) nor its retirement record lists: their key is not
    taken, and a new turn of the owner's key would be stored over them."""
    core = cache._core
    found = []
    for key, s in core.sessions.items():
        for seg in s.segs:
            owner = core.sessions.get(seg.key[0])
            r = core.retired.get(seg.key[0])
            if (owner is None or seg not in owner.segs) and (r is None or seg not in r.segs):
                found.append(f"{key}: lists {seg.key}, which neither its owner nor a record lists")
    return found


def _files_agree(tier: SSDTier, keys: set[SegmentKey]) -> list[str]:
    directory = Path(tier.directory)
    files = {p for p in (directory / "segments").rglob("*") if p.is_file()}
    # a failed write whose cleanup failed too leaves its file "doomed": known to the tier,
    # out of its index, deleted at close (checked by the campaign's reopen)
    doomed = set(tier._writer.doomed)
    want = {directory / "segments" / segment_file_name(k) for k in keys | doomed}
    out = []
    if files != want:
        out.append(
            f"tier {tier.name}: files {len(files)} vs index {len(want)}; extra "
            f"{sorted(str(p.name) for p in files - want)[:3]}, "
            f"missing {sorted(str(p.name) for p in want - files)[:3]}"
        )
    # temporary files of failed writes whose cleanup failed too are cleared at the next
    # open (checked there by the campaign), so they are not counted here
    return out


async def wrong_bytes(cache: TieredKVCache, model: Model) -> list[str]:
    """Load every session of ``model``; name those that are missing or differ."""
    bad = []
    for key, turns in model.items():
        if not turns:
            if cache.contains(key):
                bad.append(f"{key}: stored, but no append of it was acknowledged")
            continue
        got = await cache.load(key)
        for name in turns[0]:
            want = torch.cat([t[name] for t in turns])
            if not torch.equal(got[name], want):
                bad.append(f"{key}: {name} differs from the acknowledged turns")
    return bad
