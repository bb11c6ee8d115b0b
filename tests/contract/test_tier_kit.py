"""The tier contract kit (:mod:`tieredkv.testing`) catches a tier that breaks the contract,
and names the check and what differed (the library's own tiers pass it:
``test_tier_contract.py``)."""

from __future__ import annotations

import pytest

from tieredkv import HostMemoryTier
from tieredkv.backends.base import SegmentKey, Tier
from tieredkv.testing import CHECKS, TierContractError, check_tier, run_check


class KeepsDeleted(HostMemoryTier):
    """A host tier whose delete() does nothing: the space is never given back."""

    async def delete(self, key: SegmentKey) -> None:
        pass


class FlipsAByte(HostMemoryTier):
    """A host tier whose segments come back with their last byte changed."""

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        changed = bytearray(data)
        changed[-1] ^= 0xFF
        await super().write(key, memoryview(changed))


def host(capacity: int) -> Tier:
    return HostMemoryTier(capacity)


async def test_a_correct_tier_passes_every_check() -> None:
    assert await check_tier(host) == [c.__name__ for c in CHECKS]


async def test_a_tier_that_keeps_deleted_segments_fails_by_name() -> None:
    with pytest.raises(TierContractError, match=r"^delete_frees_space: AssertionError: "):
        await check_tier(KeepsDeleted)


async def test_a_tier_that_changes_bytes_fails_by_name() -> None:
    with pytest.raises(TierContractError) as info:
        await check_tier(FlipsAByte)
    assert str(info.value).startswith(
        "write_then_read_is_byte_exact: AssertionError: 1 tokens: bytes differ"
    )


async def test_a_tier_that_raises_where_it_should_not_names_the_check() -> None:
    class Refuses(HostMemoryTier):
        async def read(self, *args: object, **kwargs: object) -> None:
            raise OSError("the device went away")

    with pytest.raises(TierContractError, match="OSError: the device went away") as info:
        await run_check(CHECKS[1], Refuses)
    assert isinstance(info.value.__cause__, OSError)
