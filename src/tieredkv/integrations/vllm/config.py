"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key is checked where the connector is built (in the scheduler process and in each
worker alike) and, where vLLM asks the connector's class about the config before the
engine starts (``requires_piecewise_for_cudagraph``, on builds with CUDA graphs), already
there; a bad one fails with :class:`~tieredkv.errors.InvalidArgumentError` naming the key
and what to write instead; nothing is stored before that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from ...errors import InvalidArgumentError, UnknownPolicyError
from ...policies.registry import eviction_names, make_eviction, make_scheduler, scheduler_names
from .hints import CLIENT_HINTS, seconds_check

__all__ = ["ConnectorConfig", "parse_config"]


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kv_connector_extra_config`` may hold (every key is optional).

    :param host_bytes: bytes of host memory for the performance tier (default 1 GiB)
    :param ssd_path: directory of the SSD tier; ``None`` keeps KV in host memory only (and
        a restart starts empty)
    :param ssd_bytes: byte budget of the SSD tier (default 16 GiB)
    :param eviction: eviction policy of the host tier, a registry name (``"bidaw"``,
        ``"lru"``, ...)
    :param scheduler: the order of pending loads from the SSD tier: ``"bidaw"`` (disk-HRRN)
        or ``"fcfs"``
    :param max_loads: SSD loads in flight at once
    :param mode: ``"inclusive"`` (default: every turn is also written to the SSD tier in
        the background, so a restart, or a crash after the write, finds it; evicting from
        host memory then writes nothing) or ``"exclusive"`` (a history lives in one tier;
        what is in host memory at shutdown is gone)
    :param redis_url: a Redis/Valkey URL for a tier below the others, or ``None``
    :param redis_bytes: byte budget of the Redis tier (default 4 GiB)
    :param redis_timeout: the longest one call to the Redis server may take, seconds
        (default 10): a load that meets a stalled server waits about this long before its
        request is recomputed (once the heartbeat, every second, has seen the stall, loads
        from the server count as misses at once until it answers again); on a busy
        server, a second or two keeps a stall from holding requests up
    :param fsync: make SSD writes durable before they count as stored (default on)
    :param metrics_port: serve the worker's ``tieredkv.metrics`` on this port (0: off)
    :param layerwise: loads within a step land layer by layer: the forward pass computes
        layer ``i`` while layer ``i+1`` is copied or read (default on; off: the whole
        history is copied in before the forward pass starts)
    :param sync_load_bytes: a history below host memory of at most this many bytes loads
        within the step, layer by layer, rather than waiting in the load queue (0: never,
        the default; needs ``layerwise``)
    :param codec: what is stored: ``"kv"`` (vLLM's paged KV blocks, byte for byte; the
        only codec that can run inside vLLM, see the how-to)
    :param model_id: the model's identity as the operator pins it (a name that changes
        whenever the weights do); ``None`` (default): a digest of the model directory's
        weight and config files, computed at start, or a hub model's commit hash
    :param forks: a finished request that continues only part of a stored conversation
        (a shared system prompt, an edited message, a regenerated answer) is stored as a
        *fork* of it: only its own blocks are stored, the shared ones stay stored once
        (default on; off: it is stored whole, as a conversation of its own). With
        ``redis_url`` the fork is shared with the other replicas like any conversation
    :param client_hints: the retention hints this server takes from a request's
        ``kv_transfer_params`` (default: all, ``["next_turn_in", "pin", "priority",
        "tool_call"]``; a pin's ``ttl`` goes with ``"pin"``); a key for another is ignored
        with a warning and a line in the response. On a server shared by tenants who
        should not hold each other's memory, leave ``"pin"`` (and ``"priority"``) out
    :param max_pin_ttl: the longest a client's pin lasts, seconds; a pin with no ttl or a
        longer one gets this one (``None``, the default: as long as the client asks, up
        to a release)
    :param max_pinned_bytes: the bound on each worker's pinned bytes (``None``, the
        default: half its host tier); a pin past it is refused with a warning, the turn
        kept
    :param max_pinned_bytes_per_tenant: the bound on the pinned bytes of one tenant's
        conversations in each worker, within ``max_pinned_bytes`` (a tenant: the requests
        of one ``cache_salt``, those without one being one more); a pin past it is refused
        with a warning, the turn kept, and a pinned conversation that grows past it loses
        its pin (``None``, the default: no bound per tenant). Each worker's cache keeps it
        as its ``max_pinned_bytes_per_group``, a request's pins counting in its tenant's
        pin group (:func:`~tieredkv.integrations.vllm.hints.pin_group`)
    :param max_lost_records: the most conversations lost in each worker (evicted from its
        last tier) that its cache keeps a record of, about 480 bytes each (the cache's
        ``max_lost_records``; default 100,000: about 48 MB). The worker appends with
        ``expected_tokens``, so a conversation whose record went is refused a continuation
        all the same; ``None``: no bound
    """

    host_bytes: int = 1 << 30
    ssd_path: str | None = None
    ssd_bytes: int = 16 << 30
    eviction: str = "bidaw"
    scheduler: str = "bidaw"
    max_loads: int = 1
    mode: Literal["exclusive", "inclusive"] = "inclusive"
    redis_url: str | None = None
    redis_bytes: int = 4 << 30
    redis_timeout: float = 10.0
    fsync: bool = True
    metrics_port: int = 0
    layerwise: bool = True
    sync_load_bytes: int = 0
    codec: str = "kv"
    model_id: str | None = None
    forks: bool = True
    client_hints: tuple[str, ...] = CLIENT_HINTS
    max_pin_ttl: float | None = None
    max_pinned_bytes: int | None = None
    max_pinned_bytes_per_tenant: int | None = None
    max_lost_records: int | None = 100_000


_KEYS = tuple(ConnectorConfig.__struct_fields__)


def _positive_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"kv_connector_extra_config[{key!r}] must be an integer >= {minimum}, not {value!r}"
        )
    return value


def parse_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Check ``kv_connector_extra_config`` and return the settings.

    :raises InvalidArgumentError: for an unknown key, a value of the wrong type or range,
        or a policy name that is not registered (the message names the key)
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"kv_connector_extra_config has unknown key(s) {unknown}; the TieredKVConnector "
            f"takes {list(_KEYS)}"
        )
    for key in ("host_bytes", "ssd_bytes", "redis_bytes"):
        if key in extra:
            _positive_int(key, extra[key], 4096)
    if "max_loads" in extra:
        _positive_int("max_loads", extra["max_loads"], 1)
    if "metrics_port" in extra:
        port = _positive_int("metrics_port", extra["metrics_port"], 0)
        if port > 65535:
            raise InvalidArgumentError(
                f"kv_connector_extra_config['metrics_port'] must be 0..65535, not {port}"
            )
    for key in ("ssd_path", "redis_url", "model_id"):
        value = extra.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidArgumentError(
                f"kv_connector_extra_config[{key!r}] must be a non-empty string or null, "
                f"not {value!r}"
            )
    if extra.get("mode", "inclusive") not in ("exclusive", "inclusive"):
        raise InvalidArgumentError(
            "kv_connector_extra_config['mode'] must be 'exclusive' or 'inclusive', "
            f"not {extra['mode']!r}"
        )
    if "redis_timeout" in extra and not _seconds(extra["redis_timeout"]):
        raise InvalidArgumentError(
            "kv_connector_extra_config['redis_timeout'] must be a finite number of seconds "
            f"> 0, not {extra['redis_timeout']!r}"
        )
    if "sync_load_bytes" in extra:
        _positive_int("sync_load_bytes", extra["sync_load_bytes"], 0)
    for key in ("fsync", "layerwise", "forks"):
        if key in extra and not isinstance(extra[key], bool):
            raise InvalidArgumentError(
                f"kv_connector_extra_config[{key!r}] must be true or false, not {extra[key]!r}"
            )
    if extra.get("codec", "kv") != "kv":
        raise InvalidArgumentError(
            f"kv_connector_extra_config['codec'] must be 'kv', not {extra['codec']!r}: vLLM "
            "computes K/V inside its attention kernels, so the activation codec cannot "
            "rebuild them there (see docs/how-to/serve-with-vllm.md)"
        )
    _check_retention(extra)
    for key, names, make in (
        ("eviction", eviction_names, make_eviction),
        ("scheduler", scheduler_names, make_scheduler),
    ):
        value = extra.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgumentError(
                f"kv_connector_extra_config[{key!r}] must be a policy name, one of {names()}"
            )
        try:
            make(value)
        except UnknownPolicyError:
            raise InvalidArgumentError(
                f"kv_connector_extra_config[{key!r}] = {value!r} is not a known policy; "
                f"use one of {names()}"
            ) from None
    return msgspec.convert(extra, ConnectorConfig)


_POSITIVE_SECONDS = seconds_check(positive=True)


def _seconds(value: Any) -> bool:
    """Whether ``value`` is a finite number of seconds > 0 (the check of a request's
    ``tieredkv_ttl``)."""
    try:
        _POSITIVE_SECONDS(value)
    except ValueError:
        return False
    return True


def _check_retention(extra: Mapping[str, Any]) -> None:
    """Check ``client_hints``, ``max_pin_ttl`` and the bounds on pinned bytes."""
    if "client_hints" in extra:
        names = extra["client_hints"]
        if (
            isinstance(names, (str, bytes))
            or not isinstance(names, (list, tuple))
            or any(not isinstance(n, str) for n in names)
        ):
            raise InvalidArgumentError(
                f"kv_connector_extra_config['client_hints'] must be a list of hint names "
                f"(some of {list(CLIENT_HINTS)}), not {names!r}"
            )
        for name in names:
            if name == "ttl":
                raise InvalidArgumentError(
                    "kv_connector_extra_config['client_hints']: 'ttl' goes with 'pin' (a "
                    "pin's lifetime); list 'pin' to take both, and cap the lifetime with "
                    "max_pin_ttl"
                )
            if name not in CLIENT_HINTS:
                raise InvalidArgumentError(
                    f"kv_connector_extra_config['client_hints'] has {name!r}, which is not a "
                    f"retention hint; use some of {list(CLIENT_HINTS)}"
                )
        if len(set(names)) != len(names):
            raise InvalidArgumentError(
                f"kv_connector_extra_config['client_hints'] names a hint twice: {names!r}"
            )
    ttl = extra.get("max_pin_ttl")
    if ttl is not None and not _seconds(ttl):
        raise InvalidArgumentError(
            f"kv_connector_extra_config['max_pin_ttl'] must be a finite number of seconds "
            f"> 0, or null (no cap), not {ttl!r}"
        )
    for key in ("max_pinned_bytes", "max_pinned_bytes_per_tenant", "max_lost_records"):
        if extra.get(key) is not None:
            _positive_int(key, extra[key], 0)
