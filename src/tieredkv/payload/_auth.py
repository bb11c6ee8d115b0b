"""Authentication: keyed BLAKE2b MACs of a segment's header and body, and of a shared
tier's manifest, under a key derived from the user's secret."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec

from ..errors import CorruptSegmentError, InvalidArgumentError, InvalidTypeError
from ._decode import parse_header
from ._format import (
    _NO_MAC,
    MAC_BYTES,
    PREFIX,
    SegmentHeader,
    _header_encoder,
    _pack_prefix,
    hashed_from,
)

__all__ = [
    "MIN_SECRET_BYTES",
    "authenticated_head",
    "body_mac_hasher",
    "check_body_mac",
    "check_body_mac_digest",
    "check_header_mac",
    "check_manifest_mac",
    "derive_key",
    "manifest_mac",
]

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
