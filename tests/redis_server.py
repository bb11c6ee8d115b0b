"""A real ``redis-server`` for tests: started on a free port, stopped after; without
persistence, or with an append-only file fsynced at every write (``persistent=True``).

Locally, a machine without ``redis-server`` skips the tests that need it, with a message
saying how to install it; with ``CI=true`` in the environment a missing server fails them
(CI must never skip them silently).

Test modules import the fixtures they use from here (``from tests.redis_server import
redis_server``); :data:`current` is the session's server once the fixture has started it.

A :class:`~tieredkv.backends.redis.RedisTier` without a secret opens only on a server up
for its settling period (thrice ``liveness``: 9 s by default), so the fixtures hand out
servers started ahead of the tests that take them (:func:`start_spares`, called once the
session's tests are collected), already up that long where the tests took long enough.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import redis

__all__ = [
    "RedisServer",
    "current",
    "new_prefix",
    "own_aof_server",
    "own_redis_server",
    "redis_server",
    "require_redis_server",
    "start_spares",
    "stop_spares",
]

INSTALL_HINT = "install it with: apt-get install -y redis-server (or your OS's package)"

UP_FOR_FIRST_COMMITS = 4.0
"""Seconds a fixture's server has been up when a test gets it: a tier's default liveness (3
s), past which a conversation's first commit no longer waits, and a second for the server's
uptime being counted in whole seconds."""


def require_redis_server() -> str:
    """The path of ``redis-server``; skips the test (fails it under ``CI=true``) if absent."""
    path = shutil.which("redis-server")
    if path is None:
        message = f"redis-server is not on PATH; {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (``--save ''``; ``--appendonly no``, or
    ``yes`` with ``--appendfsync always`` when ``persistent``).

    :param extra: more ``--option value`` arguments (``--maxmemory``, ``--cluster-enabled``)
    :param persistent: keep an append-only file, so a restart comes back with every write
        the server acknowledged
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        persistent: bool = False,
    ):
        self.binary = require_redis_server()
        self.directory = directory
        self.port = port or _free_port()
        self.extra = extra
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING (a fresh port if taken)."""
        for _attempt in range(5):
            log = self.directory / f"redis-{self.port}.log"
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "yes" if self.persistent else "no",
                    "--appendfsync",
                    "always",
                    "--appenddirname",
                    f"aof-{self.port}",
                    "--dir",
                    str(self.directory),
                    "--logfile",
                    str(log),
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
            self.port = _free_port()
        raise RuntimeError(f"redis-server did not start; see the logs in {self.directory}")

    def _wait_ready(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.AuthenticationError:
                    return True  # it answers (and wants a password)
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def wait_up(self, seconds: float = UP_FOR_FIRST_COMMITS) -> None:
        """Wait until the server has been up ``seconds`` (by its own uptime, in whole
        seconds): on a server up for less than a tier's liveness period, a conversation's
        first commit waits (after an empty restart, another replica may still be serving
        its own copy)."""
        with self.client() as client:
            up = client.info("server")["uptime_in_seconds"]
        if up < seconds:
            time.sleep(seconds - up)

    def client(self) -> redis.Redis:
        """A synchronous client, for tests to inspect or damage what a tier stored."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not running"
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server (its data is gone unless it is ``persistent``)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped process dies only once resumed)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections and answers nothing until
        :meth:`resume`, then runs what it received meanwhile."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self, *, empty: bool | None = None) -> None:
        """Kill the server and start it again on the same port: empty, or (``persistent``
        and not ``empty``) from its append-only file."""
        self.kill()
        if empty or (empty is None and not self.persistent):
            shutil.rmtree(self.directory / f"aof-{self.port}", ignore_errors=True)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


current: RedisServer | None = None
"""The session's shared server, once :func:`redis_server` has started it."""


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the whole test session (tests keep apart by key prefix): one per
    test module that imports this fixture, in fact (pytest keeps a fixture per module
    that defines it)."""
    global current
    require_redis_server()
    with tempfile.TemporaryDirectory(prefix="tieredkv-redis-") as d:
        server = _spares.take(False) if _spares is not None else None
        if server is None:
            server = RedisServer(Path(d))
            server.start()
        server.wait_up()
        current = server
        try:
            yield server
        finally:
            current = None
            server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, which the test may kill or restart."""
    yield from _own(tmp_path, persistent=False)


@pytest.fixture
def own_aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own with an append-only file (fsync at every write): a
    restart brings back every write it acknowledged."""
    yield from _own(tmp_path, persistent=True)


def _own(directory: Path, *, persistent: bool) -> Iterator[RedisServer]:
    server = _spares.take(persistent) if _spares is not None else None
    if server is None:
        server = RedisServer(directory, persistent=persistent)
        server.start()
    server.wait_up()
    try:
        yield server
    finally:
        server.stop()


SPARES = 6
"""How many servers of a kind run ahead of the tests that take them: a test takes the
oldest, started six server-taking tests before (about the settling period, at a second or
two a test)."""


class _Spares:
    """Servers started before the tests that take them, per kind (persistent or not), no
    more than the session's remaining tests of that kind take, stopped at its end."""

    def __init__(self, wanted: dict[bool, int]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="tieredkv-redis-"))
        self.wanted = dict(wanted)  # servers still to be taken, per kind
        self.ready: dict[bool, deque[RedisServer]] = {kind: deque() for kind in wanted}
        for kind in wanted:
            self._fill(kind)

    def _fill(self, persistent: bool) -> None:
        ready = self.ready[persistent]
        while len(ready) < min(SPARES, self.wanted[persistent]):
            server = RedisServer(self.directory, persistent=persistent)
            server.start()
            ready.append(server)

    def take(self, persistent: bool) -> RedisServer | None:
        """The oldest spare of the kind (and another started behind it), or None if the
        collected tests did not ask for one (a new server, then)."""
        ready = self.ready.get(persistent)
        if not ready:
            return None
        server = ready.popleft()
        self.wanted[persistent] -= 1
        self._fill(persistent)
        return server

    def stop(self) -> None:
        for ready in self.ready.values():
            while ready:
                ready.popleft().stop()
        shutil.rmtree(self.directory, ignore_errors=True)


_spares: _Spares | None = None


def start_spares(items: Iterable[pytest.Item]) -> None:
    """Start the spare servers the collected ``items`` will take (through the fixtures
    here), if ``redis-server`` is installed (without it they skip or fail as before)."""
    global _spares
    if _spares is not None or shutil.which("redis-server") is None:
        return
    names: list[set[str]] = []
    sessions: set[object] = set()  # the modules that import the session fixture: one server each
    for item in items:
        names.append(set(getattr(item, "fixturenames", ())))
        module = getattr(item, "module", None)
        if getattr(module, "redis_server", None) is redis_server:
            sessions.add(module)
    wanted = {
        False: sum("own_redis_server" in n for n in names) + len(sessions),
        True: sum("own_aof_server" in n for n in names),
    }
    if any(wanted.values()):
        _spares = _Spares(wanted)


def stop_spares() -> None:
    """Stop the spare servers no test took."""
    global _spares
    if _spares is not None:
        _spares.stop()
        _spares = None


def new_prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"
