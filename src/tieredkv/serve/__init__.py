"""A real serving loop: a transformers model, real tiers, the library's policies.

See :class:`~tieredkv.serve.engine.ServingEngine` and :mod:`tieredkv.serve.load`.
"""

from __future__ import annotations

from .engine import ServedTurn as ServedTurn
from .engine import ServingEngine as ServingEngine
from .engine import TurnRequest as TurnRequest
from .engine import greedy_generate as greedy_generate
from .engine import model_stall as model_stall
from .engine import summarize as summarize

__all__ = [
    "ServedTurn",
    "ServingEngine",
    "TurnRequest",
    "greedy_generate",
    "model_stall",
    "summarize",
]
