"""The scheduler side's index: which stored conversation a prompt continues.

The scheduler process never touches KV bytes. It keeps, per stored conversation, the
chained hashes of its block-aligned tokens (:mod:`.keys`), and answers "how many leading
blocks of this prompt are stored, and in which conversation". It learns what the worker
stored from the worker's per-step metadata, and after a restart it reads the same facts
back from the sidecar files the worker writes next to the SSD tier (one small JSON file
per conversation: its fingerprint, its keys and token ids, written after the KV they
describe has been committed). A sidecar may lag the stored KV (a crash between the two), never lead
it; and a load compares the stored token ids anyway, so a stale entry costs a recompute.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from .keys import PLAIN, RequestKeys, block_hashes

__all__ = ["PrefixIndex", "Sidecar", "read_sidecars", "remove_sidecar", "write_sidecar"]


class Sidecar(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation's index entry on disk.

    :param session: the conversation's key in the cache
    :param fingerprint: the model/dtype/layout fingerprint it was stored under
    :param tokens: the token ids of its stored, block-aligned history
    :param identity: its requests' identity (:attr:`.keys.RequestKeys.identity`)
    :param extra: its blocks' own keys (:attr:`.keys.RequestKeys.extra`)
    """

    session: str
    fingerprint: str
    tokens: list[int]
    identity: str = ""
    extra: list[str] = []

    @property
    def keys(self) -> RequestKeys:
        """The keys its blocks were stored under."""
        return RequestKeys(self.identity, tuple(self.extra))


def _sidecar_path(directory: Path, session: str) -> Path:
    return directory / f"{session}.json"


def write_sidecar(directory: Path, sidecar: Sidecar) -> None:
    """Write (or replace) a sidecar atomically: a temporary file, fsync, rename."""
    directory.mkdir(parents=True, exist_ok=True)
    final = _sidecar_path(directory, sidecar.session)
    tmp = final.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(sidecar))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def remove_sidecar(directory: Path, session: str) -> None:
    """Forget a conversation on disk (no error if it has no sidecar)."""
    with contextlib.suppress(FileNotFoundError):
        _sidecar_path(directory, session).unlink()


def read_sidecars(directory: Path, fp: str) -> Iterator[Sidecar]:
    """The sidecars stored under fingerprint ``fp`` (others, and unreadable files, are
    skipped: a file half-written by a crash never had its rename)."""
    if not directory.is_dir():
        return
    decoder = msgspec.json.Decoder(Sidecar)
    for path in sorted(directory.glob("*.json")):
        try:
            sidecar = decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError):
            continue
        if sidecar.fingerprint == fp and path.stem == sidecar.session:
            yield sidecar


class PrefixIndex:
    """Stored conversations by the chained hashes of their blocks.

    :param fp: the fingerprint every hash starts from
    :param block_size: tokens per block
    """

    def __init__(self, fp: str, block_size: int) -> None:
        self.fp = fp
        self.block_size = block_size
        self._blocks: dict[str, list[bytes]] = {}
        self._by_hash: dict[bytes, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, session: object) -> bool:
        return session in self._blocks

    def blocks(self, session: str) -> int:
        """Blocks stored for ``session`` (0 if unknown)."""
        return len(self._blocks.get(session, ()))

    def hashes(self, tokens: Sequence[int], keys: RequestKeys = PLAIN) -> list[bytes]:
        """The chained hashes of the full blocks of ``tokens`` under a request's keys."""
        return block_hashes(self.fp, tokens, self.block_size, keys)

    def match(self, hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """The conversation holding the longest stored prefix of these block hashes.

        :returns: ``(session, blocks matched)``, or ``(None, 0)``
        """
        best: str | None = None
        n = 0
        for i, h in enumerate(hashes):
            owners = self._by_hash.get(h)
            if not owners:
                break
            best, n = next(reversed(owners)), i + 1
        return best, n

    def put(self, session: str, hashes: Sequence[bytes]) -> None:
        """Record that ``session`` stores exactly these blocks."""
        self.remove(session)
        self._blocks[session] = list(hashes)
        for h in hashes:
            self._by_hash.setdefault(h, {})[session] = None

    def remove(self, session: str) -> None:
        """Forget ``session`` (no-op if unknown)."""
        for h in self._blocks.pop(session, ()):
            owners = self._by_hash.get(h)
            if owners is not None:
                owners.pop(session, None)
                if not owners:
                    del self._by_hash[h]
