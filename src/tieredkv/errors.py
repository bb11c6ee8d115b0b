"""One exception hierarchy for tieredkv.

Every exception raised on purpose by the library derives from :class:`TieredKVError`, and
each specific one also derives from the matching built-in, so ``except KeyError`` or
``except OSError`` in existing code keeps working. Messages are built in ``__init__`` and
say what to do about the problem.

"No victim found" is not an error: eviction policies return ``None`` for it.
"""

from __future__ import annotations

import os

__all__ = [
    "CapacityError",
    "ClosedError",
    "CommitDelayedError",
    "CorruptSegmentError",
    "ForkedError",
    "HistoryConflictError",
    "HistoryLengthError",
    "HistoryLostError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LeaseHeldError",
    "RestoreFailedError",
    "PinLimitError",
    "SchemaMismatchError",
    "SessionNotFoundError",
    "StaleWriterError",
    "TierIOError",
    "TieredKVError",
    "TurnRefusedError",
    "UnauthenticatedWriterError",
    "UnknownFormatError",
    "UnknownPolicyError",
]


class TieredKVError(Exception):
    """Base class of every error raised on purpose by tieredkv."""


class SessionNotFoundError(TieredKVError, KeyError):
    """The session has no KV that may be served: never appended, dropped, lost to eviction,
    or (``reason`` says which) stored but found damaged, or not provably current.

    :param reason: why a stored history is not served (``None``: none is stored)
    """

    def __init__(self, session: str, reason: str | None = None) -> None:
        self.session = session
        self.reason = reason
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"session {shown!r} has no KV in any tier: append() a segment first, or "
            f"recompute its history if it was evicted"
            if reason is None
            else f"session {shown!r} is not served: {reason}; recompute its history (this "
            f"load counts as a miss)"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class HistoryLostError(SessionNotFoundError):
    """An append to a conversation whose history the cache lost since the caller last heard
    of it (its last copy evicted or found damaged, or lost by a shared tier): the turn
    extends a history that is gone, and was not stored. Raised once: recompute the
    conversation's whole history and append it (the next append starts the conversation
    afresh), or :meth:`~tieredkv.TieredKVCache.drop` it first.

    A load, prefetch or discover tells the caller the conversation's state, and a drop ends
    it: after a miss or a drop the next append starts afresh without this error, and after
    a load that served a history (another replica's, taken in since the loss) it extends
    that history. Only a loss after the last such call is raised here.
    """

    def __init__(self, session: str, reason: str) -> None:
        super().__init__(session, reason)
        shown = session if len(session) <= 80 else session[:77] + "..."
        self.args = (
            f"session {shown!r} lost its history ({reason}) since it was last loaded: this "
            f"turn, which extends it, was not stored; recompute the conversation's whole "
            f"history and append it (this error is raised once: the next append starts the "
            f"conversation afresh)",
        )


class HistoryLengthError(TieredKVError, RuntimeError):
    """An append's ``expected_tokens`` (the length of the history the turn extends, as the
    caller counts it) is not what this cache holds of the conversation: the turn was not
    stored, and what the cache holds is untouched.

    ``held`` 0 with ``expected`` above it: the history is not here (lost, before this cache
    was opened or since, dropped, or never stored; a shared tier refuses another replica's
    history not read here first, with :class:`HistoryConflictError`). ``held``
    above 0 with ``expected`` 0: the turn starts a conversation the cache already holds.
    Otherwise the two lengths differ: the caller and the cache disagree on the history.

    :param session: the conversation's key
    :param held: tokens of it this cache holds (0: none)
    :param expected: the caller's ``expected_tokens``
    """

    def __init__(self, session: str, *, held: int, expected: int) -> None:
        self.session = session
        self.held = held
        self.expected = expected
        if not held:
            fix = (
                "the history is not here: load it (a miss means it is gone), or recompute "
                "the whole history and append it with expected_tokens=0"
            )
        elif not expected:
            fix = (
                "the conversation is already stored: append only the tokens after its "
                f"{held}, or drop it first to store this history afresh"
            )
        else:
            fix = (
                "load the conversation to see the history it holds and append the tokens "
                "after it, or drop it and append the whole history with expected_tokens=0"
            )
        super().__init__(
            f"session {_shown(session)!r} holds {held} tokens in this cache, but this turn "
            f"extends a history of {expected} (expected_tokens={expected}): it was not "
            f"stored; {fix}"
        )


class CapacityError(TieredKVError, ValueError):
    """A segment (or a whole session) cannot fit in any tier, even with everything else evicted."""

    def __init__(self, what: str, nbytes: int, largest: int) -> None:
        self.nbytes = nbytes
        self.largest = largest
        super().__init__(
            f"{what} needs {nbytes:,} bytes but the largest tier holds {largest:,}: "
            f"give a tier more capacity or store smaller segments"
        )


class PinLimitError(TieredKVError, ValueError):
    """Pinning a conversation would take the pinned bytes past one of the cache's bounds:
    the bound on all pinned bytes (``max_pinned_bytes``; ``group`` is ``None``) or the
    bound on the pinned bytes of the pin's group (``max_pinned_bytes_per_group``;
    ``group`` names it). ``pinned`` is what that bound counted already, ``nbytes`` what
    the pin would add."""

    def __init__(
        self, session: str, nbytes: int, pinned: int, bound: int, group: str | None = None
    ) -> None:
        self.session = session
        self.nbytes = nbytes
        self.pinned = pinned
        self.bound = bound
        self.group = group
        if group is None:
            super().__init__(
                f"pinning {session!r} ({nbytes:,} bytes) would pin {pinned + nbytes:,} "
                f"bytes, past the bound of {bound:,} (max_pinned_bytes): release a pin, "
                f"give it a ttl, or raise the bound"
            )
        else:
            super().__init__(
                f"pinning {session!r} ({nbytes:,} bytes) would pin {pinned + nbytes:,} "
                f"bytes of group {group!r}, past its bound of {bound:,} "
                f"(max_pinned_bytes_per_group): release a pin of the group, give its pins "
                f"a ttl, or raise the bound"
            )


class SchemaMismatchError(TieredKVError, ValueError):
    """A segment's tensor names, dtypes or non-token shape differ from the session's earlier."""

    def __init__(self, session: str, detail: str) -> None:
        self.session = session
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"segment for session {shown!r} does not match its earlier segments: {detail}; "
            f"every turn must store the same tensor names and dtypes, with shapes that differ "
            f"only along the token dimension"
        )


class TierIOError(TieredKVError, OSError):
    """A tier failed to read, write or delete (disk full, I/O error, permissions).

    ``hint``, when given, follows the reason in the message: what to do about it.
    ``maybe_committed`` is true when the failed write may have been made all the same (a
    shared tier's commit whose reply was lost, and which the server could not be asked
    about since): the turn may be in the conversation's history, as a load tells.
    """

    def __init__(
        self,
        tier: str,
        action: str,
        cause: OSError | str,
        *,
        hint: str | None = None,
        maybe_committed: bool = False,
    ) -> None:
        self.tier = tier
        self.action = action
        self.hint = hint
        self.maybe_committed = maybe_committed
        errno = cause.errno if isinstance(cause, OSError) else None
        reason = cause.strerror or str(cause) if isinstance(cause, OSError) else cause
        advice = f"; {hint}" if hint else ""
        reason = reason.rstrip()
        if advice and reason.endswith("."):  # no "...server.; flush()"
            reason = reason[:-1]
        self.reason = reason
        """What went wrong, without ``hint``."""
        super().__init__(errno, f"tier {tier!r} could not {action}: {reason}{advice}")
        self.__cause__ = cause if isinstance(cause, OSError) else None

    def __str__(self) -> str:
        return str(self.args[1])


class CorruptSegmentError(TieredKVError, ValueError):
    """A stored segment failed its checksum or header check: never served, moved aside."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        self.detail = detail
        super().__init__(f"corrupt segment {where}: {detail}")


class UnknownFormatError(CorruptSegmentError):
    """A segment whose header checks but names a format version this tieredkv does not
    read (another version wrote it): not served, and, unlike damage, never moved aside."""

    def __init__(self, where: str, version: int) -> None:
        self.version = version
        super().__init__(
            where,
            f"written in format version {version}, which this tieredkv does not read (it "
            f"reads version 1): use the tieredkv that wrote it, or another directory",
        )


class ClosedError(TieredKVError, RuntimeError):
    """The cache or tier was used outside ``async with`` (not opened yet, or already closed),
    or (``during``) it closed while the call was under way: the close's ``close_timeout``
    passed first and it cancelled the call, which was undone as a cancelled call is (or, past
    its point of no return, completed: ``during`` says which)."""

    def __init__(self, what: str, *, during: str | None = None) -> None:
        if during is not None:
            super().__init__(f"{what} closed while this call was under way: {during}")
        else:
            super().__init__(
                f"{what} is not open: use it inside 'async with' (or call open() first)"
            )


class ForkedError(TieredKVError, RuntimeError):
    """The cache or tier was opened in another process, which forked this one: a child has
    none of its threads and must not write into what the parent goes on using."""

    def __init__(self, what: str, opened_in: int) -> None:
        self.opened_in = opened_in
        super().__init__(
            f"{what} was opened in process {opened_in}, and this process ({os.getpid()}) is "
            f"a child forked from it, which cannot use it (its worker threads, connections "
            f"and shared memory are the parent's): open a cache of its own in the child (on "
            f"its own SSD directory), or start workers with the 'spawn' or 'forkserver' "
            f"method, or fork before opening"
        )


class UnknownPolicyError(TieredKVError, KeyError):
    """A policy name that the registry does not know."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(known))}")

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidArgumentError(TieredKVError, ValueError):
    """An argument has a value the library cannot use (negative, out of range, empty)."""


class InvalidTypeError(TieredKVError, TypeError):
    """An argument has a type the library cannot use (a float where an int is needed, a
    tensor on a device without data)."""


class StaleWriterError(TieredKVError, RuntimeError):
    """A write into a shared tier was refused: another replica has taken the conversation over.

    The shared tier (see :mod:`tieredkv.backends.redis`) gives one writer per conversation at
    a time a fencing token; a replica whose token is older than the conversation's current
    one may not add segments to it, so its write is refused and nothing of it is stored.
    """

    def __init__(
        self, tier: str, session: str, token: int, current: int, *, damaged: bool = False
    ) -> None:
        self.tier = tier
        self.session = session
        self.token = token
        self.current = current
        self.damaged = damaged
        self.reason = (
            "another replica found its shared copy damaged (a value changed or missing) and "
            "took it out of service"
            if damaged
            else "another replica took it over"
        )
        """Why, in a few words (no advice)."""
        advice = (
            "load the conversation again (a miss: recompute its history) and check the "
            "server (tieredkv fsck)"
            if damaged
            else "load the conversation again to take it back, or leave it to the replica "
            "that holds it"
        )
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"tier {tier!r} refused a write to session {shown!r}: this replica's fencing token "
            f"{token} is stale (the conversation's token is now {current}: {self.reason}); "
            f"{advice}"
        )


class LeaseHeldError(TieredKVError, RuntimeError):
    """A conversation's writer lease in a shared tier is held by another replica."""

    def __init__(self, tier: str, session: str, holder: str, expires_in: float) -> None:
        self.tier = tier
        self.session = session
        self.holder = holder
        self.expires_in = expires_in
        self.reason = f"replica {holder!r} is writing it"
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"tier {tier!r}: session {shown!r} is being written by replica {holder!r} (its "
            f"lease expires in {expires_in:.1f} s unless that replica renews it); load() the "
            f"conversation to take it over (its next commit waits for that lease), or leave "
            f"it to that replica"
        )


class RestoreFailedError(TieredKVError, RuntimeError):
    """Raised by :meth:`tieredkv.cache.LayerwiseLoad.wait` when the streamed restore
    failed: the bytes it waits for will never come. ``await load.finished()`` (or leaving
    the ``async with``) raises what went wrong."""

    def __init__(self, session: str) -> None:
        super().__init__(f"the streamed restore of session {session[:80]!r} failed")
        self.session = session


def _shown(session: str, width: int = 80) -> str:
    """A session key as messages show it: cut to ``width`` characters."""
    return session if len(session) <= width else session[: width - 3] + "..."


class HistoryConflictError(TieredKVError, RuntimeError):
    """A shared tier refused to extend a conversation: its history there is not the one
    this replica last read or wrote (another replica appended to it, it never loaded it, or
    the server lost it). Nothing of the refused segment is stored."""

    def __init__(
        self, tier: str, session: str, detail: str, *, shared_turns: int | None = None
    ) -> None:
        self.tier = tier
        self.session = session
        self.detail = detail
        self.reason = detail
        self.shared_turns = shared_turns
        """How many turns the shared history holds, where the tier said (``None``: not
        said): fewer than this replica committed means the server lost the others."""
        super().__init__(
            f"tier {tier!r} refused to extend session {_shown(session)!r}: {detail}; load the "
            f"conversation again (its current history is the shared one) before appending to it"
        )


class UnauthenticatedWriterError(TieredKVError, PermissionError):
    """A shared tier refused a write: the conversation is authenticated (its replicas use
    ``secret=``) and this replica has no secret. Nothing of the segment is stored."""

    def __init__(self, tier: str, session: str) -> None:
        self.tier = tier
        self.session = session
        self.reason = "the conversation is authenticated and this replica has no secret"
        """Why, in a few words (no advice)."""
        super().__init__(
            f"tier {tier!r} refused a write to session {_shown(session)!r}: {self.reason}; "
            f"give every replica of the prefix the same secret="
        )


class CommitDelayedError(TierIOError):
    """A shared tier cannot commit to a conversation yet: this replica took it over from one
    whose lease is still live (that replica may serve its copy until the lease ends, so
    nothing may be committed before), or, without a secret, the server has not known the
    prefix unauthenticated for long enough (see ``RedisTier``'s ``secret``). Transient: the
    same write is tried again after ``retry_in`` seconds.

    ``kept`` says whether the turn waits on this replica (a background commit: it is
    committed once that lease has ended) or was not stored at all (an append written
    straight to the shared tier, because no tier of this replica could hold it: append it
    again after ``retry_in`` seconds).
    """

    def __init__(
        self,
        tier: str,
        session: str,
        retry_in: float,
        *,
        kept: bool = True,
        why: str = "it was taken over from a replica whose lease is still live",
    ) -> None:
        self.session = session
        self.retry_in = retry_in
        self.kept = kept
        self.why = why
        then = (
            "the turn is kept on this replica and committed once that lease has ended"
            if kept
            else f"nothing of the turn was stored (no tier of this replica could hold the "
            f"conversation, so it went straight to {tier!r}): append it again in "
            f"{retry_in:.1f} s, or give the replica a larger host tier or an SSD tier"
        )
        super().__init__(
            tier,
            f"commit to session {_shown(session)!r} for another {retry_in:.1f} s",
            f"{why}; {then}",
        )


class TurnRefusedError(TieredKVError, RuntimeError):
    """Turns this replica had acknowledged were refused by a shared tier in the background
    (another replica took the conversation over, or its history changed, before they were
    committed). Raised once, by the next call on that conversation or by
    :meth:`~tieredkv.TieredKVCache.flush`; the turns are no longer in its history.

    :param refusals: ``(session, turns)`` per conversation, the refused turn indices in order
    """

    def __init__(self, tier: str, refusals: list[tuple[str, list[int]]], reason: str) -> None:
        self.tier = tier
        self.refusals = refusals
        self.reason = reason
        self.session = refusals[0][0]
        parts = []
        for session, turns in refusals[:3]:
            parts.append(f"session {_shown(session, 60)!r} turn(s) {', '.join(map(str, turns))}")
        more = f" and {len(refusals) - 3} more session(s)" if len(refusals) > 3 else ""
        super().__init__(
            f"tier {tier!r} refused {'; '.join(parts)}{more} ({reason}): they are not part of "
            f"the conversation's history any more; load it again and recompute those turns"
        )
