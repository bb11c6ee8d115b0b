"""Calling a transformers causal LM's forward pass with a cache, for any caller.

The transformers adapter (:mod:`tieredkv.integrations.transformers`) and the serving loop's
reference decoder (:func:`greedy_generate`, also exported by :mod:`tieredkv.serve`) both
pass a cache to a model; what the keyword is called depends on the transformers release.
Importing this module imports no transformers (nor the adapter).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["cache_argument", "greedy_generate"]


def cache_argument(model: Any) -> str:
    """The name of the keyword argument that passes a cache to ``model``'s forward pass
    and to ``model.generate``: ``"cache"`` in recent transformers releases (5.24 has it,
    and deprecates the old name), ``"past_key_values"`` before (5.17 has only that, and
    silently ignores ``cache=``). Pass the cache as ``**{cache_argument(model): cache}``
    to support both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def greedy_generate(
    model: Any, ids: torch.Tensor, new_tokens: int, cache: Any = None
) -> tuple[int, ...]:
    """Greedy decoding from token ids with no prior cache (prefill, then one token a step).

    :param cache: an empty transformers cache to fill (a ``DynamicCache`` by default)
    """
    if cache is None:
        import transformers

        cache = transformers.DynamicCache(config=model.config)
    device = next(model.parameters()).device
    kw = cache_argument(model)
    answer: list[int] = []
    with torch.inference_mode():
        out = model(input_ids=ids.to(device)[None], use_cache=True, **{kw: cache})
        for step in range(new_tokens):
            token = out.logits[0, -1].argmax()
            answer.append(int(token))
            if step + 1 < new_tokens:
                out = model(input_ids=token.view(1, 1), use_cache=True, **{kw: cache})
    return tuple(answer)
