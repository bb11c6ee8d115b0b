"""SSD: the persistent capacity tier. One file per segment under a directory.

The directory holds ``segments/xx/<hash>.<seq>.seg`` (one file per segment; the hash is
BLAKE2b-128 of the session key), ``tmp/`` (writes under way), ``quarantine/`` (damaged
files moved aside) and ``LOCK`` (see :mod:`~tieredkv.backends.ssd.layout`). File names
derive from a hash of the session key, so no key can escape or break the directory; the
key itself lives in the segment header, which is how the index is rebuilt after a restart.

Nothing under the directory is reached through a symbolic link: the subdirectories are
opened once with ``O_NOFOLLOW`` and every file is then named relative to a subdirectory's
descriptor (``dir_fd``), so a ``tmp/`` or ``segments/ab`` replaced by a link cannot make
the tier write, read or delete outside the directory. A symlinked ``segments``, ``tmp``,
``quarantine`` or ``LOCK`` fails :meth:`SSDTier.open`; a symlinked ``segments/ab`` or
segment file is moved to ``quarantine/`` (the link, never its target).

Every header is checked at open (:func:`~tieredkv.payload.parse_header`: CRC, then contents
against the file's length); a file whose header was read and found wrong is quarantined and
the tier opens with the rest (:meth:`SSDTier.set_aside` names them per session). An I/O
error is not evidence of damage: a header read that fails is tried again (5 tries over
0.44 s, :mod:`tieredkv._retry`), and if it still fails, :meth:`SSDTier.open` fails
with a :class:`~tieredkv.errors.TierIOError` naming the file, having moved and deleted
nothing, so a later open sees every file. While open, a read serves a
file only if its prefix (which covers the header's CRC and the body's hash) is the one this
tier wrote or found at open, so a file swapped behind the tier's back, even for a valid
older copy of the same segment, is refused.

With a ``secret``, segments are authenticated (:mod:`tieredkv.payload`): the tier writes
each segment with a keyed BLAKE2b MAC of its header and of its body, and with the
session's *incarnation*, a random id shared by every segment of the session while the
session has any segment in the tier (a new one after it has had none). At open every
header's MAC is checked and a session whose files carry more than one incarnation is
quarantined whole; every read checks both MACs. What that catches, for someone who can
write the directory but does not know the secret:

- a forged segment, or any change to a header or a body: refused (a MAC fails);
- a segment written without the secret or with another one: refused;
- a stale, valid copy of one segment from an earlier residency of its session put back
  among newer ones (a rollback of one segment): the session is refused at open (two
  incarnations); put back while the tier is open: refused on read (not the file it wrote);
- a segment moved to another session or turn: refused (the name and the key in the
  authenticated header disagree).

What it does not catch: a rollback of a whole session (every one of its files replaced by
an older residency's complete set) or of the whole directory; files deleted (a session
then comes back shorter, or not at all: a miss, never wrong bytes); a segment copied from
another directory written with the same secret and the same session key, when it replaces
all of that session's files. Files written without a secret are all refused (quarantined)
when a directory is first opened with one; a directory opened without the secret checks
only CRCs and hashes. MACs cost a BLAKE2b pass over every segment written and read, in the
calling worker thread: about 12 times xxh3's cost (0.28 against 3.3 GB/s on one core of
a busy 2-core machine, 64 MiB hashed, best of 5).

Writes are atomic: the bytes go to a temporary file, which is renamed into place once
every byte is written; the file and its directory are ``fsync``-ed before the write
counts (with O_DIRECT after the rename, buffered before it: see
:mod:`~tieredkv.backends.ssd.writer`). A process killed at any moment therefore leaves
each segment either whole or absent. Data is read and written with
``O_DIRECT`` and 4 KiB-aligned buffers, so the page cache cannot turn the "SSD" into a
second memory tier; where the filesystem refuses ``O_DIRECT`` (tmpfs, some overlay
filesystems) the tier falls back to buffered I/O, drops the pages it touched with
``posix_fadvise(DONTNEED)``, and says so in :meth:`SSDTier.stats`.

Reads verify the header CRC and the body's xxh3 hash while the data streams in: up to eight
chunk reads are kept in flight, and the hash of each chunk (in a second thread; xxh3
releases the GIL) overlaps the reads of the next ones. :meth:`SSDTier.read` (the tier's
one read) streams whole histories that way when asked for spans, handing each span to a
consumer (in a third thread) as it arrives, or reading it straight into the consumer's
memory where the consumer says where its bytes go and the places suit O_DIRECT (a load's
output tensors: :class:`~tieredkv.backends.base.LandingConsumer`);
:meth:`SSDTier.write_filled` writes a segment part by part while its caller is still
serializing the next part. A segment that fails is moved to ``quarantine/`` and reported as
:class:`~tieredkv.errors.CorruptSegmentError`; the cache treats it as a miss.

The package, one concern per module:

- :mod:`~tieredkv.backends.ssd.layout`: the directory's layout (subdirectories, file names,
  the one-incarnation rule, reading a header), shared with :mod:`tieredkv.fsck`;
- :mod:`~tieredkv.backends.ssd.dirs`: the open directory (descriptors that never follow a
  link, the lock, quarantine);
- :mod:`~tieredkv.backends.ssd.probe`: the O_DIRECT probe at open;
- :mod:`~tieredkv.backends.ssd.index`: the committed segments, reservations and
  incarnations in memory;
- :mod:`~tieredkv.backends.ssd.recovery`: rebuilding the index at open;
- :mod:`~tieredkv.backends.ssd.reader`: reading and verifying whole segments;
- :mod:`~tieredkv.backends.ssd.stream`: streaming segments span by span;
- :mod:`~tieredkv.backends.ssd.writer`: atomic, durable writes;
- :mod:`~tieredkv.backends.ssd.tier`: :class:`SSDTier`, which composes them.
"""

from __future__ import annotations

from .layout import read_header_at as read_header_at
from .layout import segment_file_name as segment_file_name
from .tier import SSDTier as SSDTier

__all__ = ["SSDTier", "read_header_at", "segment_file_name"]
