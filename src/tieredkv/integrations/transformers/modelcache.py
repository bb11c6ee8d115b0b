"""Model caches: the ``DynamicCache`` the model runs a turn on, built from a restored history.

Every cache the adapter hands the model has :class:`~tieredkv.integrations.inplace.InPlaceLayer`
layers (sliding-window ones where the model slides), whose K/V buffers have room for the
turn's new tokens. On a CPU model the buffers come from a
:class:`~tieredkv.integrations.inplace.BufferPool` that the finished turns give back.
Which buffers a history lands in is the codec's business: a codec that decodes in place
(:attr:`Codec.decodes_in_place <tieredkv.codecs.Codec.decodes_in_place>`) has the load
fill the layers' own buffers; any other decodes into them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...codecs import Codec, ModelAccess, ModelSpec, layer_groups

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ...cache import LayerwiseLoad
    from ..inplace import BufferPool, InPlaceLayer

__all__ = ["ModelCaches", "layer_kv"]


class ModelCaches:
    """Builds one model's caches, from buffers of its own pool.

    :param config: the model's config (what ``DynamicCache(config=...)`` lays out)
    :param spec: the model's shape
    :param windows: per layer, ``None`` (full attention) or its sliding window
    :param recycle_bytes: host buffers kept for later turns, at most (0: no pool)
    """

    def __init__(
        self, config: Any, spec: ModelSpec, windows: list[int | None], recycle_bytes: int
    ) -> None:
        from ..inplace import BufferPool

        self._config = config
        self._spec = spec
        self._windows = windows
        self.pool: BufferPool | None = BufferPool(recycle_bytes) if recycle_bytes else None
        """The buffer pool (``None`` with ``recycle_bytes=0``)."""

    def empty(
        self, shape: tuple[int, ...], dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialized tensor with ``shape`` or more positions along ``dim`` (from the
        pool on a CPU model)."""
        if self.pool is not None and device.type == "cpu":
            return self.pool.take(shape, dim, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device)

    def allocate(self, codec: Codec, tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Tensors for ``tokens`` positions (or more) of every name ``codec`` stores."""
        dtype = getattr(torch, self._spec.dtype)
        return {
            name: self.empty(
                tuple(tokens if d == -1 else d for d in shape), shape.index(-1), dtype, device
            )
            for name, shape in codec.layout(self._spec).items()
        }

    def leading(
        self, codec: Codec, out: Mapping[str, torch.Tensor], tokens: int
    ) -> dict[str, torch.Tensor]:
        """The first ``tokens`` positions of each of ``out``'s tensors, along the token
        dimension of ``codec``'s layout (views)."""
        dims = {name: shape.index(-1) for name, shape in codec.layout(self._spec).items()}
        return {name: t.narrow(dims[name], 0, tokens) for name, t in out.items()}

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Hand spare tensors to the pool (the caller gives them up)."""
        if self.pool is not None:
            self.pool.give(tensors)

    def recycle(self, model_cache: Any) -> None:
        """Hand a finished turn's buffers to the pool (the turn owned them)."""
        if self.pool is None:
            return
        from ..inplace import InPlaceLayer

        buffers: list[torch.Tensor] = []
        for layer in getattr(model_cache, "layers", ()):
            if isinstance(layer, InPlaceLayer):
                buffers.extend(layer.release())
        self.pool.give(buffers)

    def new(self, room: int = 0) -> DynamicCache:
        """An empty model cache whose layers append in place, sized for ``room`` tokens."""
        from ..inplace import in_place_cache

        return in_place_cache(self._config, [_in_place_layer(w, room) for w in self._windows])

    def holding(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], room: int, *, adopt: bool
    ) -> DynamicCache:
        """``kv`` (per layer ``[kv_heads, tokens, head_dim]``) as a cache with at least
        ``room`` free positions after the history. With ``adopt``, K/V that are the leading
        positions of ``[kv_heads, capacity, head_dim]`` buffers with that room become the
        cache's buffers (no copy; the caller gives them up); otherwise they are copied."""
        from ..inplace import in_place_cache

        layers: list[InPlaceLayer] = []
        for (k, v), window in zip(kv, self._windows, strict=True):
            tokens = k.shape[1]
            kb, vb = (_buffer_of(k), _buffer_of(v)) if adopt else (None, None)
            if kb is None or vb is None or min(kb.shape[1], vb.shape[1]) < tokens + room:
                kb = self.empty((k.shape[0], tokens + room, k.shape[2]), 1, k.dtype, k.device)
                vb = self.empty((v.shape[0], tokens + room, v.shape[2]), 1, v.dtype, v.device)
                kb[:, :tokens].copy_(k)
                vb[:, :tokens].copy_(v)
            layers.append(_in_place_layer(window, keys=kb[None], values=vb[None], length=tokens))
        return in_place_cache(self._config, layers)

    def gated(
        self,
        codec: Codec,
        access: ModelAccess,
        out: Mapping[str, torch.Tensor],
        load: LayerwiseLoad,
        room: int,
    ) -> DynamicCache:
        """A model cache over ``out`` (filled by ``load``, one group per layer) whose layer
        ``i`` waits for group ``i`` before the model reads it: in ``out`` itself with a
        codec that decodes in place, else decoded into the layer's own buffers first."""
        from ..inplace import in_place_cache

        spec, tokens = self._spec, load.tokens
        filled = self.leading(codec, out, tokens)
        layers: list[InPlaceLayer] = []
        groups = layer_groups(codec, spec)
        for i, (window, names) in enumerate(zip(self._windows, groups, strict=True)):
            if codec.decodes_in_place:
                k, v = codec.decode_layer({n: out[n] for n in names}, access, i)
                layer = _in_place_layer(window, keys=k[None], values=v[None], length=tokens)
                layer.hold_until(functools.partial(_wait, load, i))
                layers.append(layer)
                continue
            stored = {n: filled[n] for n in names}
            dtype, device = getattr(torch, spec.dtype), stored[names[0]].device
            shape = (spec.kv_heads, tokens + room, spec.head_dim)
            kb, vb = self.empty(shape, 1, dtype, device), self.empty(shape, 1, dtype, device)
            layer = _in_place_layer(window, keys=kb[None], values=vb[None], length=tokens)
            layer.hold_until(
                functools.partial(_decode_into, codec, access, load, i, stored, kb, vb)
            )
            layers.append(layer)
        return in_place_cache(self._config, layers)


def _wait(load: LayerwiseLoad, group: int) -> None:
    """Block the model's thread until ``group`` of a streamed restore is in place."""
    load.wait(group)


def _decode_into(
    codec: Codec,
    access: ModelAccess,
    load: LayerwiseLoad,
    layer: int,
    stored: Mapping[str, torch.Tensor],
    kb: torch.Tensor,
    vb: torch.Tensor,
) -> None:
    """Wait for ``layer``'s group of ``load``, decode it into the buffers ``kb``/``vb``."""
    _wait(load, layer)
    with torch.no_grad():
        k, v = codec.decode_layer(stored, access, layer)
    kb[:, : k.shape[1]].copy_(k)
    vb[:, : v.shape[1]].copy_(v)


def layer_kv(
    model_cache: Any, layers: int, start: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Each layer's K and V of the positions after ``start`` in ``model_cache`` (batch 1,
    ``[kv_heads, new, head_dim]``), and how many they are.

    :raises ValueError: if the cache does not have ``layers`` layers of one length, has no
        token after ``start``, or has lost some to a sliding window
    """
    found = list(getattr(model_cache, "layers", ()))
    if len(found) != layers:
        raise ValueError(f"the model cache has {len(found)} layers, the model {layers}")
    total = int(model_cache.get_seq_length())
    new = total - start
    if new <= 0:
        raise ValueError(f"the model cache holds {total} tokens: none after {start}")
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, layer in enumerate(found):
        k, v = _layer_tokens(layer, i, start, total)
        if k.shape[0] != 1:
            raise ValueError("the adapter stores one conversation per session (batch 1)")
        keys.append(k[0])
        values.append(v[0])
    return keys, values, new


def _in_place_layer(window: int | None, capacity: int = 0, **buffers: Any) -> InPlaceLayer:
    """An in-place cache layer: full attention (``window`` ``None``) or sliding-window."""
    from ..inplace import InPlaceLayer, InPlaceSlidingLayer

    if window is None:
        return InPlaceLayer(capacity, **buffers)
    return InPlaceSlidingLayer(window, capacity, **buffers)


def _layer_tokens(
    layer: Any, index: int, start: int, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s K and V of positions ``start .. total-1`` (``[batch, heads, tokens,
    head_dim]``), from one of the adapter's in-place layers or a transformers layer."""
    from ..inplace import InPlaceLayer

    if int(layer.get_seq_length()) != total:
        raise ValueError(
            f"layer {index} of the model cache holds {layer.get_seq_length()} "
            f"tokens, layer 0 {total}"
        )
    if isinstance(layer, InPlaceLayer):
        return layer.tokens(start)
    keys, values = layer.keys, layer.values
    first = total - int(keys.shape[-2])  # a sliding-window layer keeps only the last ones
    if start < first:
        raise ValueError(
            f"layer {index} of the model cache (a {type(layer).__name__}) no longer holds "
            f"positions {start} .. {first - 1}: they left its sliding window; run the turn on "
            f"a cache from adapter.restore() or adapter.new_model_cache(), which keep them"
        )
    return keys[..., start - first :, :], values[..., start - first :, :]


def _buffer_of(t: torch.Tensor) -> torch.Tensor | None:
    """The ``[heads, capacity, dim]`` tensor of which ``t`` is the leading positions, if it
    is such a view (``t`` itself when it is whole)."""
    base = t._base if t._base is not None else t
    if (
        base.dim() == 3
        and base.is_contiguous()
        and base.shape[0] == t.shape[0]
        and base.shape[2] == t.shape[2]
        and t.data_ptr() == base.data_ptr()
        and t.stride() == base.stride()
    ):
        return base
    return None
