"""A real ``redis-server`` for tests: started on a free port, stopped after; without
persistence, or with an append-only file fsynced at every write (``persistent=True``).

Locally, a machine without ``redis-server`` skips the tests that need it, with a message
saying how to install it; with ``CI=true`` in the environment a missing server fails them
(CI must never skip them silently).

Test modules import the fixtures they use from here (``from tests.redis_server import
redis_server``); :data:`current` is the session's server once the fixture has started it.
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
from collections.abc import Iterator
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
]

INSTALL_HINT = "install it with: apt-get install -y redis-server (or your OS's package)"


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
    """One server for the whole test session (tests keep apart by key prefix)."""
    global current
    require_redis_server()
    with tempfile.TemporaryDirectory(prefix="tieredkv-redis-") as d:
        server = RedisServer(Path(d))
        server.start()
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
    server = RedisServer(directory, persistent=persistent)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def new_prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"
