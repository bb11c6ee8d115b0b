"""The segment format, pinned: a segment written before reads back, and the same turn is
written as the same bytes and authenticated with the same MACs.

The hex below is what ``tieredkv.payload`` wrote at commit 32ad44c (a single module then)
for :func:`_plan`'s turn; a change to one byte of the layout, the header's encoding, a
checksum, the key derivation or a MAC fails here, before SSD files or Redis values written
by an earlier version stop reading.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from tieredkv.errors import CorruptSegmentError, InvalidArgumentError
from tieredkv.payload import (
    ALIGN,
    PartWriter,
    SegmentPlan,
    authenticated_head,
    body_mac_hasher,
    check_body_mac,
    check_body_mac_digest,
    check_header_mac,
    check_manifest_mac,
    derive_key,
    hashed_from,
    inherits,
    manifest_mac,
    parse_header,
    plan_segment,
    segment_id,
    segment_tensors,
    validate_header,
    verify_segment,
)

# the segment's bytes up to the end of its body (zeros follow, up to ALIGN)
_PLAIN = bytes.fromhex(
    "544b5653454700011d010000aa0b5e3514cad9ec348f9e3d8ea776657273696f6e01a773657373696f6e"
    "a7636f6e762dc3a9a373657107a6746f6b656e7302a9746f6b656e5f64696d00ad616e737765725f746f"
    "6b656e7305a5636f646563a26b76a774656e736f72739395a16ba7666c6f61743136920203000c95a176"
    "a5696e743332920203401895a165a862666c6f61743136920200cc8000ab626f64795f6f6666736574cd"
    "0140a8626f64795f6c656ecc80a763726561746564cb41d954fc40100000ab696e6361726e6174696f6e"
    "c41000000000000000000000000000000000a8626f64795f6d6163c42000000000000000000000000000"
    "00000000000000000000000000000000000000a36d6163c4200000000000000000000000000000000000"
    "00000000000000000000000000000000000000000000000000000000003c004000420044004500000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000fdfffffffeffffffffffffff000000000100000002000000000000000000000000000000"
    "00000000000000000000000000000000000000000000000000000000"
)
_AUTH_HEAD = bytes.fromhex(
    "544b5653454700011d010000e319f48a14cad9ec348f9e3d8ea776657273696f6e01a773657373696f6e"
    "a7636f6e762dc3a9a373657107a6746f6b656e7302a9746f6b656e5f64696d00ad616e737765725f746f"
    "6b656e7305a5636f646563a26b76a774656e736f72739395a16ba7666c6f61743136920203000c95a176"
    "a5696e743332920203401895a165a862666c6f61743136920200cc8000ab626f64795f6f6666736574cd"
    "0140a8626f64795f6c656ecc80a763726561746564cb41d954fc40100000ab696e6361726e6174696f6e"
    "c410000102030405060708090a0b0c0d0e0fa8626f64795f6d6163c4202b13a60250f3ebd7cad3d05a62"
    "7c6cac4fa84d3d71d286f3cd2beb9db9038f41a36d6163c42029288e1f0362be363ac222137a911aa653"
    "96acbc65df1e8e85207dd40df00de7"
)
"""Bytes ``[0, 309)`` of the same segment authenticated with :data:`_SECRET` and
incarnation ``bytes(range(16))``: the prefix and header (``incarnation``, ``body_mac``,
``mac`` and the CRC changed; the length of the header did not)."""
_SECRET = b"tieredkv-test-secret-0123456789"
_KEY_SHA256 = "ea3625d7b0f32c9efc9b4ca487e71833b12b65046b354556f319be23afe1adee"
_MANIFEST = b"a manifest's canonical bytes"
_MANIFEST_MAC = "b30283a719c6c0f41e1a0df34a40af920b98431fedb6fe693e1c2f9a8a9a531c"
_INCARNATION = bytes(range(16))


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "k": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "v": (torch.arange(6, dtype=torch.int32) - 3).reshape(2, 3),
        "e": torch.empty(2, 0, dtype=torch.bfloat16),
    }


def _plan() -> SegmentPlan:
    return plan_segment(
        "conv-é", 7, _tensors(), token_dim=0, answer_tokens=5, codec="kv", created=1700000000.25
    )


def _stored(prefix: bytes) -> bytearray:
    """A stored segment: ``prefix`` then zeros up to :data:`ALIGN`."""
    return bytearray(prefix + bytes(ALIGN - len(prefix)))


def _authenticated() -> bytearray:
    seg = _stored(_PLAIN)
    seg[: len(_AUTH_HEAD)] = _AUTH_HEAD
    return seg


def test_a_stored_segment_reads_back() -> None:
    """The header, the checksums and the tensors of a segment written before."""
    seg = _stored(_PLAIN)
    header = verify_segment(memoryview(seg), "golden")
    assert (header.session, header.seq, header.tokens, header.answer_tokens) == ("conv-é", 7, 2, 5)
    assert (header.token_dim, header.codec, header.created) == (0, "kv", 1700000000.25)
    assert (header.body_offset, header.body_len, header.length) == (320, 128, ALIGN)
    assert not header.authenticated
    assert parse_header(bytes(seg), "golden", ALIGN)[0] == header
    views = segment_tensors(memoryview(seg), header)
    expected = _tensors()
    assert list(views) == list(expected)
    for name, tensor in expected.items():
        assert views[name].dtype == tensor.dtype
        assert torch.equal(views[name], tensor)


def test_the_same_turn_is_written_as_the_same_bytes() -> None:
    """Whole (write_into) and part by part (PartWriter, hashing inline and in a pool)."""
    plan = _plan()
    assert plan.length == ALIGN
    whole = bytearray(ALIGN)
    plan.write_into(memoryview(whole))
    assert whole == _stored(_PLAIN)
    with ThreadPoolExecutor(1) as pool:
        for hash_pool in (None, pool):
            parts = bytearray(b"\xff" * ALIGN)  # every byte must be written, padding too
            writer = PartWriter(plan, memoryview(parts), [0, 384, ALIGN], hash_pool)
            writer(0)
            writer(1)
            assert parts == _stored(_PLAIN)


def test_authentication_is_unchanged() -> None:
    """The key a secret derives, the authenticated header, and both MACs checking."""
    key = derive_key(_SECRET)
    assert hashlib.sha256(key).hexdigest() == _KEY_SHA256
    assert authenticated_head(memoryview(_stored(_PLAIN)), key, _INCARNATION) == _AUTH_HEAD
    seg = _authenticated()
    header = verify_segment(memoryview(seg), "golden")
    assert header.authenticated
    assert header.incarnation == _INCARNATION
    check_header_mac(header, key, "golden")
    check_body_mac(bytes(seg), header, key, "golden")
    hasher = body_mac_hasher(key)
    hasher.update(seg[hashed_from(bytes(seg)) :])
    check_body_mac_digest(hasher.digest(), header, "golden")
    other = derive_key(b"another secret, sixteen bytes or more")
    with pytest.raises(CorruptSegmentError, match="header MAC mismatch"):
        check_header_mac(header, other, "golden")
    with pytest.raises(CorruptSegmentError, match="body MAC mismatch"):
        check_body_mac(bytes(seg), header, other, "golden")
    with pytest.raises(CorruptSegmentError, match="not authenticated"):
        check_header_mac(verify_segment(memoryview(_stored(_PLAIN)), "golden"), key, "golden")


def test_manifest_mac_is_unchanged() -> None:
    """The shared tier's manifest MAC: the same value, checked, and refused when wrong."""
    key = derive_key(_SECRET)
    mac = manifest_mac(_MANIFEST, key)
    assert mac.hex() == _MANIFEST_MAC
    check_manifest_mac(_MANIFEST, mac, key, "golden")
    with pytest.raises(CorruptSegmentError, match="manifest MAC mismatch"):
        check_manifest_mac(_MANIFEST + b" ", mac, key, "golden")
    with pytest.raises(CorruptSegmentError, match="not authenticated"):
        check_manifest_mac(_MANIFEST, b"", key, "golden")


_SEGMENT_ID = "286eb77545aa5ebc45da6c1d0cde16c2"
""":func:`segment_id` of the golden segment (the first value it gave, at its introduction)."""


def test_a_segment_id_is_pinned_and_the_same_authenticated_or_not() -> None:
    """What a fork's first turn names its inherited segments by, in every tier alike."""
    plain = verify_segment(memoryview(_stored(_PLAIN)), "golden")
    signed = verify_segment(memoryview(_authenticated()), "golden")
    assert segment_id(plain).hex() == segment_id(signed).hex() == _SEGMENT_ID
    later = plan_segment(
        "conv-é", 7, _tensors(), token_dim=0, answer_tokens=5, created=1700000000.5
    ).header  # (the same key and shape, another turn: another history's)
    assert segment_id(later) != segment_id(plain)


def test_a_fork_names_the_segments_it_inherits() -> None:
    """``base_ids`` round-trips with one id per ``base`` entry (nothing else is accepted);
    :func:`inherits` holds for those very segments only, and without ids (a fork written
    before they existed) for any segments under the keys with the tokens it takes."""
    parent = _plan().header
    base = (("conv-é", 7, 2),)
    plan = plan_segment(
        "fork",
        8,
        _tensors(),
        token_dim=0,
        answer_tokens=1,
        base=base,
        base_ids=(segment_id(parent),),
    )
    stored = bytearray(plan.length)
    plan.write_into(memoryview(stored))
    header = verify_segment(memoryview(stored), "fork")
    assert header.base_ids == (segment_id(parent),)
    assert inherits(header, [parent])
    other = msgspec.structs.replace(parent, created=parent.created + 1)
    assert not inherits(header, [other])
    assert not inherits(header, [])
    assert not inherits(header, [msgspec.structs.replace(parent, seq=6)])
    older = msgspec.structs.replace(header, base_ids=())
    assert inherits(older, [other])
    assert not inherits(msgspec.structs.replace(older, base=(("conv-é", 7, 3),)), [other])
    for ids in ((b"short",), (segment_id(parent),) * 2, [segment_id(parent)]):
        with pytest.raises(InvalidArgumentError, match="base_ids names"):
            plan_segment(
                "fork",
                8,
                _tensors(),
                token_dim=0,
                answer_tokens=1,
                base=base,
                base_ids=ids,  # type: ignore[arg-type]
            )
    with pytest.raises(CorruptSegmentError, match="base_ids do not name"):
        validate_header(msgspec.structs.replace(header, base_ids=(b"x" * 15,)), "fork")
