"""What the serving loop needs from a model adapter: :class:`ChatAdapter`.

:class:`~tieredkv.integrations.transformers.TransformersAdapter` is one; an adapter for
another inference library implements the same few members and serves through
:class:`~tieredkv.serve.engine.ServingEngine` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..cache import TieredKVCache

__all__ = ["ChatAdapter", "ChatResult", "RecomputingAdapter"]


class ChatResult(Protocol):
    """What one :meth:`ChatAdapter.chat_turn` reports (the engine also reads the optional
    ``restore_seconds``, ``compute_seconds`` and ``store_seconds`` where present)."""

    @property
    def answer(self) -> Sequence[int]:
        """The generated token ids."""
        ...

    @property
    def restored_tokens(self) -> int:
        """History tokens restored from the cache (0 if it had none)."""
        ...

    @property
    def recomputed_tokens(self) -> int:
        """History tokens prefilled from ``history=`` because the cache had no usable copy."""
        ...


@runtime_checkable
class ChatAdapter(Protocol):
    """A model behind the serving loop: runs a turn against the tiered cache."""

    async def chat_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: list[int],
        *,
        max_new_tokens: int,
        history: list[int],
    ) -> ChatResult:
        """Restore the session's history, answer ``query`` with ``max_new_tokens`` tokens
        (greedy unless the adapter is told otherwise), store the turn.

        :param history: every query and answer token so far (the engine keeps them), to
            recompute the history from if the cache lost it

        For a :class:`~tieredkv.serve.engine.TurnRequest` that carries a retention hint,
        the engine also passes ``hint=`` (a :class:`~tieredkv.meta.RetentionHint`), which
        the adapter applies to the conversation once the turn is stored (as
        ``TransformersAdapter.chat_turn`` does); an adapter that takes no hints serves
        requests without one.
        """
        ...


@runtime_checkable
class RecomputingAdapter(ChatAdapter, Protocol):
    """A :class:`ChatAdapter` that also answers with no cache: the engine's no-cache
    baseline (``ServingEngine(..., recompute=True)``)."""

    async def recompute(self, tokens: list[int], *, max_new_tokens: int) -> Sequence[int]:
        """Answer greedily after prefilling ``tokens`` (every query and answer so far, then
        the new query) from nothing, as a server without a KV cache does; nothing is read
        from or stored in the cache.

        :returns: the ``max_new_tokens`` answer tokens
        """
        ...
