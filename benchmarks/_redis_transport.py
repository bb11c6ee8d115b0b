"""What asyncio's socket transport costs a pipelined ``SET`` of large values: the same
packed commands (redis-py's ``pack_commands``: the values stay the caller's memoryviews)
sent two ways on one local ``redis-server``:

- ``pipeline``: redis-py's pipeline, whose ``send_packed_command`` hands them to the
  stream writer's ``writelines``; on Python 3.11 that joins them into one ``bytes`` (a
  copy of every value), ``write`` then slices off what the first ``send`` took (another)
  and appends the rest to its buffer (a third);
- ``write per piece``: each piece through the stream writer's ``write`` (a slice of a
  memoryview is a view; only what the socket does not take at once is buffered), then the
  replies read as the pipeline reads them.

A diagnostic for where a Redis append's client time goes, not a way the tier sends: the
second way uses the connection's stream writer, which redis-py keeps private. Each round
stores ``--segments`` segments of 8 MiB as 4 MiB values, the two ways alternating which
goes first; every value is read back and compared. Prints wall time and this process's
CPU time (user + system), medians::

    .venv/bin/python benchmarks/_redis_transport.py [--segments 8] [--reps 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio
import redis.asyncio as aioredis

from bench_redis import local_server

VALUE = 4 << 20
SEGMENT = 8 << 20


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(url: str, segments: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    client = aioredis.Redis.from_url(url)
    data = [memoryview(os.urandom(SEGMENT)) for _ in range(segments)]
    names = [[f"t:{s}:{i}" for i in range(SEGMENT // VALUE)] for s in range(segments)]

    def values(s: int) -> list[tuple[str, memoryview]]:
        return [(n, data[s][i * VALUE : (i + 1) * VALUE]) for i, n in enumerate(names[s])]

    async def pipeline() -> None:
        for s in range(segments):
            async with client.pipeline(transaction=False) as pipe:
                for name, value in values(s):
                    pipe.set(name, value)
                await pipe.execute()

    async def per_piece() -> None:
        pool = client.connection_pool
        for s in range(segments):
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
            try:
                writer = conn._writer  # private: a diagnostic only
                assert writer is not None
                for piece in conn.pack_commands([("SET", n, v) for n, v in values(s)]):
                    writer.write(piece)
                await writer.drain()
                for _ in names[s]:
                    if await conn.read_response() not in (b"OK", "OK"):
                        raise AssertionError("a SET was refused")
            except BaseException:
                await conn.disconnect(nowait=True)  # (a half-sent command: never reused)
                raise
            finally:
                await pool.release(conn)

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "pipeline (writelines)": pipeline,
        "write per piece": per_piece,
    }
    took: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    try:
        for rep in range(reps + 1):  # the first round warms up and is not counted
            order = list(ways) if rep % 2 else list(reversed(ways))
            for way in order:
                await client.flushall()
                t, c = time.perf_counter(), cpu()
                await ways[way]()
                wall, spent = time.perf_counter() - t, cpu() - c
                for s in range(segments):
                    for name, value in values(s):
                        if await client.get(name) != bytes(value):
                            raise AssertionError(f"{way}: {name} holds other bytes")
                if rep:
                    took[way].append((wall, spent))
    finally:
        await client.aclose()
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args(argv)
    with local_server() as url:
        took = anyio.run(measure, url, args.segments, args.reps)
    mib = args.segments * SEGMENT >> 20
    print(f"{mib} MiB as {args.segments} segments of 4 MiB values; medians of {args.reps}")
    for way, runs in took.items():
        wall = statistics.median(w for w, _ in runs) * 1e3
        spent = statistics.median(c for _, c in runs) * 1e3
        print(f"  {way:24s} {wall:7.1f} ms wall  {spent:7.1f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
