"""A codec the transformers adapter has never heard of, for the tests that check it plugs in.

:class:`PackedKV` stores each layer's K and V stacked in one tensor and decodes into views
of it that the adapter must copy (it does not decode in place): a combination neither
shipped codec has.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tieredkv.codecs import KVCodec, ModelAccess, ModelSpec, TurnTensors


class PackedKV:
    """Each layer's K and V as one tensor ``layers.{i}.kv``, ``[2, kv_heads, tokens,
    head_dim]`` (token dimension 2)."""

    name = "packed"
    needs_activations = False
    decodes_in_place = False

    def token_dim(self, spec: ModelSpec) -> int:
        return 2

    def layout(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        shape = (2, spec.kv_heads, -1, spec.head_dim)
        return {f"layers.{i}.kv": shape for i in range(spec.layers)}

    def encode(self, turn: TurnTensors, spec: ModelSpec) -> dict[str, torch.Tensor]:
        pairs = zip(turn.keys, turn.values, strict=True)
        return {f"layers.{i}.kv": torch.stack([k, v]) for i, (k, v) in enumerate(pairs)}

    def decode(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, *, start: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.decode_layer(stored, model, i) for i in range(model.spec.layers)]

    def decode_layer(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, layer: int, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = stored[f"layers.{layer}.kv"]
        return packed[0], packed[1]

    def bytes_per_token(self, spec: ModelSpec) -> int:
        return KVCodec().bytes_per_token(spec)

    def decode_flops_per_token(self, spec: ModelSpec) -> int:
        return 0
