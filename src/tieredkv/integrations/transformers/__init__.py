"""Hugging Face ``transformers`` adapter: a model's ``DynamicCache`` <-> :class:`TieredKVCache`.

Install the ``transformers`` extra (``pip install -e '.[transformers]'`` in a checkout;
tested with transformers 5.24). The adapter supports any decoder-only model whose cache
holds per-layer keys and values,
full-attention and sliding-window layers alike (Llama, Mistral, Qwen, Gemma, GPT-2, ...;
see ``docs/reference/supported-models.md``), batch size 1 (one conversation per session).
Models whose cache holds recurrent, state-space or linear-attention states are refused.

One turn of a conversation, with the token bookkeeping (``P`` = history tokens, ``Q`` =
query tokens, ``N`` = answer tokens)::

    restore    cache.load_into(session) -> decode (codec) -> DynamicCache of P tokens,
               positions 0 .. P-1 (refused unless codec, model fingerprint and token count
               match; see HistoryMismatchError)
    prefill    the query, positions P .. P+Q-1; its last logits give answer token a1
    decode     feed a1 .. a(N-1) one at a time (positions P+Q .. P+Q+N-2); each step's
               logits give the next token (greedy, or sampled if asked)
    complete   feed aN once more (position P+Q+N-1), logits discarded: after a decode
               loop (or ``generate()``) the last generated token has been *sampled* but
               never *fed*, so its K/V is not in the model's cache. Without this step the
               next turn would have to prefill aN in front of its query, and the stored
               history would end one token short of the conversation.
    store      the Q+N new tokens (positions P .. P+Q+N-1) become one segment:
               cache.append(session, ..., answer_tokens=N)

After the turn the stored history holds exactly the tokens of every query and answer so
far, so the next turn's restored cache equals what the uninterrupted session's cache would
hold (K/V bit-identical with the K/V codec; up to one matrix multiplication's rounding
with the activation codec). Sliding-window layers are stored whole and restored to the
window the model's own cache would keep.

The codec is chosen per model: the K/V codec works for every supported model; the
activation codec (the input of each layer's K/V projections) only for families in the
architecture registry (:mod:`tieredkv.integrations.architectures`) and only where the
re-projection is exact (not for RoPE whose frequencies depend on the sequence length:
``dynamic``, ``longrope``). ``codec="auto"`` takes the one that stores fewer bytes per
token; the choice and the reason are in :attr:`TransformersAdapter.codec_reason` and logged.

Real models load as usual (weights are not part of tieredkv)::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("facebook/opt-1.3b", dtype=torch.float16)
    adapter = TransformersAdapter(model.eval(), tag="facebook/opt-1.3b")
"""

from __future__ import annotations

from ..forward import cache_argument as cache_argument
from .adapter import TransformersAdapter as TransformersAdapter
from .capture import ActivationCapture as ActivationCapture
from .chat import ChatTurn as ChatTurn
from .errors import ArchitectureMismatchError as ArchitectureMismatchError
from .errors import HistoryMismatchError as HistoryMismatchError
from .errors import TransformersMissingError as TransformersMissingError
from .errors import UnsupportedModelError as UnsupportedModelError
from .probe import model_spec as model_spec

__all__ = [
    "ActivationCapture",
    "ArchitectureMismatchError",
    "ChatTurn",
    "HistoryMismatchError",
    "TransformersAdapter",
    "TransformersMissingError",
    "UnsupportedModelError",
    "cache_argument",
    "model_spec",
]
