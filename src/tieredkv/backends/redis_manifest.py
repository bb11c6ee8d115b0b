"""The manifest of a conversation in a Redis tier: its fields, parsing and authentication.

A manifest is one Redis hash per conversation (``prefix:{H}:m``, ``H`` its
:func:`conversation_tag`)::

    session   the conversation's key (UTF-8)
    id        the manifest's incarnation: 32 hex digits, new whenever it is created (a
              manifest the server lost and a replica built again has another one)
    v         the version: +1 for every change of the history (commit, discard, take-out)
    n         committed segments: e:0 ... e:<n-1>, no others
    e:<seq>   the segment's entry (msgpack: length, nonce, parts, value size, and its
              prefix and header bytes, so a replica learns tokens and answer lengths
              without reading the body)
    k:<seq>   "<nonce>:<parts>", for the Lua steps (they cannot decode msgpack)
    fence     the current writer's fencing token (decimal)
    owner     the replica holding the writer lease, and ``le`` when it ends (server ms)
    nb        no commit before this server time (ms): set when a replica takes the
              conversation over from one whose lease was live
    mac       with a secret and n > 0: keyed BLAKE2b of (session, id, v, every entry, and
              a fork's references)

A *fork* (a conversation whose first turn starts from another's history) lists the
segments it inherits by reference, committed in the same step as its first own segment::

    bn        the inherited segments: r:0 ... r:<bn-1>; its own entries are e:<bn> ...
    r:<i>     the reference (msgpack: the owner's key and manifest id, the segment's
              seq in the owner's history, and the owner's entry for it)
    q:<i>     "<owner's keys' base>:<seq>:<nonce>:<parts>", for the Lua steps

Every referenced segment carries a *reference set* in its owner's slot,
``prefix:{Howner}:<seq>:<nonce>:r``: the manifest keys of the forks that list it. The
owner's drop leaves a segment whose set is not empty (and records it in
``prefix:{Howner}:t``, the owner's *retired* segments, which keeps the key from starting a
new history), and the last fork to leave deletes it.

The parts of segment ``seq`` live under ``prefix:{H}:<seq>:<nonce>:<i>``; the nonce is new
for every segment written, so a part is only ever visible through the committed entry
that names it. :func:`parse` checks everything a reader relies on and raises
:class:`Damaged` otherwise: a manifest another client of the server wrote or altered is
never trusted further than its checks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from ..errors import CorruptSegmentError
from ..payload import (
    ALIGN,
    SegmentHeader,
    check_body_mac,
    check_header_mac,
    check_manifest_mac,
    manifest_mac,
    parse_header,
    verify_segment,
)

__all__ = [
    "Damaged",
    "Entry",
    "Manifest",
    "Ref",
    "conversation_tag",
    "encode_entry",
    "parse",
    "sign",
    "verify_segment_read",
]

_NONCE = re.compile(r"[0-9a-f]{16}")
_ID = re.compile(r"[0-9a-f]{32}")
_DIGITS = re.compile(rb"0|[1-9][0-9]{0,18}")


def conversation_tag(session: str) -> str:
    """The hash tag of a conversation's keys: BLAKE2b-128 of its key, in hex."""
    return hashlib.blake2b(session.encode("utf-8"), digest_size=16).hexdigest()


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One committed segment, as stored in the manifest's ``e:<seq>`` field."""

    length: int
    nonce: str
    parts: int
    value_size: int
    head: bytes
    """The segment's prefix and header bytes, exactly as stored in its first part."""

    @property
    def kfield(self) -> str:
        return f"{self.nonce}:{self.parts}"


class Ref(msgspec.Struct, array_like=True, frozen=True):
    """One segment a fork inherits, as stored in its manifest's ``r:<i>`` field."""

    owner: str
    """The key of the conversation that committed it."""
    owner_id: str
    """The owner's manifest id when it committed it (its incarnation, for MACs)."""
    seq: int
    entry: Entry

    def qfield(self, prefix: str) -> str:
        """Its ``q:<i>`` field (the Lua steps' view) under ``prefix``."""
        return f"{prefix}:{{{conversation_tag(self.owner)}}}:{self.seq}:{self.entry.kfield}"


encode_entry = msgspec.msgpack.Encoder().encode
_decode_entry = msgspec.msgpack.Decoder(Entry).decode
_decode_ref = msgspec.msgpack.Decoder(Ref).decode
_encode = msgspec.msgpack.Encoder().encode


class Damaged(Exception):
    """A manifest that fails its checks (``detail`` says which)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class Manifest:
    """A parsed, checked manifest: a fork's references (``base``, with their headers), then
    its own entries (``seq`` ``first``, ``first + 1``, ...)."""

    session: str
    id: str
    v: int
    entries: list[Entry] = field(default_factory=list)
    headers: list[SegmentHeader] = field(default_factory=list)
    fence: int | None = None
    owner: str = ""
    lease_end: int = 0
    not_before: int = 0
    base: list[Ref] = field(default_factory=list)
    base_headers: list[SegmentHeader] = field(default_factory=list)

    @property
    def first(self) -> int:
        """The ``seq`` of its first own segment (the number of segments it inherits)."""
        return len(self.base)

    @property
    def n(self) -> int:
        """The segments of its history (inherited and own)."""
        return len(self.base) + len(self.entries)

    @property
    def history(self) -> list[SegmentHeader]:
        """The headers of its whole history, in order (a fork's inherited ones first)."""
        return [*self.base_headers, *self.headers]


def sign(
    session: str,
    mid: str,
    v: int,
    entries: Sequence[Entry],
    key: bytes,
    base: Sequence[Ref] = (),
) -> bytes:
    """The manifest MAC of a history: (session, id, version, every entry, a fork's
    references) under ``key``."""
    return manifest_mac(_message(session, mid, v, entries, base), key)


def _message(
    session: str, mid: str, v: int, entries: Sequence[Entry], base: Sequence[Ref] = ()
) -> bytes:
    history: list[object] = [
        "tieredkv-manifest-1",
        session,
        mid,
        v,
        [encode_entry(e) for e in entries],
    ]
    if base:  # (a plain conversation's MAC is the one it always was)
        history.append([encode_entry(r) for r in base])
    return _encode(history)


def _int(fields: Mapping[bytes, bytes], name: bytes, default: int | None = None) -> int:
    raw = fields.get(name)
    if raw is None:
        if default is None:
            raise Damaged(f"its {name.decode()!r} field is missing")
        return default
    if not isinstance(raw, bytes) or not _DIGITS.fullmatch(raw):
        raise Damaged(
            f"its {name.decode()!r} field {raw[:40]!r} is not a count (another client wrote it?)"
        )
    return int(raw)


def _lenient(fields: Mapping[bytes, bytes], name: bytes) -> int | None:
    raw = fields.get(name)
    return int(raw) if isinstance(raw, bytes) and _DIGITS.fullmatch(raw) else None


def parse(
    fields: Mapping[bytes, bytes],
    session: str | None,
    key: bytes | None,
    where: str,
    prefix: str | None = None,
) -> Manifest | None:
    """Check and parse a manifest (``HGETALL``'s reply).

    :param session: the conversation expected (``None``: any, as a scan finds it)
    :param key: the tier's MAC key, if it has a secret
    :param prefix: the tier's key prefix: a fork's references must name keys under it
    :returns: ``None`` if the manifest is another conversation's (a hash collision)
    :raises Damaged: if any check fails
    """
    raw = fields.get(b"session")
    if not isinstance(raw, bytes):
        raise Damaged("it names no conversation")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Damaged("its conversation key is not UTF-8") from None
    if session is not None and name != session:
        return None
    mid_raw = fields.get(b"id", b"")
    mid = mid_raw.decode("ascii", "replace")
    if not _ID.fullmatch(mid):
        raise Damaged(f"its id {mid_raw[:40]!r} is not 32 hex digits")
    v = _int(fields, b"v")
    n = _int(fields, b"n")
    bn = _int(fields, b"bn", 0)
    # the writer's fields are not part of the history: garbage there (another client wrote
    # it) means no valid writer, which the next takeover replaces
    m = Manifest(
        session=name,
        id=mid,
        v=v,
        fence=_lenient(fields, b"fence"),
        owner=fields.get(b"owner", b"").decode("utf-8", "replace"),
        lease_end=_lenient(fields, b"le") or 0,
        not_before=_lenient(fields, b"nb") or 0,
    )
    if bn and n <= bn:
        raise Damaged(f"it references {bn} segment(s) but holds no turn of its own")
    seqs = {f for f in fields if f.startswith((b"e:", b"k:", b"r:", b"q:"))}
    expected = {p + str(i).encode() for i in range(bn, n) for p in (b"e:", b"k:")}
    expected |= {p + str(i).encode() for i in range(bn) for p in (b"r:", b"q:")}
    if seqs != expected:
        raise Damaged(
            f"its entries are not exactly segments 0 to {n - 1}"
            + (f" ({bn} of them references)" if bn else "")
        )
    for i in range(bn):
        ref, header = _parse_ref(fields, i, prefix, key, f"{where} reference {i}")
        m.base.append(ref)
        m.base_headers.append(header)
    incarnation = bytes.fromhex(mid)
    for seq in range(bn, n):
        at = f"{where} segment {seq}"
        try:
            entry = _decode_entry(fields[f"e:{seq}".encode()])
        except msgspec.DecodeError as exc:
            raise Damaged(f"entry {seq} cannot be decoded ({exc})") from None
        if not _consistent(entry) or fields[f"k:{seq}".encode()] != entry.kfield.encode():
            raise Damaged(f"entry {seq} is inconsistent")
        header = _entry_header(entry, key, incarnation, at, f"entry {seq}")
        if (header.session, header.seq) != (name, seq) or header.length != entry.length:
            raise Damaged(f"entry {seq} describes another segment")
        if (
            seq == bn
            and bn
            and [(o, s) for o, s, _ in header.base] != [(r.owner, r.seq) for r in m.base]
        ):
            raise Damaged(f"its references are not the ones its turn {seq} starts from")
        m.entries.append(entry)
        m.headers.append(header)
    if n > bn and not bn and m.headers and m.headers[0].base:
        raise Damaged("its first turn starts from a history it does not reference")
    if key is not None and n:
        try:
            check_manifest_mac(
                _message(name, mid, v, m.entries, m.base), fields.get(b"mac", b""), key, where
            )
        except CorruptSegmentError as exc:
            raise Damaged(exc.detail) from None
    return m


def _consistent(entry: Entry) -> bool:
    vs = entry.value_size
    return bool(
        _NONCE.fullmatch(entry.nonce)
        and vs >= ALIGN
        and not vs % ALIGN
        and entry.length > 0
        and entry.parts == -(-entry.length // vs)
    )


def _entry_header(
    entry: Entry, key: bytes | None, incarnation: bytes, at: str, what: str
) -> SegmentHeader:
    """The header an entry records, checked (with ``key``: its MAC and incarnation)."""
    try:
        header, _ = parse_header(entry.head, at)
        if key is not None:
            check_header_mac(header, key, at)
            if header.incarnation != incarnation:
                raise CorruptSegmentError(at, "written for another incarnation of the manifest")
    except CorruptSegmentError as exc:
        raise Damaged(f"{what}: {exc.detail}") from None
    return header


def _parse_ref(
    fields: Mapping[bytes, bytes], i: int, prefix: str | None, key: bytes | None, at: str
) -> tuple[Ref, SegmentHeader]:
    try:
        ref = _decode_ref(fields[f"r:{i}".encode()])
    except msgspec.DecodeError as exc:
        raise Damaged(f"reference {i} cannot be decoded ({exc})") from None
    q = fields[f"q:{i}".encode()].decode("utf-8", "replace")
    tail = f":{{{conversation_tag(ref.owner)}}}:{ref.seq}:{ref.entry.kfield}"
    if (
        not _ID.fullmatch(ref.owner_id)
        or ref.seq < 0
        or not _consistent(ref.entry)
        or not q.endswith(tail)
        or (prefix is not None and q != prefix + tail)
    ):
        raise Damaged(f"reference {i} is inconsistent")
    header = _entry_header(ref.entry, key, bytes.fromhex(ref.owner_id), at, f"reference {i}")
    if (header.session, header.seq) != (ref.owner, ref.seq) or header.length != ref.entry.length:
        raise Damaged(f"reference {i} describes another segment")
    return ref, header


def verify_segment_read(
    buf: memoryview,
    key: tuple[str, int],
    entry: Entry,
    incarnation: bytes | None,
    secret_key: bytes | None,
    where: str,
) -> SegmentHeader:
    """Check a segment read back from its parts as a reader must before serving it: it
    starts with the header bytes its committed entry records, passes its CRC and body hash
    (and, with the tier's MAC key, both MACs and the manifest's incarnation), and names
    ``key``.

    :raises ~tieredkv.errors.CorruptSegmentError: if any check fails
    """
    if bytes(buf[: len(entry.head)]) != entry.head:
        raise CorruptSegmentError(where, "its header is not the committed one")
    header = verify_segment(buf, where)
    if secret_key is not None:
        check_header_mac(header, secret_key, where)
        check_body_mac(buf, header, secret_key, where)
        if header.incarnation != incarnation:
            raise CorruptSegmentError(where, "written for another manifest")
    if (header.session, header.seq) != key:
        raise CorruptSegmentError(where, "the header names another segment")
    return header
