"""Running the model: forward passes on a model cache, one turn at a time.

:class:`ModelRunner` feeds token ids to the model with the cache keyword its transformers
release takes, decodes (greedy or with a sampler), records activations where the codec
needs them, and knows the model's position limit.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ...codecs import ModelSpec
from ..forward import cache_argument
from .capture import ActivationCapture
from .errors import HistoryMismatchError

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs one model's forward passes for the adapter, one turn at a time (a lock).

    :param model: the transformers causal LM
    :param spec: its shape
    :param k_modules: each layer's K projection, to capture activations from (empty: the
        codec needs none, and :meth:`capture` records nothing)
    """

    def __init__(self, model: Any, spec: ModelSpec, k_modules: Sequence[torch.nn.Module]) -> None:
        self.model = model
        self._spec = spec
        self._k_modules = k_modules
        self._cache_kw = cache_argument(model)
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return torch.device(next(self.model.parameters()).device)

    def capture(self) -> ActivationCapture:
        """Hooks recording each layer's K projection input (nothing without K modules)."""
        return ActivationCapture(self._k_modules)

    def check_positions(self, session: str, tokens: int) -> None:
        """Raise :class:`HistoryMismatchError` if ``tokens`` positions exceed a model's
        learned positions (a rotary model has no such limit)."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not self._spec.rotary and limit is not None and tokens > limit:
            raise HistoryMismatchError(
                session, f"{tokens} tokens exceed the model's {limit} learned positions"
            )

    @contextmanager
    def turn(self) -> Iterator[ActivationCapture | None]:
        """Hold the model for one turn (no gradients), recording activations if any are
        captured: the turn's capture, or ``None``."""
        with self._lock, torch.no_grad():
            if not self._k_modules:
                yield None
                return
            with self.capture() as capture:
                yield capture

    def decode(
        self,
        model_cache: Any,
        prefill: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
        pick: Callable[[torch.Tensor], int],
        *,
        feed_last: bool,
    ) -> list[int]:
        """Prefill, then decode up to ``max_new_tokens`` tokens (stopping after
        ``eos_token_id``); with ``feed_last``, feed the last one too: it was sampled, never
        fed, so its K/V is not in the cache yet. Call inside :meth:`turn`."""
        token = pick(self.step(model_cache, prefill))
        answer = [token]
        while len(answer) < max_new_tokens and token != eos_token_id:
            token = pick(self.step(model_cache, torch.tensor([token])))
            answer.append(token)
        if feed_last:
            self.step(model_cache, torch.tensor([token]))
        return answer

    def step(self, model_cache: Any, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids``; the logits of the last position, ``[vocab]``."""
        kwargs: dict[str, Any] = {self._cache_kw: model_cache, "use_cache": True}
        if self._keep_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids.view(1, -1).to(self.device), **kwargs)
        logits: torch.Tensor = out.logits[0, -1]
        return logits
