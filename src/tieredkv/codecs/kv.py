"""KVCodec: store each layer's K and V as the model computed them."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .base import CodecInputError, ModelAccess, ModelSpec, TurnTensors, check_layers

__all__ = ["KVCodec"]


class KVCodec:
    """K and V as they are: ``layers.{i}.k`` and ``layers.{i}.v``, each
    ``[kv_heads, tokens, head_dim]`` (token dimension 1), rotary already applied.

    Decoding is free (the tensors are what attention reads), so every stored byte saves
    the whole layer's computation for its token. It costs ``2 * layers * kv_heads *
    head_dim`` elements per token: the right choice for grouped-query attention (GQA),
    where that is at most the hidden size.
    """

    name = "kv"
    needs_activations = False
    decodes_in_place = True

    def token_dim(self, spec: ModelSpec) -> int:
        return 1

    def layout(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        shape = (spec.kv_heads, -1, spec.head_dim)
        return {f"layers.{i}.{tag}": shape for i in range(spec.layers) for tag in ("k", "v")}

    def encode(self, turn: TurnTensors, spec: ModelSpec) -> dict[str, torch.Tensor]:
        if len(turn.keys) != spec.layers or len(turn.values) != spec.layers:
            raise CodecInputError(
                self.name,
                f"got K/V for {len(turn.keys)}/{len(turn.values)} layers, the model has "
                f"{spec.layers}",
            )
        out: dict[str, torch.Tensor] = {}
        want = (spec.kv_heads, spec.head_dim)
        for i, (k, v) in enumerate(zip(turn.keys, turn.values, strict=True)):
            for tag, t in (("k", k), ("v", v)):
                if t.dim() != 3 or (t.shape[0], t.shape[2]) != want:
                    raise CodecInputError(
                        self.name,
                        f"layer {i} {tag.upper()} has shape {tuple(t.shape)}; expected "
                        f"[{spec.kv_heads}, tokens, {spec.head_dim}]",
                    )
                out[f"layers.{i}.{tag}"] = t
        return out

    def decode(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, *, start: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = model.spec.layers
        names = [f"layers.{i}.{tag}" for i in range(layers) for tag in ("k", "v")]
        check_layers(self.name, stored, names)
        return [(stored[f"layers.{i}.k"], stored[f"layers.{i}.v"]) for i in range(layers)]

    def decode_layer(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, layer: int, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        names = (f"layers.{layer}.k", f"layers.{layer}.v")
        check_layers(self.name, stored, names)
        return stored[names[0]], stored[names[1]]

    def bytes_per_token(self, spec: ModelSpec) -> int:
        return 2 * spec.layers * spec.kv_size * spec.itemsize

    def decode_flops_per_token(self, spec: ModelSpec) -> int:
        return 0

    def __repr__(self) -> str:
        return "KVCodec()"
