"""Argument checks shared across the package: an int in range, a name, cuts of a byte range.

Neutral ground: nothing here knows about segments, tiers or the cache, so any module can
check its arguments the same way (the same messages, the same error types).
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidArgumentError, InvalidTypeError

__all__ = ["MAX_COUNT", "check_cuts", "check_int", "check_name"]

MAX_COUNT = 2**63 - 1
"""The largest token count, answer length or turn index a segment header can record."""


def check_int(
    what: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int = MAX_COUNT,
    wrong_type: type[InvalidArgumentError | InvalidTypeError] = InvalidTypeError,
) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]``.

    :raises ~tieredkv.errors.InvalidTypeError: (or ``wrong_type``) for a float, a bool or
        anything else that is not an int
    :raises ~tieredkv.errors.InvalidArgumentError: for an int out of range
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(f"{what} must be an int, not {value!r}")
    if not minimum <= value <= maximum:
        upper = "2**63 - 1" if maximum == MAX_COUNT else f"{maximum:,}"
        raise InvalidArgumentError(f"{what} must be from {minimum:,} to {upper}, not {value:,}")
    return value


def check_name(what: str, value: object) -> str:
    """``value`` if it is a non-empty str.

    :raises ~tieredkv.errors.InvalidTypeError: for anything that is not a str
    :raises ~tieredkv.errors.InvalidArgumentError: for the empty string
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be a str, not {value!r}")
    if not value:
        raise InvalidArgumentError(f"{what} is empty; use any non-empty text")
    return value


def check_cuts(cuts: Sequence[int], length: int) -> list[int]:
    """``cuts`` as a list, if they cut ``length`` bytes into parts: strictly rising from 0
    to ``length`` (at least one part); ``ValueError`` otherwise."""
    cut = list(cuts)
    if len(cut) < 2 or cut[0] != 0 or cut[-1] != length or sorted(set(cut)) != cut:
        raise ValueError(f"cuts must rise from 0 to {length}, not {cut}")
    return cut
