"""A ``DynamicCache`` layer that grows in place, in a buffer sized for the whole turn.

transformers' ``DynamicLayer`` appends each forward pass's keys and values with
``torch.cat``: every decode step copies the layer's whole history, so a turn of ``N``
decode steps over ``P`` history tokens moves ``N * P`` tokens of K/V besides reading them
for attention. On a GPU that copy rides on HBM bandwidth and hides; on a CPU it doubles
the cost of a decode step (measured here: 9 forward passes over a 1,000-token history,
64 KiB of K/V per token, took 180-224 ms with ``DynamicLayer`` and 100-107 ms in place).

:class:`InPlaceLayer` keeps ``[batch, heads, capacity, head_dim]`` buffers and writes each
update into the next free positions; attention reads a view of the filled part, so the
values it sees are the same tensors' values, bit for bit. A turn that outgrows the buffer
reallocates it (doubling), as a ``DynamicLayer`` would have copied anyway. The adapter
restores a history straight into these buffers (``cache.load_into`` fills the leading
positions), so a restored turn copies its history once, from the host tier.

Imported only where transformers is installed (the ``transformers`` extra).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["BufferPool", "InPlaceLayer", "InPlaceSlidingLayer", "in_place_cache", "layer_windows"]


class InPlaceLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One attention layer's K/V in preallocated buffers, filled from the front.

    :param capacity: token positions to allocate at the first update (at least what that
        update brings)
    :param keys: optional ``[batch, heads, capacity, head_dim]`` buffer whose first
        ``length`` positions already hold the history (with ``values``)
    :param values: the matching value buffer
    :param length: positions of ``keys``/``values`` already filled
    """

    def __init__(
        self,
        capacity: int = 0,
        *,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if (keys is None) != (values is None):
            raise ValueError("give both the key and the value buffer, or neither")
        self._first_capacity = capacity  # what the first allocation reserves at least
        self._gate: Callable[[], None] | None = None
        self._k: torch.Tensor | None = keys
        self._v: torch.Tensor | None = values
        self._length = 0
        if keys is not None and values is not None:
            ks, vs = tuple(keys.shape), tuple(values.shape)
            if keys.dim() != 4 or values.dim() != 4 or ks[:2] + ks[3:] != vs[:2] + vs[3:]:
                raise ValueError(
                    f"key and value buffers must be [batch, heads, capacity, head_dim] with "
                    f"the same batch, heads and head_dim, got {ks} and {vs}"
                )
            if not 0 <= length <= min(ks[2], vs[2]):
                raise ValueError(f"length {length} does not fit a buffer of {min(ks[2], vs[2])}")
            self._length = length
            self.device = keys.device
            self.is_initialized = True
            self._expose()

    @property
    def capacity(self) -> int:
        """Token positions allocated (0 before the first update of an empty layer); the
        key and value buffers may be longer or shorter than each other (pooled buffers)."""
        if self._k is None or self._v is None:
            return 0
        return int(min(self._k.shape[-2], self._v.shape[-2]))

    def _expose(self) -> None:
        assert self._k is not None
        assert self._v is not None
        self.keys = self._k[..., : self._length, :]
        self.values = self._v[..., : self._length, :]

    def hold_until(self, ready: Callable[[], None] | None) -> None:
        """Call ``ready()`` (once) before the next update touches the buffers.

        A streamed restore gives each layer a ``ready`` that blocks until the layer's
        history is in its buffers (:meth:`TieredKVCache.load_layerwise
        <tieredkv.TieredKVCache.load_layerwise>`), so the model computes the layers whose
        history has landed while later ones are still read. The model's own code reads a
        layer's history only through :meth:`update`, and every length it asks
        (:meth:`get_seq_length`, mask sizes) is known before any byte lands.
        """
        self._gate = ready

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        need = self._length + key_states.shape[-2]
        if need <= self.capacity:
            return
        size = max(need, self._first_capacity, 2 * self.capacity)
        shape = (*key_states.shape[:-2], size, key_states.shape[-1])
        k = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        v = torch.empty(
            (*value_states.shape[:-2], size, value_states.shape[-1]),
            dtype=value_states.dtype,
            device=value_states.device,
        )
        if self._k is not None and self._v is not None and self._length:
            k[..., : self._length, :].copy_(self._k[..., : self._length, :])
            v[..., : self._length, :].copy_(self._v[..., : self._length, :])
        self._k, self._v = k, v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the filled ones; return views of all filled."""
        gate = self._gate
        if gate is not None:
            gate()
            self._gate = None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._reserve(key_states, value_states)
        assert self._k is not None
        assert self._v is not None
        end = self._length + key_states.shape[-2]
        self._k[..., self._length : end, :].copy_(key_states)
        self._v[..., self._length : end, :].copy_(value_states)
        self._length = end
        self._expose()
        return self._k[..., :end, :], self._v[..., :end, :]

    def get_seq_length(self) -> int:
        """Positions filled."""
        return self._length

    def reset(self) -> None:
        """Forget the contents (keeps nothing allocated)."""
        self._k = self._v = None
        self._gate = None
        self._length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (a negative count, as
        ``DynamicLayer.crop`` takes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative token count, not {tokens_to_remove}")
        if tokens_to_remove == 0 or self._k is None:
            return
        self._length = max(0, self._length + tokens_to_remove)
        self._expose()

    def release(self) -> list[torch.Tensor]:
        """Give up the buffers, as ``[heads, capacity, head_dim]`` (for a
        :class:`BufferPool`); the layer is then empty."""
        buffers = [t[0] if t.shape[0] == 1 else t for t in (self._k, self._v) if t is not None]
        self.reset()
        return buffers

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the adapter serves one conversation per cache (batch 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the adapter serves one conversation per cache (batch 1)")

    def tokens(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``start ..`` (views, ``[batch, heads, tokens, head_dim]``)."""
        assert self._k is not None
        assert self._v is not None
        return self._k[..., start : self._length, :], self._v[..., start : self._length, :]


class InPlaceSlidingLayer(InPlaceLayer):  # type: ignore[no-untyped-call]
    """A sliding-window attention layer that keeps every position in its buffers.

    To the model it is transformers' ``DynamicSlidingWindowLayer``: ``keys``/``values``
    are the last ``sliding_window - 1`` positions, ``update`` returns those followed by the
    new ones, and the mask sizes are the same, so attention sees the same tensors' values.
    Unlike it, the buffers keep the positions that left the window, so that a turn's new
    tokens can all be stored (:meth:`tokens`) however many the turn brought.

    :param sliding_window: the model's window for this layer
    """

    is_sliding = True

    def __init__(
        self,
        sliding_window: int,
        capacity: int = 0,
        *,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, not {sliding_window}")
        self.sliding_window = sliding_window
        super().__init__(capacity, keys=keys, values=values, length=length)

    def _first_kept(self, length: int) -> int:
        return max(0, length - (self.sliding_window - 1))

    def _expose(self) -> None:
        assert self._k is not None
        assert self._v is not None
        first = self._first_kept(self._length)
        self.keys = self._k[..., first : self._length, :]
        self.values = self._v[..., first : self._length, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions; return the window's old ones followed by the new."""
        first = self._first_kept(self._length)
        super().update(key_states, value_states)
        assert self._k is not None
        assert self._v is not None
        return self._k[..., first : self._length, :], self._v[..., first : self._length, :]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` as ``DynamicSlidingWindowLayer`` computes them (from
        the query's length, or its ``cache_position`` as releases before 5.24 pass it)."""
        queries = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        kv_offset = self._first_kept(self._length)
        return self._length - kv_offset + queries, kv_offset

    def get_max_length(self) -> int:
        """The window."""
        return self.sliding_window


def layer_windows(config: Any) -> list[int | None]:
    """Per layer of a model with ``config``: ``None`` for a full-attention layer, the window
    for a sliding-window one, as ``DynamicCache(config=config)`` lays out its layers.

    :raises TypeError: naming the first layer that holds anything else (a recurrent or
        linear-attention state, a layer sharing another's cache): ``(index, layer class)``
        in ``args``
    """
    windows: list[int | None] = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if type(layer) is DynamicLayer:
            windows.append(None)
        elif type(layer) is DynamicSlidingWindowLayer:
            windows.append(int(layer.sliding_window))
        else:
            raise TypeError(i, type(layer).__name__)
    return windows


def in_place_cache(config: Any, layers: list[InPlaceLayer]) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers are ``layers`` (one per layer, an
    :class:`InPlaceSlidingLayer` where :func:`layer_windows` gives a window)."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(layers):
        raise ValueError(f"the model's cache has {len(cache.layers)} layers, got {len(layers)}")
    cache.layers[:] = layers
    return cache


class BufferPool:
    """Host buffers handed back after a turn, for the next turn's restore to fill.

    A fresh multi-megabyte CPU tensor is a fresh ``mmap``: filling it page-faults every
    page (measured here: restoring a 70 MB history into new tensors took 33-42 ms, most of
    it first-touch faults). :meth:`TransformersAdapter.chat_turn` owns its model cache for
    the whole turn, so once the turn's segment is stored it gives the cache's buffers back
    here and the next restore reuses them. Capacities are rounded up (``quantum`` tokens,
    plus a quarter) so a buffer fits the next, slightly longer turns of any conversation.

    :param max_bytes: bytes kept at most (the largest are dropped first beyond it)
    :param quantum: capacities are multiples of this many token positions
    """

    def __init__(self, max_bytes: int, *, quantum: int = 256) -> None:
        if max_bytes < 0 or quantum < 1:
            raise ValueError("max_bytes must be >= 0 and quantum >= 1")
        self.max_bytes = max_bytes
        self.quantum = quantum
        # each pooled tensor with its dtype, device, shape and bytes, read once: take() scans
        # the pool on the event loop, and torch's attribute getters cost microseconds each
        self._free: list[tuple[torch.dtype, torch.device, tuple[int, ...], int, torch.Tensor]] = []
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def capacity_for(self, tokens: int) -> int:
        """The capacity a new buffer for ``tokens`` positions gets."""
        want = tokens + tokens // 4
        return -(-max(want, 1) // self.quantum) * self.quantum

    def take(
        self, shape: tuple[int, ...], dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor with ``shape``'s other dims and at least ``shape[dim]`` positions along
        ``dim`` (contents undefined): a pooled one of at most twice that, or a new one."""
        need = shape[dim]
        most = 2 * max(need, self.quantum)
        other = shape[:dim] + shape[dim + 1 :]
        ndim = len(shape)
        with self._lock:
            best, best_size = -1, 0
            for i, (t_dtype, t_device, t_shape, _, _) in enumerate(self._free):
                if len(t_shape) != ndim or t_dtype != dtype or t_device != device:
                    continue
                size = t_shape[dim]
                if (
                    need <= size <= most
                    and (best < 0 or size < best_size)
                    and t_shape[:dim] + t_shape[dim + 1 :] == other
                ):
                    best, best_size = i, size
            if best >= 0:
                *_, nbytes, t = self._free.pop(best)
                self._bytes -= nbytes
                return t
        full = (*shape[:dim], self.capacity_for(need), *shape[dim + 1 :])
        return torch.empty(full, dtype=dtype, device=device)

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` for reuse (the caller must not touch them afterwards)."""
        with self._lock:
            for t in tensors:
                whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
                if t.device.type == "cpu" and t.is_contiguous() and whole:
                    self._free.append((t.dtype, t.device, tuple(t.shape), t.nbytes, t))
                    self._bytes += t.nbytes
            if self._bytes > self.max_bytes:
                self._free.sort(key=lambda entry: entry[3])
                while self._free and self._bytes > self.max_bytes:
                    self._bytes -= self._free.pop()[3]

    def clear(self) -> None:
        """Drop every pooled buffer."""
        with self._lock:
            self._free.clear()
            self._bytes = 0
