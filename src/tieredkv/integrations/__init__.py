"""Adapters between tieredkv and inference libraries; each is an optional extra.

* :mod:`tieredkv.integrations.transformers`: Hugging Face transformers decoder models whose
  cache holds per-layer keys and values, and their ``DynamicCache``
  (the ``transformers`` extra: ``pip install -e '.[transformers]'`` in a checkout);
* :mod:`tieredkv.integrations.architectures`: the families the activation codec can
  re-project, and how (no dependency);
* :mod:`tieredkv.integrations.forward`: calling a transformers model's forward pass with a
  cache (``cache_argument``, ``greedy_generate``), shared by the adapter and the serving
  loop's reference decoder (no dependency).

Importing this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
