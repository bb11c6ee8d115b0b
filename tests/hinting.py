"""Helpers of the retention-hint tests: a clock the test sets, and a conversation's turn of
1 KiB per token."""

from __future__ import annotations

import torch

KIB = 1024


def seg(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """A turn of ``tokens`` tokens, 1 KiB each (random bytes from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (tokens, KIB), dtype=torch.uint8, generator=g)}


class Clock:
    """A clock that reads what the test set in :attr:`now` (0 at first)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
