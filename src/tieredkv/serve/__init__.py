"""A real serving loop: a model behind an adapter, real tiers, the library's policies.

See :class:`~tieredkv.serve.engine.ServingEngine`, the adapter interface it needs
(:mod:`tieredkv.serve.adapter`) and :mod:`tieredkv.serve.load`. :func:`greedy_generate`,
the reference decoder for a transformers model, lives in :mod:`tieredkv.integrations.forward`
and is exported here too.
"""

from __future__ import annotations

from ..integrations.forward import greedy_generate as greedy_generate
from .engine import ServedTurn as ServedTurn
from .engine import ServingEngine as ServingEngine
from .engine import TurnRequest as TurnRequest
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
