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
    ... zero padding up to body_offset (a multiple of 64; of 512 if a tensor is 64 KiB+)
    body: each tensor's bytes at its offset (each a multiple of 64 from body_offset; of
          512 for a tensor of 64 KiB or more, so a read can land it in place: LAND_ALIGN)
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

The code, one concern to a module, all of it imported from here: ``_format`` (the layout,
the header, the body hash), ``_encode`` (:func:`plan_segment`, :class:`PartWriter`),
``_decode`` (:func:`parse_header`, :func:`verify_segment`, tensor views) and ``_auth``
(the MACs); the argument checks it shares with the rest of the package are in
``tieredkv._checks``.
"""

from __future__ import annotations

from .._checks import MAX_COUNT as MAX_COUNT
from .._checks import check_cuts as check_cuts
from .._checks import check_int as check_int
from ._auth import MIN_SECRET_BYTES as MIN_SECRET_BYTES
from ._auth import authenticated_head as authenticated_head
from ._auth import body_mac_hasher as body_mac_hasher
from ._auth import check_body_mac as check_body_mac
from ._auth import check_body_mac_digest as check_body_mac_digest
from ._auth import check_header_mac as check_header_mac
from ._auth import check_manifest_mac as check_manifest_mac
from ._auth import derive_key as derive_key
from ._auth import manifest_mac as manifest_mac
from ._decode import check_prefix as check_prefix
from ._decode import parse_header as parse_header
from ._decode import segment_tensors as segment_tensors
from ._decode import tensor_at as tensor_at
from ._decode import validate_header as validate_header
from ._decode import verify_segment as verify_segment
from ._encode import PartWriter as PartWriter
from ._encode import SegmentPlan as SegmentPlan
from ._encode import _encode_laid_out as _encode_laid_out  # tests build odd headers with it
from ._encode import plan_retirement as plan_retirement
from ._encode import plan_segment as plan_segment
from ._format import ALIGN as ALIGN
from ._format import INCARNATION_BYTES as INCARNATION_BYTES
from ._format import LAND_ALIGN as LAND_ALIGN
from ._format import LAND_MIN as LAND_MIN
from ._format import MAC_BYTES as MAC_BYTES
from ._format import MAGIC as MAGIC
from ._format import MAX_SESSION_KEY_BYTES as MAX_SESSION_KEY_BYTES
from ._format import PREFIX as PREFIX
from ._format import RETIRED_CODEC as RETIRED_CODEC
from ._format import RETIRED_SEQ as RETIRED_SEQ
from ._format import SEGMENT_ID_BYTES as SEGMENT_ID_BYTES
from ._format import Schema as Schema
from ._format import SegmentHeader as SegmentHeader
from ._format import TensorSpec as TensorSpec
from ._format import _pack_prefix as _pack_prefix  # tests re-seal damaged segments with it
from ._format import align_up as align_up
from ._format import dtype_of as dtype_of
from ._format import hash_body as hash_body
from ._format import hashed_from as hashed_from
from ._format import header_schema as header_schema
from ._format import inherits as inherits
from ._format import is_retirement as is_retirement
from ._format import plain_header as plain_header
from ._format import segment_id as segment_id

__all__ = [
    "ALIGN",
    "INCARNATION_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "MAX_COUNT",
    "PREFIX",
    "RETIRED_CODEC",
    "RETIRED_SEQ",
    "SEGMENT_ID_BYTES",
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
    "inherits",
    "is_retirement",
    "manifest_mac",
    "parse_header",
    "plain_header",
    "plan_retirement",
    "plan_segment",
    "segment_id",
    "segment_tensors",
    "tensor_at",
    "validate_header",
    "verify_segment",
]
