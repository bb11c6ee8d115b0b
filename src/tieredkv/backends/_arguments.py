"""The constructor checks every tier shares: a name, a byte budget, a thread limit."""

from __future__ import annotations

from .._checks import check_int
from ..errors import InvalidArgumentError

__all__ = ["MAX_THREADS", "check_tier_arguments"]

MAX_THREADS = 1024
"""The most worker threads a tier may ask for."""


def check_tier_arguments(name: object, capacity: object, max_threads: object) -> None:
    """Refuse a tier's constructor arguments that could only fail later (or hang).

    :raises ~tieredkv.errors.InvalidArgumentError: an empty name, a capacity below one
        byte, or ``max_threads`` outside 1 to 1,024 (0 would make the first file operation
        wait forever for a thread)
    :raises ~tieredkv.errors.InvalidTypeError: a capacity or ``max_threads`` that is not
        an int (a float, a bool)
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a tier needs a non-empty name, not {name!r}")
    check_int(f"tier {name!r}: capacity (bytes)", capacity, minimum=1)
    check_int(f"tier {name!r}: max_threads", max_threads, minimum=1, maximum=MAX_THREADS)
