"""A replica process for the fleet tests: ``python -m tests.fleet_replica URL PREFIX OPTIONS``.

``OPTIONS`` is a JSON object: ``lease_ttl``, ``timeout``, ``mode`` (``"inclusive"``),
``host`` (bytes of its host tier; 0 for none), ``ssd`` (a directory: an SSD tier there,
below the host tier), ``ssd_bytes``, ``secret`` (hex), ``redis`` (more RedisTier
options), ``deadline`` (seconds: every command runs under ``anyio.fail_after``; a command
that overruns answers ``{"ok": false, "error": "TimeoutError"}``, one that cannot be
cancelled does not answer).
The process opens one cache (its tiers over a :class:`~tieredkv.backends.redis.RedisTier`
on ``URL`` and ``PREFIX``), answers ``{"ok": true}`` once open, then runs the commands it
reads from stdin, one JSON line each (``append`` session tag, and parent for a fork's
first turn; ``load`` session, ``flush``, ``contains`` session, ``discover`` session,
``drop`` session, ``stats``, ``where`` session, ``close``), answering each with one JSON
line on stdout (:func:`answer`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

from tests.fleet import TOKENS, tags, turn
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.base import Tier
from tieredkv.backends.redis import RedisTier


async def run_command(cache: TieredKVCache, command: dict[str, Any]) -> dict[str, Any]:
    """Run one command on ``cache``; its answer (what it raises, :func:`answer` answers)."""
    op = command["op"]
    if op == "append":
        tokens = command.get("tokens", TOKENS)
        tensors = turn(command["tag"], tokens)
        await cache.append(
            command["session"], tensors, answer_tokens=1, parent=command.get("parent")
        )
        return {"ok": True}
    if op == "load":
        history = await cache.load(command["session"])
        return {"ok": True, "turns": tags(history, command.get("tokens", TOKENS))}
    if op == "flush":
        await cache.flush()
        return {"ok": True}
    if op == "contains":
        return {"ok": True, "value": cache.contains(command["session"])}
    if op == "discover":
        return {"ok": True, "value": await cache.discover(command["session"])}
    if op == "drop":
        await cache.drop(command["session"])
        return {"ok": True}
    if op == "where":
        return {"ok": True, "value": cache.where(command["session"])}
    if op == "stats":
        st = cache.stats()
        return {"ok": True, "refused": st.refused, "unproven": st.unproven, "errors": st.errors}
    raise ValueError(f"unknown command {op!r}")


def failure(exc: Exception) -> dict[str, Any]:
    """A command's answer when it raised ``exc``."""
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)}


async def answer(cache: TieredKVCache, command: dict[str, Any]) -> dict[str, Any]:
    """Run one command on ``cache``: its answer, what it raised as :func:`failure` says
    (this process's answer to each line, and a test's to a replica in its own process)."""
    try:
        return await run_command(cache, command)
    except Exception as exc:
        return failure(exc)


def tiers(url: str, prefix: str, options: dict[str, Any]) -> list[Tier]:
    """A replica's tiers: host (unless ``host`` is 0), SSD (with ``ssd``), then Redis."""
    extra: dict[str, Any] = {}
    if options.get("secret"):  # (only when given: a tier without the option takes none)
        extra["secret"] = bytes.fromhex(options["secret"])
    shared = RedisTier(
        url,
        256 << 20,
        prefix=prefix,
        value_size=64 << 10,
        lease_ttl=options.get("lease_ttl", 30.0),
        timeout=options.get("timeout", 10.0),
        **options.get("redis", {}),
        **extra,
    )
    out: list[Tier] = []
    if options.get("host", 16 << 20):
        out.append(HostMemoryTier(options.get("host", 16 << 20)))
    if options.get("ssd"):
        out.append(SSDTier(options["ssd"], options.get("ssd_bytes", 64 << 20), fsync=False))
    return [*out, shared]


async def main(url: str, prefix: str, options: dict[str, Any]) -> None:
    out = anyio.wrap_file(sys.stdout)
    deadline = options.get("deadline", 3600.0)
    cache = TieredKVCache(tiers(url, prefix, options), mode=options.get("mode", "inclusive"))
    async with cache:
        await out.write(json.dumps({"ok": True}) + "\n")
        await out.flush()
        async for line in anyio.wrap_file(sys.stdin):
            command = json.loads(line)
            if command["op"] == "close":
                break
            try:
                with anyio.fail_after(deadline):
                    reply = await answer(cache, command)
            except TimeoutError as exc:
                reply = failure(exc)
            await out.write(json.dumps(reply) + "\n")
            await out.flush()
    await out.write(json.dumps({"ok": True}) + "\n")
    await out.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
