"""Adapters between tieredkv and inference libraries; each is an optional extra.

* :mod:`tieredkv.integrations.transformers`: Hugging Face transformers models (OPT, Llama,
  Qwen2) and their ``DynamicCache`` (``pip install tieredkv[transformers]``).

Importing this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
