"""The adapter's errors, and the check that transformers is installed."""

from __future__ import annotations

from typing import Any

from ...errors import TieredKVError

__all__ = [
    "ArchitectureMismatchError",
    "HistoryMismatchError",
    "TransformersMissingError",
    "UnsupportedModelError",
    "check_loaded",
    "require_transformers",
]


class TransformersMissingError(TieredKVError, ImportError):
    """The optional ``transformers`` dependency is not installed."""

    def __init__(self) -> None:
        super().__init__(
            "tieredkv.integrations.transformers needs the 'transformers' package: "
            "pip install -e '.[transformers]' in a checkout (the transformers extra), or pip "
            "install transformers"
        )


class UnsupportedModelError(TieredKVError, ValueError):
    """The model (or one of its features, or the codec asked for) is not supported."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{detail}; the transformers adapter supports decoder-only models whose cache "
            f"holds per-layer keys and values (full or sliding-window attention), batch 1"
        )


class ArchitectureMismatchError(TieredKVError, ValueError):
    """The registered :class:`~tieredkv.integrations.architectures.Architecture` of a model
    type does not describe this model's modules: the activation codec would be wrong."""

    def __init__(self, model_type: str, detail: str) -> None:
        self.model_type = model_type
        super().__init__(
            f"the architecture registered for {model_type!r} does not match this model: "
            f"{detail}; fix the entry (register_architecture) or use codec='kv', which "
            f"needs no architecture"
        )


class HistoryMismatchError(TieredKVError, ValueError):
    """A stored history does not fit the model (codec, fingerprint or token count): refused.

    Nothing was loaded into the model. Recompute the conversation from its tokens instead
    (drop the session and pass ``history=`` to :meth:`TransformersAdapter.chat_turn`).
    """

    def __init__(self, session: str, detail: str) -> None:
        self.session = session
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"stored history of session {shown!r} cannot be used with this model: {detail}; "
            f"drop the session and recompute it from its tokens"
        )


def require_transformers() -> Any:
    """The ``transformers`` module.

    :raises TransformersMissingError: if it is not installed
    """
    try:
        import transformers
    except ImportError as exc:
        raise TransformersMissingError() from exc
    return transformers


def check_loaded(session: str, tokens: int, expected: int) -> None:
    """Raise :class:`HistoryMismatchError` if a load brought ``tokens`` positions where the
    session's metadata said ``expected``."""
    if tokens != expected:
        raise HistoryMismatchError(
            session, f"it holds {tokens} tokens where its metadata said {expected}"
        )
