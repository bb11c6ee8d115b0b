"""Keys: what identifies a model's KV, and the hashes of block-aligned token prefixes.

A conversation's KV is only ever served to the model that computed it, in the same KV
dtype, block size and layout: :func:`fingerprint` folds all of them into one hex string,
and every prefix hash and session key starts from it (peers served KV of another model or
dtype: SGLang #24758, #33268). Prefix hashes chain, as vLLM's own prefix cache does: block
``i``'s hash covers the fingerprint and every token of blocks ``0..i``, so equal hashes
mean equal prefixes (xxh3-128; a load also compares the stored token ids, so a collision
can cost a recompute, never wrong KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["block_hashes", "fingerprint", "session_key"]


def fingerprint(
    *,
    model: str,
    revision: str | None,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    layout: str,
) -> str:
    """A short hex digest of everything that makes KV blocks interchangeable.

    :param model: the model's name or path
    :param revision: its revision, if any
    :param dtype: the model's compute dtype
    :param kv_dtype: vLLM's KV cache dtype (``"auto"`` means ``dtype``)
    :param block_size: tokens per KV block
    :param layout: the KV layout (layers, heads, head size, per-layer tensor shape, TP rank)
    """
    text = "\x1f".join([model, revision or "", dtype, kv_dtype, str(block_size), layout])
    return xxhash.xxh3_64_hexdigest(text.encode())


def block_hashes(fp: str, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of ``tokens`` (a partial tail is left out)."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    ids = np.asarray(tokens[: n * block_size], dtype=np.int64)
    out: list[bytes] = []
    prev = fp.encode()
    for i in range(n):
        prev = xxhash.xxh3_128_digest(prev + ids[i * block_size : (i + 1) * block_size].tobytes())
        out.append(prev)
    return out


def session_key(fp: str, first: Sequence[bytes]) -> str:
    """The key of a conversation first stored with these block hashes."""
    return f"vllm-{fp}-{first[-1].hex()[:24]}"
