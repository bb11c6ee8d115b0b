"""Capture hooks: the input of each layer's K projection, recorded while a turn runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ActivationCapture"]


class ActivationCapture:
    """Records the input of every layer's K projection while active (forward pre-hooks).

    One conversation at a time (batch size 1). Use as a context manager; the hooks are
    removed on exit. Every forward pass of the model while it is active is recorded, so
    run no other work on the model meanwhile.

    :param modules: each layer's K projection module, in layer order
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self._modules = modules
        self._chunks: list[list[torch.Tensor]] = [[] for _ in modules]
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationCapture:
        for i, module in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if x.dim() != 3 or x.shape[0] != 1:
                raise ValueError(
                    f"activation capture supports batch size 1 (one conversation), got an "
                    f"input of shape {tuple(x.shape)}"
                )
            self._chunks[i].append(x[0].detach())

        return record

    @property
    def tokens(self) -> int:
        """Tokens recorded so far."""
        return sum(int(c.shape[0]) for c in self._chunks[0]) if self._chunks else 0

    def activations(self) -> list[torch.Tensor]:
        """Each layer's recorded activation, ``[tokens, hidden_size]``, in forward order."""
        return [torch.cat(chunks, dim=0) for chunks in self._chunks]
