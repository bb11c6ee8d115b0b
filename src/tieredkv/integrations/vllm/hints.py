"""Retention hints in a vLLM request's ``kv_transfer_params``.

A client of ``vllm serve`` sends them in the request body
(``extra_body={"kv_transfer_params": {"tieredkv_pin": True, "tieredkv_ttl": 600}}`` with
the ``openai`` client); ``LLM``/``AsyncLLM`` callers put the same dict in
``SamplingParams(extra_args={"kv_transfer_params": {...}})``. The keys
(:data:`HINT_KEYS`) map one to one onto :class:`~tieredkv.meta.RetentionHint`'s fields,
but for a pin's ``group``, which is the server's to set: the request's tenant
(:func:`pin_group`).
They apply to the conversation the request's turn is stored in (or, when the request
stores nothing new, to the stored conversation its prompt continues whole).

A bad value never fails the request: the key is ignored, with a warning that names it and
says what it takes, and the request is served with the rest of its hint. The response's
``kv_transfer_params`` tell the client what applies (``tieredkv_hint``) and what was
ignored (``tieredkv_ignored``). Keys of other connectors (any not starting with
``tieredkv_``) are left alone.

The server's operator decides what clients may ask for (the connector's
``client_hints`` and ``max_pin_ttl``): a hint a server does not take from clients is
ignored the same way, and a pin lasts at most ``max_pin_ttl`` seconds, whatever its
``tieredkv_ttl`` (the ``tieredkv_hint`` echoed shows the ``ttl`` that applies).
"""

from __future__ import annotations

import logging
import math
import reprlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

import xxhash

from ...meta import RetentionHint

__all__ = [
    "CLIENT_HINTS",
    "HINT_KEYS",
    "PREFIX",
    "parse_hint",
    "pin_group",
    "read_hint",
    "tenant_of",
]

_log = logging.getLogger(__name__)

PREFIX = "tieredkv_"
"""Every key this connector reads from ``kv_transfer_params`` starts with it."""


def seconds_check(positive: bool) -> Callable[[Any], float]:
    """A check of a number of seconds (finite, > 0 if ``positive``, else >= 0): it returns
    the seconds as a float, and raises ``ValueError`` saying what it takes."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"takes a number of seconds, not {value!r}")
        try:
            seconds = float(value)
        except OverflowError:  # an int past the largest float
            seconds = math.inf
        if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"takes a finite number of seconds {bound}, not {value!r}")
        return seconds

    return check


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"takes true or false, not {value!r}")
    return value


def _priority(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"takes an integer (0 neutral, higher kept longer), not {value!r}")
    return value


HINT_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "tieredkv_next_turn_in": ("next_turn_in", seconds_check(positive=False)),
    "tieredkv_pin": ("pin", _flag),
    "tieredkv_ttl": ("ttl", seconds_check(positive=True)),
    "tieredkv_priority": ("priority", _priority),
    "tieredkv_tool_call": ("tool_call", _flag),
}
"""``kv_transfer_params`` key -> the :class:`~tieredkv.meta.RetentionHint` field it sets,
and its check: ``tieredkv_next_turn_in`` (seconds until the next turn is expected, >= 0),
``tieredkv_pin`` (true pins the conversation in its tier, false releases a pin),
``tieredkv_ttl`` (seconds a pin lasts, > 0, with ``tieredkv_pin: true``),
``tieredkv_priority`` (an integer, 0 neutral), ``tieredkv_tool_call`` (true: the answer
ended in a tool call)."""


MAX_PROBLEMS = 8
"""Lines a request's ignored keys give at most (logged, and returned to the client): the
rest are counted in one more line."""

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def _shown(value: Any) -> str:
    """``repr(value)``, shortened: what a client sent is quoted, never copied whole."""
    return _SHOW.repr(value)


def _clipped(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


CLIENT_HINTS = ("next_turn_in", "pin", "priority", "tool_call")
"""The hints a server may take from clients (the connector's ``client_hints`` lists those
it does; all by default): a pin's ``tieredkv_ttl`` goes with ``pin``."""


def parse_hint(
    params: Mapping[str, Any] | None,
    *,
    allowed: Collection[str] = CLIENT_HINTS,
    max_ttl: float | None = None,
) -> tuple[RetentionHint | None, list[str]]:
    """The retention hint in a request's ``kv_transfer_params``, and what was wrong with it.

    :param allowed: the hints this server takes from clients (names in
        :data:`CLIENT_HINTS`); a key for another is ignored, with a line saying so
    :param max_ttl: the longest a client's pin lasts, seconds (``None``: as long as the
        client asks); a pin with no ``tieredkv_ttl`` or a longer one gets this one
    :returns: the hint (``None`` if the request gives none that is valid) and one line per
        key that was ignored, naming it and saying what it takes
    """
    if not params:
        return None, []
    if not isinstance(params, Mapping):
        return None, [
            f"kv_transfer_params must be an object of keys, not {_shown(params)} (ignored)"
        ]
    fields: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in params.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue  # another connector's
        known = HINT_KEYS.get(key)
        if known is None:
            problems.append(
                f"kv_transfer_params key {_shown(key)} is not a tieredkv hint: the keys are "
                f"{', '.join(HINT_KEYS)} (ignored)"
            )
            continue
        field, check = known
        if ("pin" if field == "ttl" else field) not in allowed:
            problems.append(
                f"kv_transfer_params key {key!r} is not taken from clients on this server "
                f"(its operator allows {', '.join(PREFIX + f for f in allowed) or 'none'}) "
                f"(ignored)"
            )
            continue
        if value is None:
            continue
        try:
            fields[field] = check(value)
        except ValueError as exc:
            problems.append(f"kv_transfer_params key {key!r} {_clipped(str(exc))} (ignored)")
    if "ttl" in fields and fields.get("pin") is not True:
        del fields["ttl"]
        problems.append(
            "kv_transfer_params key 'tieredkv_ttl' is the lifetime of a pin: give it with "
            "'tieredkv_pin': true (ignored)"
        )
    if max_ttl is not None and fields.get("pin") is True:
        fields["ttl"] = min(fields.get("ttl", math.inf), max_ttl)
    if len(problems) > MAX_PROBLEMS:  # a client's request must not flood the server's log
        more = len(problems) - MAX_PROBLEMS
        problems[MAX_PROBLEMS:] = [f"... and {more} more kv_transfer_params line(s) (ignored)"]
    if not fields:
        return None, problems
    return RetentionHint(**fields), problems


def read_hint(
    params: Mapping[str, Any] | None,
    req_id: str,
    *,
    allowed: Collection[str] = CLIENT_HINTS,
    max_ttl: float | None = None,
) -> tuple[RetentionHint | None, dict[str, Any] | None]:
    """:func:`parse_hint`, with a warning per ignored key naming the request.

    :returns: the hint, and what to tell the client in the response's
        ``kv_transfer_params`` (``None`` if the request gave no ``tieredkv_`` key):
        ``tieredkv_hint``, the hint's fields as they apply (a pin's ``ttl`` capped at
        ``max_ttl``), and ``tieredkv_ignored``, a line per key ignored (at most
        :data:`MAX_PROBLEMS`, then one counting the rest)
    """
    hint, problems = parse_hint(params, allowed=allowed, max_ttl=max_ttl)
    for problem in problems:
        _log.warning("tieredkv: request %s: %s", req_id, problem)
    if hint is None and not problems:
        return None, None
    echo: dict[str, Any] = {}
    if hint is not None:
        echo["tieredkv_hint"] = {
            f: v for f in RetentionHint.__struct_fields__ if (v := getattr(hint, f)) is not None
        }
    if problems:
        echo["tieredkv_ignored"] = problems
    return hint, echo


def tenant_of(cache_salt: str | None) -> str:
    """A request's tenant for the per-tenant bound on pinned bytes
    (``max_pinned_bytes_per_tenant``; its pins' group is :func:`pin_group`): its
    ``cache_salt`` (vLLM's per-tenant isolation of prefix caches) as a digest, so that logs
    never carry the salt itself; ``""`` for the requests without one, which are one
    tenant."""
    if not cache_salt:
        return ""
    return xxhash.xxh3_64_hexdigest(cache_salt.encode("utf-8", "surrogatepass"))


def pin_group(tenant: str) -> str:
    """The cache's pin group (:attr:`~tieredkv.meta.RetentionHint.group`) of a tenant's
    pins (``tenant`` as :func:`tenant_of` gives it): ``"tenant <digest>"``, or
    ``"tenant (no cache_salt)"`` for the requests without a salt. Each worker's cache
    bounds a group's pinned bytes by the connector's ``max_pinned_bytes_per_tenant``."""
    return f"tenant {tenant or '(no cache_salt)'}"
