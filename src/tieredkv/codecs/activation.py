"""ActivationCodec: store the input of each layer's K/V projections, re-project on load."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from .base import (
    CodecInputError,
    ModelAccess,
    ModelSpec,
    TurnTensors,
    check_layers,
    decode_by_layer,
)

__all__ = ["ActivationCodec"]

_LOW_PRIORITY = 0
"""CUDA's least stream priority (lower numbers run first; the range is about [-5, 0])."""


class ActivationCodec:
    """The normalized activation that feeds each layer's K and V projections.

    Stored as ``layers.{i}.act``, ``[tokens, hidden_size]`` (token dimension 0): ``layers *
    hidden_size`` elements per token, half of K/V for a multi-head-attention (MHA) model. On
    load each layer's K and V are rebuilt by the model (:meth:`ModelAccess.project_kv
    <tieredkv.codecs.ModelAccess.project_kv>`: the layer's own projections, biases
    included, any K normalization, and the rotary embedding at each token's absolute
    position). That costs ``4 * hidden_size * kv_heads *
    head_dim`` FLOPs per token per layer (``4 d^2`` for MHA) and gives back K/V equal to the
    originals up to the rounding of one matrix multiplication.

    On CUDA the re-projection runs on a low-priority stream of its own, so it fills SMs the
    serving stream leaves idle; the caller's current stream waits for it before it uses the
    result. The stream has CUDA's least priority (0, like the default stream): it yields to
    work on streams created with a higher (negative) priority, as a serving engine's
    decoding stream should be. :meth:`decode_layer` (one layer, inside a layer-wise
    restore's forward pass) runs on the caller's stream.
    """

    name = "act"
    needs_activations = True
    decodes_in_place = False

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def token_dim(self, spec: ModelSpec) -> int:
        return 0

    def layout(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        return {f"layers.{i}.act": (-1, spec.hidden_size) for i in range(spec.layers)}

    def encode(self, turn: TurnTensors, spec: ModelSpec) -> dict[str, torch.Tensor]:
        acts = turn.activations
        if acts is None:
            raise CodecInputError(
                self.name,
                "no activations were captured for this turn; capture the input of each "
                "layer's K projection during the turn",
            )
        if len(acts) != spec.layers:
            raise CodecInputError(
                self.name, f"got activations for {len(acts)} layers, the model has {spec.layers}"
            )
        out: dict[str, torch.Tensor] = {}
        for i, a in enumerate(acts):
            if a.dim() != 2 or a.shape[1] != spec.hidden_size:
                raise CodecInputError(
                    self.name,
                    f"layer {i} activation has shape {tuple(a.shape)}; expected "
                    f"[tokens, {spec.hidden_size}]",
                )
            out[f"layers.{i}.act"] = a
        return out

    def decode(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, *, start: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = model.spec
        names = [f"layers.{i}.act" for i in range(spec.layers)]
        check_layers(self.name, stored, names)
        acts = [stored[n] for n in names]
        tokens = acts[0].shape[0] if acts[0].dim() else 0
        for i, x in enumerate(acts):
            if x.dim() != 2 or x.shape != (tokens, spec.hidden_size):
                raise CodecInputError(
                    self.name,
                    f"layer {i} activation has shape {tuple(x.shape)}; expected "
                    f"[{tokens}, {spec.hidden_size}]",
                )
        device = acts[0].device
        if device.type != "cuda":
            return decode_by_layer(self, stored, model, start)
        current = torch.cuda.current_stream(device)
        stream = self._stream(device)
        stream.wait_stream(current)  # the activations were produced on the current stream
        with torch.cuda.stream(stream):
            out = decode_by_layer(self, stored, model, start)
        current.wait_stream(stream)
        for k, v in out:  # allocated on the side stream, used on the current one
            k.record_stream(current)
            v.record_stream(current)
        for a in acts:
            a.record_stream(stream)
        return out

    def decode_layer(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, layer: int, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = model.spec
        name = f"layers.{layer}.act"
        check_layers(self.name, stored, [name])
        x = stored[name]
        if x.dim() != 2 or x.shape[1] != spec.hidden_size:
            raise CodecInputError(
                self.name,
                f"layer {layer} activation has shape {tuple(x.shape)}; expected "
                f"[tokens, {spec.hidden_size}]",
            )
        tokens = x.shape[0]
        positions = torch.arange(start, start + tokens, device=x.device)
        with torch.no_grad():
            k, v = model.project_kv(layer, x, positions)
        want = (spec.kv_heads, tokens, spec.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise CodecInputError(
                self.name,
                f"the model re-projected layer {layer} to K {tuple(k.shape)} and V "
                f"{tuple(v.shape)}; expected {want}",
            )
        return k, v

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index, priority=_LOW_PRIORITY)  # type: ignore[no-untyped-call]
                self._streams[index] = stream
            return stream

    def bytes_per_token(self, spec: ModelSpec) -> int:
        return spec.layers * spec.hidden_size * spec.itemsize

    def decode_flops_per_token(self, spec: ModelSpec) -> int:
        return spec.layers * 2 * 2 * spec.hidden_size * spec.kv_size

    def __repr__(self) -> str:
        return "ActivationCodec()"
