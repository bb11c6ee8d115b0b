"""Keys: what identifies a model's KV, what identifies a request's, and the hashes of
block-aligned token prefixes.

A history is served only to a request that vLLM's own prefix cache would let share it,
and only by the model that computed it:

* the **engine** part, :func:`fingerprint`: the model's identity (a digest of its weight
  and config files, its revision's commit hash, or the ``model_id`` the operator pins,
  see :func:`model_identity`), its dtype, the KV dtype, the block size and the KV layout
  (peers served KV of another model or dtype: SGLang #24758, #33268);
* the **request** part, :class:`RequestKeys`: what vLLM's prefix cache adds to a block's
  hash besides its tokens (``generate_block_hash_extra_keys``): the LoRA adapter (its
  name, its path, and here also a digest of its files, so that an adapter rewritten in
  place is a different adapter), the request's ``cache_salt``, and the multimodal inputs
  each block holds (their identifiers and offsets). The adapter and the salt hold for the
  whole request (its *identity*); the multimodal keys are per block.

Prefix hashes chain, as vLLM's own prefix cache does: block ``i``'s hash covers the
fingerprint, the request's identity and every token and per-block key of blocks
``0..i``, so equal hashes mean equal prefixes under equal keys (xxh3-128; a load also
compares the stored token ids, so a collision can cost a recompute, never wrong KV).
vLLM's own block hashes are not reused: for non-cryptographic hash functions their seed
is random per process, and these keys must survive a restart (the index is rebuilt from
sidecars on disk).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash

from ...errors import InvalidArgumentError

__all__ = [
    "PLAIN",
    "FilesDigests",
    "RequestKeys",
    "block_hashes",
    "extra_key_digest",
    "files_digest",
    "fingerprint",
    "identity_digest",
    "model_identity",
    "session_key",
]

_log = logging.getLogger(__name__)

FORMAT = "v2"
"""The key format: part of every fingerprint, so that histories stored under another
format (whose keys did not cover the weights or the request's identity) are never
matched: they are misses, never served."""

#: files whose bytes make up a model or an adapter (weights, configs, custom code)
MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".py")

_COMMIT = re.compile(r"[0-9a-f]{40}")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class RequestKeys:
    """What besides its tokens keys a request's blocks.

    :param identity: a hex digest of what holds for the whole request (its LoRA adapter
        and the adapter's files, its ``cache_salt``), ``""`` for none
    :param extra: per block, a hex digest of its own keys (the multimodal inputs it
        holds), ``""`` for none; blocks past the end have none
    """

    identity: str = ""
    extra: tuple[str, ...] = ()

    def prefix(self, blocks: int) -> RequestKeys:
        """The keys of the first ``blocks`` blocks."""
        return RequestKeys(self.identity, self.extra[:blocks])


PLAIN = RequestKeys()
"""A request with nothing but tokens (no adapter, no salt, no multimodal input)."""


def fingerprint(
    *,
    model: str,
    identity: str,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    layout: str,
) -> str:
    """A short hex digest of everything that makes KV blocks interchangeable.

    :param model: the model's name or path (for the record; its bytes are in ``identity``)
    :param identity: what identifies its weights (:func:`model_identity`)
    :param dtype: the model's compute dtype and anything else that changes its arithmetic
        (quantization, config overrides)
    :param kv_dtype: vLLM's KV cache dtype (``"auto"`` means ``dtype``)
    :param block_size: tokens per KV block
    :param layout: the KV layout (layers, heads, head size, per-layer tensor shape, TP rank)
    """
    text = "\x1f".join([FORMAT, model, identity, dtype, kv_dtype, str(block_size), layout])
    return xxhash.xxh3_64_hexdigest(text.encode())


def _model_files(directory: Path) -> list[Path]:
    out: list[Path] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(Path(root, f) for f in files if f.endswith(MODEL_SUFFIXES))
    return sorted(out)


def files_digest(directory: Path) -> tuple[str, int, int]:
    """A digest of a model's or an adapter's files (every weight, config and code file
    under ``directory``, by relative name, size and bytes; hidden folders are skipped).

    :returns: ``(hex digest, files, bytes)``
    :raises InvalidArgumentError: if the directory holds no such file
    """
    files = _model_files(directory)
    if not files:
        raise InvalidArgumentError(
            f"{str(directory)!r} holds no weight or config file ({', '.join(MODEL_SUFFIXES)})"
        )
    h = xxhash.xxh3_128()
    total = 0
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(directory).as_posix()}\x1f{size}\x1f".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        total += size
    return h.hexdigest(), len(files), total


def _stat_signature(directory: Path) -> tuple[tuple[str, int, int, int], ...]:
    out = []
    for path in _model_files(directory):
        st = path.stat()
        out.append((str(path), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def model_identity(
    model: str, revision: str | None, *, model_id: str | None, what: str = "model"
) -> str:
    """What identifies a model's weights: the operator's ``model_id`` if one is pinned,
    else a digest of the files of a local model directory (computed here, once), else
    the commit hash of a hub model's revision (the one given, or the one the local hub
    cache resolved it to).

    :raises InvalidArgumentError: if none of these can be established (pin ``model_id``)
    """
    if model_id is not None:
        return f"id:{model_id}"
    path = Path(model)
    if path.is_dir():
        began = time.monotonic()
        digest, n, size = files_digest(path)
        _log.info(
            "tieredkv: %s identity: digest of %d files (%.1f MiB) under %s in %.2f s "
            "(pin kv_connector_extra_config['model_id'] to skip it)",
            what,
            n,
            size / (1 << 20),
            model,
            time.monotonic() - began,
        )
        return f"files:{digest}"
    if revision is not None and _COMMIT.fullmatch(revision):
        return f"rev:{model}@{revision}"
    commit = _hub_commit(model, revision)
    if commit is None:
        raise InvalidArgumentError(
            f"the TieredKVConnector cannot tell which weights {model!r} (revision "
            f"{revision!r}) are: it is no local directory, its revision is no commit hash "
            "and the local hub cache does not resolve it. Set "
            "kv_connector_extra_config['model_id'] to a name that changes whenever the "
            "weights do"
        )
    return f"rev:{model}@{commit}"


def _hub_commit(model: str, revision: str | None) -> str | None:
    """The commit the local Hugging Face cache resolves ``model@revision`` to, if any."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            model, revision=revision, local_files_only=True, allow_patterns=["config.json"]
        )
    except Exception:
        return None
    name = Path(path).name
    return name if _COMMIT.fullmatch(name) else None


class FilesDigests:
    """Digests of adapter directories, computed once per content: a directory whose
    files change (size, mtime, inode) is digested again."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[tuple[str, int, int, int], ...], str]] = {}
        self._lock = threading.Lock()

    def digest(self, directory: str) -> str:
        """The digest of ``directory``'s files.

        :raises InvalidArgumentError: if it holds none (or is no directory)
        :raises OSError: if they cannot be read
        """
        path = Path(directory)
        if not path.is_dir():
            raise InvalidArgumentError(f"{directory!r} is no directory")
        signature = _stat_signature(path)
        with self._lock:
            known = self._known.get(directory)
        if known is not None and known[0] == signature:
            return known[1]
        digest = model_identity(directory, None, model_id=None, what="LoRA adapter")
        with self._lock:
            self._known[directory] = (signature, digest)
        return digest


def identity_digest(keys: Iterable[tuple[Any, ...]]) -> str:
    """The hex digest of a request's whole-request keys (``""`` for none)."""
    items = sorted(msgspec.msgpack.encode(k) for k in keys)
    if not items:
        return ""
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(items))


def extra_key_digest(keys: Sequence[Any] | None) -> str:
    """The hex digest of one block's own keys (``""`` for none).

    :raises TypeError: if a key is not made of strings, numbers and bytes
    """
    if not keys:
        return ""
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(list(keys)))


def block_hashes(
    fp: str, tokens: Sequence[int], block_size: int, keys: RequestKeys = PLAIN
) -> list[bytes]:
    """The chained hash of every full block of ``tokens`` (a partial tail is left out),
    under the request's ``keys``."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    ids = np.asarray(tokens[: n * block_size], dtype=np.int64)
    out: list[bytes] = []
    prev = fp.encode() if not keys.identity else f"{fp}/{keys.identity}".encode()
    extra = keys.extra
    for i in range(n):
        data = prev + ids[i * block_size : (i + 1) * block_size].tobytes()
        if i < len(extra) and extra[i]:
            data += bytes.fromhex(extra[i])
        prev = xxhash.xxh3_128_digest(data)
        out.append(prev)
    return out


def session_key(fp: str, first: Sequence[bytes]) -> str:
    """The key of a conversation first stored with these block hashes."""
    return f"vllm-{fp}-{first[-1].hex()[:24]}"
