"""Hit density in time: the hits per second a conversation's bytes earn if kept.

A conversation whose next turn comes after a gap ``G`` (seconds, a distribution learned
online), with a chance ``q`` that its user comes back at all, has, after ``t`` seconds
already elapsed, for every horizon ``h`` it could still be kept, a chance
``q (S(t) - S(t + h))`` of a hit within ``h`` for the expected seconds
``E[min(R, h)]`` it holds its bytes meanwhile (``R`` the time left, never for a user who
has left). Its *hit density* is the best ratio over the horizons (after LHD: Beckmann,
Chen and Cidon, NSDI '18); per byte, it ranks conversations for eviction.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["HORIZONS", "beyond", "best_density"]

Floats = npt.NDArray[np.float64]

HORIZONS: Floats = np.r_[0.0, np.geomspace(0.25, 7200.0, 64)]
"""Horizons (seconds) over which the best density is taken; the first is 0."""


def beyond(sorted_gaps: Floats, points: Floats) -> npt.NDArray[np.int64]:
    """How many of ``sorted_gaps`` (ascending) exceed each of ``points`` (any shape): the
    unnormalized survival of the gap there."""
    above: npt.NDArray[np.int64] = len(sorted_gaps) - np.searchsorted(
        sorted_gaps, points, side="right"
    )
    return above


def best_density(q: Floats, s_now: Floats, s_ahead: Floats) -> Floats:
    """Per conversation, the best hits per second of keeping it over :data:`HORIZONS`.

    :param q: chance that the user comes back at all (given the turns so far)
    :param s_now: survival of the gap at the time already elapsed, ``P(G > t)``
    :param s_ahead: survival at ``t + h`` for every horizon but the first, ``(n, m)``
    """
    alive = np.concatenate(
        [((1 - q) + q * s_now)[:, None], (1 - q)[:, None] + q[:, None] * s_ahead], axis=1
    )  # P(not back yet) at t + h (unnormalized: the ratio below cancels it)
    held = np.cumsum((alive[:, 1:] + alive[:, :-1]) * 0.5 * np.diff(HORIZONS)[None, :], axis=1)
    hit = q[:, None] * (s_now[:, None] - s_ahead)
    best: Floats = (hit / np.maximum(held, 1e-12)).max(axis=1)
    return best
