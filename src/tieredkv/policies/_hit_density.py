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

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

__all__ = ["HORIZONS", "beyond", "best_density", "smoothed_survival"]

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


_SMOOTH_BINS = 512
"""Bins of the log-scale histogram :func:`smoothed_survival` smooths."""

_WIDTHS = (1.0, 0.5, 0.25, 0.125, 0.0625)
"""Fractions of the normal-reference width :func:`smoothed_survival` chooses among."""

_NARROWEST = 1e-6
"""The narrowest kernel (in log scale, a millionth of the value) :func:`smoothed_survival`
smooths with; below it the values are taken as they are."""


def smoothed_survival(values: Floats) -> Callable[[Floats], Floats]:
    """The survival of ``values``, as a function giving the share of them above each of
    its points (any shape): their positive values smoothed by a Gaussian kernel in log
    scale, the others counted as they are. The smoothing is fitted once, here; the
    function only looks it up.

    The empirical survival of a few thousand gaps is a staircase, ragged in its tail, and
    the best density over horizons picks up every step. A kernel estimate in log scale
    (gaps span seconds to minutes) is nonparametric and tends to the true survival as
    samples grow. Its width is chosen by likelihood cross-validation (each sample's
    density from all the others) among :data:`_WIDTHS` fractions of the normal-reference
    width, Silverman's rule ``0.9 min(sd, IQR / 1.34) n^(-1/5)``: that rule alone blurs
    gaps that come in sharp modes (a workload whose turns come at a few set intervals).
    It is made on a histogram of :data:`_SMOOTH_BINS` bins, so the fit costs O(samples +
    bins) and each look-up O(points)."""
    n = len(values)
    ordered = np.sort(values)

    def empirical(at: Floats) -> Floats:
        share: Floats = beyond(ordered, at) / max(n, 1)
        return share

    logs = np.log(ordered[ordered > 0])
    if len(logs) < 2:
        return empirical
    quartiles = np.percentile(logs, [75, 25])
    spread = float(logs.std())
    iqr = float(quartiles[0] - quartiles[1]) / 1.34
    widest = 0.9 * (min(spread, iqr) if iqr > 0 else spread) * len(logs) ** -0.2
    if widest < _NARROWEST:  # (the same gap over and over: nothing to smooth)
        return empirical
    edges = np.linspace(logs.min() - 4 * widest, logs.max() + 4 * widest, _SMOOTH_BINS + 1)
    counts = np.histogram(logs, edges)[0].astype(np.float64)
    step = edges[1] - edges[0]
    best: tuple[float, Floats] | None = None
    for fraction in _WIDTHS:
        width = widest * fraction
        reach = int(4 * width / step) + 1
        kernel = np.exp(-0.5 * (np.arange(-reach, reach + 1) * step / width) ** 2)
        kernel /= kernel.sum()
        smoothed = np.convolve(counts, kernel, mode="same")
        # each sample's density from the others: its own share of its bin taken out
        others = np.maximum(smoothed - kernel[reach], 1e-12) / (len(logs) - 1)
        fit = float(counts @ np.log(others))
        if best is None or fit > best[0]:
            best = (fit, smoothed)
    assert best is not None
    above = np.cumsum(best[1][::-1])[::-1]  # counts in each bin and every later one
    starts = edges[:-1]

    def survival(points: Floats) -> Floats:
        out: Floats = np.empty(np.shape(points))
        up = points > 0
        out[up] = np.interp(np.log(points[up]), starts, above, left=above[0], right=0.0) / n
        out[~up] = empirical(points[~up])
        return out

    return survival


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
