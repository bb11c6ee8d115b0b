"""Check a Redis tier's conversations offline: ``tieredkv fsck redis://HOST:PORT/DB --prefix P``.

:func:`check_prefix` reads every manifest under a :class:`~tieredkv.backends.RedisTier`'s
``prefix`` and every value it names, and verifies them as a replica does before serving
them (:mod:`tieredkv.backends.redis_manifest`): the manifest's fields and entries, each
segment's header, CRC and body hash, its header bytes against its committed entry and,
given the tiers' secret, the manifest's MAC and both MACs of every segment. It also lists
the values no manifest names: *pending* ones (an uncommitted write's, with an expiry: they
vanish on their own) and *leaked* ones (no expiry: memory nothing will free).

A fork's references are checked as its segments are: a referenced segment whose values are
gone or fail their checks (a *dangling reference*), whose reference set does not name
the fork, or that is not the very segment the fork's first turn names (its ``base_ids``:
another history's turn under the parent's key) is damage. A segment its owner dropped
that only forks kept (a *retired* one) is *reclaimable* when no fork's manifest references
it any more (the manifest that did was lost, say evicted under ``maxmemory``): memory that
only deleting it frees. It sends only reads (``SCAN``, ``HGETALL``, ``GET``, ``PTTL``,
``SMEMBERS``), so it can run against a live server.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ._urls import redacted as _redacted
from .backends.redis import RedisTier
from .backends.redis_manifest import Damaged as _Damaged
from .backends.redis_manifest import Entry, parse, verify_segment_read
from .errors import (
    CorruptSegmentError,
    InvalidArgumentError,
    InvalidTypeError,
    TieredKVError,
    TierIOError,
)
from .fsck import Damaged, SessionSummary
from .payload import derive_key, inherits

try:
    import redis
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "checking a Redis tier needs the redis client (the redis extra: pip install -e "
        "'.[redis]' in a checkout, or pip install redis)"
    ) from _exc

__all__ = ["RedisReport", "check_prefix", "run_redis_command"]

_PART = re.compile(r"^(?P<base>.*:\{[0-9a-f]{32}\}):(?P<seq>\d+):(?P<nonce>[0-9a-f]+):\d+$")
_REFS = re.compile(r"^(?P<base>.*:\{[0-9a-f]{32}\}):(?P<seq>\d+):(?P<nonce>[0-9a-f]+):r$")


@dataclass
class RedisReport:
    """The result of :func:`check_prefix`.

    :param url: the server (without its password)
    :param prefix: the key prefix checked
    :param segments: good committed segments
    :param bytes: their total size
    :param sessions: per conversation with a good history of at least one turn, in key
        order
    :param damaged: what a replica would refuse to serve (a manifest, or a segment), and why
    :param pending: values of uncommitted writes (they expire)
    :param leaked: values that no manifest names and that never expire
    :param reclaimable: segments only forks kept (their owner dropped them) that no fork
        references any more
    """

    url: str
    prefix: str
    segments: int = 0
    bytes: int = 0
    sessions: list[SessionSummary] = field(default_factory=list)
    damaged: list[Damaged] = field(default_factory=list)
    pending: int = 0
    leaked: int = 0
    reclaimable: int = 0

    @property
    def clean(self) -> bool:
        """Whether every manifest and segment verified and no value leaked."""
        return not self.damaged and not self.leaked


def check_prefix(url: str, prefix: str, *, secret: bytes | None = None) -> RedisReport:
    """Verify every conversation a Redis tier keeps under ``prefix`` on ``url``, read-only.

    :param secret: the tiers' secret, to check MACs as well
    :raises ~tieredkv.errors.TierIOError: if the server cannot be reached
    :raises ~tieredkv.errors.InvalidArgumentError: for a bad URL or prefix, or a secret
        shorter than 16 bytes
    """
    RedisTier(url, 1, prefix=prefix)  # (checks the URL and the prefix)
    key = None if secret is None else derive_key(secret)
    report = RedisReport(url=_redacted(url), prefix=prefix)
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
    try:
        named = _check_manifests(client, report, key)
        named |= _check_references(client, report)
        _check_parts(client, report, named)
    except (redis.RedisError, OSError) as exc:
        raise TierIOError("fsck", f"read {report.url}", f"{type(exc).__name__}: {exc}") from exc
    finally:
        client.close()
    report.sessions.sort(key=lambda s: s.session)
    report.damaged.sort(key=lambda d: d.path)
    return report


def _check_manifests(client: redis.Redis, report: RedisReport, key: bytes | None) -> set[str]:
    """Check every manifest and the segments it names; return the names of their values."""
    named: set[str] = set()
    for raw in client.scan_iter(match=f"{report.prefix}:{{*}}:m", count=1000):
        name = raw.decode("utf-8", "replace")
        base = name[: -len(":m")]
        try:
            got = client.hgetall(raw)
        except redis.ResponseError as exc:  # (WRONGTYPE: another client's key of that name)
            report.damaged.append(Damaged(name, f"not a manifest (a hash): {exc}"))
            continue
        fields = {k: v for k, v in got.items() if isinstance(k, bytes) and isinstance(v, bytes)}
        named |= _named_by(base, fields)  # (a damaged manifest's values are not leaked)
        try:
            m = parse(fields, None, key, f"{report.url} {name}", report.prefix)
        except _Damaged as exc:
            report.damaged.append(Damaged(name, exc.detail))
            continue
        if m is None or not m.entries:  # (a conversation begun, nothing committed yet)
            continue
        summary = SessionSummary(m.session)
        if m.base and not inherits(m.headers[0], m.base_headers):
            report.damaged.append(
                Damaged(
                    f"{name} reference",
                    "a dangling reference: its references name another history's turns, "
                    "not the ones its first turn starts from (or turns shorter than it "
                    "takes): no replica serves the fork",
                )
            )
            report.sessions.append(summary)
            continue
        for i, ref in enumerate(m.base):
            where = f"{name} reference {i}"
            rbase = ref.qfield(report.prefix).rsplit(":", 3)[0]
            problem = _check_segment(
                client, rbase, (ref.owner, ref.seq), ref.entry, ref.owner_id, key, where
            )
            try:
                members = client.smembers(f"{rbase}:{ref.seq}:{ref.entry.nonce}:r")
            except redis.ResponseError as exc:
                members, problem = set(), problem or f"its reference set is not a set: {exc}"
            if problem is None and raw not in members:
                problem = "its reference set does not name this fork (its owner may delete it)"
            if problem is not None:
                report.damaged.append(Damaged(where, f"a dangling reference: {problem}"))
                break
        else:
            for seq, (entry, header) in enumerate(zip(m.entries, m.headers, strict=True), m.first):
                where = f"{name} segment {seq}"
                problem = _check_segment(client, base, (m.session, seq), entry, m.id, key, where)
                if problem is not None:
                    report.damaged.append(Damaged(where, problem))
                    break
                summary.turns += 1
                summary.tokens += header.tokens
                summary.bytes += entry.length
                report.segments += 1
                report.bytes += entry.length
        report.sessions.append(summary)
    return named


def _check_segment(
    client: redis.Redis,
    base: str,
    seg: tuple[str, int],
    entry: Entry,
    mid: str,
    key: bytes | None,
    where: str,
) -> str | None:
    """What is wrong with a committed segment's values (``None``: nothing)."""
    parts = [f"{base}:{seg[1]}:{entry.nonce}:{i}" for i in range(entry.parts)]
    values = client.mget(parts)
    gone = [p for p, v in zip(parts, values, strict=True) if v is None]
    if gone:
        return f"value {gone[0]} is gone"
    buf = memoryview(b"".join(v for v in values if isinstance(v, bytes)))
    incarnation = bytes.fromhex(mid) if key is not None else None
    try:
        if len(buf) != entry.length:
            raise CorruptSegmentError(where, f"{len(buf)} bytes, expected {entry.length}")
        verify_segment_read(buf, seg, entry, incarnation, key, where)
    except CorruptSegmentError as exc:
        return exc.detail
    return None


def _check_references(client: redis.Redis, report: RedisReport) -> set[str]:
    """Find the segments forks keep (their reference sets); count as reclaimable those no
    fork's manifest references any more and their owner no longer lists. Returns the
    names of the values and keys they keep (not leaked)."""
    kept: set[str] = set()
    for raw in client.scan_iter(match=f"{report.prefix}:{{*}}:*:r", count=1000):
        found = _REFS.match(raw.decode("utf-8", "replace"))
        if found is None:
            continue
        base, seq, nonce = found["base"], found["seq"], found["nonce"]
        kfield = f"k:{seq}".encode()
        listed = client.hget(f"{base}:m", kfield)
        parts = [
            k.decode("utf-8", "replace")
            for k in client.scan_iter(match=f"{base}:{seq}:{nonce}:*", count=1000)
        ]
        kept.update(parts)
        kept.add(f"{base}:t")
        if isinstance(listed, bytes) and listed.split(b":")[0] == nonce.encode():
            continue  # its owner lists it: not retired
        live = False
        for member in client.smembers(raw):
            prefix = f"{base}:{seq}:{nonce}:".encode()
            if any(
                isinstance(k, bytes)
                and isinstance(v, bytes)
                and k.startswith(b"q:")
                and v.startswith(prefix)
                for k, v in client.hgetall(member).items()
            ):
                live = True
                break
        if not live:
            report.reclaimable += 1
    return kept


def _named_by(base: str, fields: dict[bytes, bytes]) -> set[str]:
    """The values a manifest's ``k:<seq>`` fields name, whether it checks out or not."""
    names: set[str] = set()
    for name, value in fields.items():
        seq = re.fullmatch(rb"k:(\d{1,19})", name)
        kf = re.fullmatch(rb"([0-9a-f]{1,64}):(\d{1,6})", value)
        if seq and kf:
            nonce = kf[1].decode()
            names.update(f"{base}:{int(seq[1])}:{nonce}:{i}" for i in range(int(kf[2])))
    return names


def _check_parts(client: redis.Redis, report: RedisReport, named: set[str]) -> None:
    """Count the values no manifest names: pending (with an expiry) or leaked."""
    for raw in client.scan_iter(match=f"{report.prefix}:{{*}}:*", count=1000):
        name = raw.decode("utf-8", "replace")
        if name.endswith(":m") or name in named or not _PART.match(name):
            continue
        if client.pttl(raw) >= 0:
            report.pending += 1
        elif client.exists(raw):
            report.leaked += 1


def run_redis_command(args: argparse.Namespace) -> int:
    """``tieredkv fsck URL --prefix P``: print the report; exit status 0 if clean, 1 if not,
    2 for bad arguments or a server that cannot be reached."""
    where = "tieredkv fsck"
    if args.repair:
        print(f"{where}: error: --repair applies to an SSD tier's directory", file=sys.stderr)
        return 2
    if not args.prefix:
        print(f"{where}: error: checking a Redis server needs --prefix", file=sys.stderr)
        return 2
    try:
        secret = None
        if args.secret_file is not None:
            try:
                secret = Path(args.secret_file).read_bytes()
            except OSError as exc:
                raise InvalidArgumentError(
                    f"cannot read the secret file {args.secret_file!r} ({exc.strerror})"
                ) from exc
        report = check_prefix(args.directory, args.prefix, secret=secret)
    except (TieredKVError, ValueError, InvalidTypeError) as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{report.url} prefix {report.prefix!r}: {report.segments} good segment(s) in "
        f"{len(report.sessions)} conversation(s), {report.bytes:,} bytes; "
        f"{len(report.damaged)} damaged; {report.pending} pending value(s); "
        f"{report.leaked} leaked value(s); {report.reclaimable} reclaimable segment(s) "
        f"only forks kept"
    )
    for d in report.damaged:
        print(f"  damaged: {d.path}: {d.problem}")
    print("clean" if report.clean else "NOT clean")
    return 0 if report.clean else 1
