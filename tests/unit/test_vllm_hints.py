"""Retention hints through the vLLM connector, below the engine: the keys a request's
``kv_transfer_params`` may carry, their checks (a bad value is ignored with a line naming
the key, the request still served), and a hint's way from the scheduler side's plan to
the conversation a real worker stores."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tieredkv.errors import InvalidArgumentError
from tieredkv.integrations.vllm.config import parse_config
from tieredkv.integrations.vllm.hints import (
    CLIENT_HINTS,
    HINT_KEYS,
    MAX_PROBLEMS,
    parse_hint,
    pin_group,
    read_hint,
    tenant_of,
)
from tieredkv.integrations.vllm.keys import fingerprint
from tieredkv.integrations.vllm.ops import SaveOp
from tieredkv.integrations.vllm.scheduler import SchedulerSide
from tieredkv.integrations.vllm.worker import WorkerStore
from tieredkv.meta import RetentionHint

BS = 4
FP = fingerprint(
    model="m", identity="id:m", dtype="float32", kv_dtype="auto", block_size=BS, layout="L"
)


def test_every_key_sets_its_field() -> None:
    hint, problems = parse_hint(
        {
            "tieredkv_next_turn_in": 30,
            "tieredkv_pin": True,
            "tieredkv_ttl": 600.5,
            "tieredkv_priority": -2,
            "tieredkv_tool_call": True,
            "do_remote_prefill": True,  # another connector's key: left alone
        }
    )
    assert problems == []
    assert hint == RetentionHint(
        next_turn_in=30.0, pin=True, ttl=600.5, priority=-2, tool_call=True
    )
    assert set(HINT_KEYS) == {
        "tieredkv_next_turn_in",
        "tieredkv_pin",
        "tieredkv_ttl",
        "tieredkv_priority",
        "tieredkv_tool_call",
    }
    assert parse_hint({"tieredkv_pin": False}) == (RetentionHint(pin=False), [])
    assert parse_hint(None) == (None, [])
    assert parse_hint({"other": 1}) == (None, [])


@pytest.mark.parametrize(
    ("params", "kept", "named", "says"),
    [
        ({"tieredkv_pin": "yes"}, None, "tieredkv_pin", "true or false"),
        ({"tieredkv_pin": 1}, None, "tieredkv_pin", "true or false"),
        ({"tieredkv_next_turn_in": -1}, None, "tieredkv_next_turn_in", ">= 0"),
        ({"tieredkv_next_turn_in": "5s"}, None, "tieredkv_next_turn_in", "seconds"),
        ({"tieredkv_next_turn_in": math.inf}, None, "tieredkv_next_turn_in", "finite"),
        ({"tieredkv_ttl": 0, "tieredkv_pin": True}, RetentionHint(pin=True), "tieredkv_ttl", "> 0"),
        ({"tieredkv_ttl": 60}, None, "tieredkv_ttl", "'tieredkv_pin': true"),
        ({"tieredkv_priority": 1.5}, None, "tieredkv_priority", "integer"),
        ({"tieredkv_priority": True}, None, "tieredkv_priority", "integer"),
        ({"tieredkv_tool_call": "true"}, None, "tieredkv_tool_call", "true or false"),
        (
            {"tieredkv_pinn": True, "tieredkv_priority": 2},
            RetentionHint(priority=2),
            "tieredkv_pinn",
            "tieredkv_pin, tieredkv_ttl",
        ),
    ],
)
def test_a_bad_value_is_ignored_with_a_line_naming_the_key(
    params: dict[str, Any], kept: RetentionHint | None, named: str, says: str
) -> None:
    hint, problems = parse_hint(params)
    assert hint == kept
    [problem] = problems
    assert repr(named) in problem
    assert says in problem
    assert problem.endswith("(ignored)")


def test_read_hint_logs_each_ignored_key_with_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.vllm.hints"):
        hint, echo = read_hint({"tieredkv_pin": "yes", "tieredkv_priority": 1}, "req-7")
    assert hint == RetentionHint(priority=1)
    [record] = caplog.records
    assert "req-7" in record.getMessage()
    assert "'tieredkv_pin'" in record.getMessage()
    # the response tells the client what was read and what was ignored
    assert echo == {
        "tieredkv_hint": {"priority": 1},
        "tieredkv_ignored": [
            "kv_transfer_params key 'tieredkv_pin' takes true or false, not 'yes' (ignored)"
        ],
    }
    assert read_hint({"tieredkv_pin": True, "tieredkv_ttl": 5}, "r") == (
        RetentionHint(pin=True, ttl=5.0),
        {"tieredkv_hint": {"pin": True, "ttl": 5.0}},
    )
    assert read_hint({"do_remote_prefill": True}, "r") == (None, None)  # not ours
    assert read_hint(["tieredkv_pin"], "req-8") == (  # type: ignore[arg-type]
        None,
        {
            "tieredkv_ignored": [
                "kv_transfer_params must be an object of keys, not ['tieredkv_pin'] (ignored)"
            ]
        },
    )


def test_what_a_client_sent_is_quoted_short_and_its_lines_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request's ignored keys cannot flood the server's log or the response: a long key
    or value is quoted shortened, and past MAX_PROBLEMS lines the rest are counted in one.
    Before, a 7 MB request wrote 5 MB of warnings, and 20,000 unknown keys 20,000 lines."""
    huge = {"tieredkv_pin": "x" * (1 << 20), "tieredkv_" + "k" * (1 << 20): 1}
    with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.vllm.hints"):
        hint, echo = read_hint(huge, "req-9")
    assert hint is None
    assert echo is not None
    assert len(echo["tieredkv_ignored"]) == 2
    assert all(len(line) < 400 for line in echo["tieredkv_ignored"])
    assert sum(len(r.getMessage()) for r in caplog.records) < 1000
    caplog.clear()
    many = {f"tieredkv_x{i}": 0 for i in range(20_000)}
    with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.vllm.hints"):
        _, echo = read_hint(many, "req-10")
    assert echo is not None
    assert len(caplog.records) == len(echo["tieredkv_ignored"]) == MAX_PROBLEMS + 1
    assert echo["tieredkv_ignored"][-1] == (
        f"... and {20_000 - MAX_PROBLEMS} more kv_transfer_params line(s) (ignored)"
    )
    _, problems = parse_hint(["x" * (1 << 20)])  # type: ignore[arg-type]
    assert len(problems[0]) < 200


def test_a_server_takes_only_the_hints_its_operator_allows() -> None:
    """``client_hints`` leaves pins (and their ttl) out: each such key is ignored with a
    line saying the server does not take it, and the rest of the hint applies."""
    allowed = ("next_turn_in", "tool_call")
    hint, problems = parse_hint(
        {
            "tieredkv_pin": True,
            "tieredkv_ttl": 60,
            "tieredkv_priority": 9,
            "tieredkv_next_turn_in": 5,
        },
        allowed=allowed,
    )
    assert hint == RetentionHint(next_turn_in=5.0)
    assert problems == [
        f"kv_transfer_params key {key!r} is not taken from clients on this server (its "
        f"operator allows tieredkv_next_turn_in, tieredkv_tool_call) (ignored)"
        for key in ("tieredkv_pin", "tieredkv_ttl", "tieredkv_priority")
    ]
    # a release is a pin key too; with none allowed, every key is ignored
    assert parse_hint({"tieredkv_pin": False}, allowed=()) == (
        None,
        [
            "kv_transfer_params key 'tieredkv_pin' is not taken from clients on this server "
            "(its operator allows none) (ignored)"
        ],
    )
    assert parse_hint({"tieredkv_pin": True}, allowed=CLIENT_HINTS) == (
        RetentionHint(pin=True),
        [],
    )


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"tieredkv_pin": True}, RetentionHint(pin=True, ttl=600.0)),  # no ttl: the cap
        ({"tieredkv_pin": True, "tieredkv_ttl": 3600}, RetentionHint(pin=True, ttl=600.0)),
        ({"tieredkv_pin": True, "tieredkv_ttl": 30}, RetentionHint(pin=True, ttl=30.0)),
        ({"tieredkv_pin": False}, RetentionHint(pin=False)),  # a release has no lifetime
        ({"tieredkv_priority": 1}, RetentionHint(priority=1)),
    ],
)
def test_a_clients_pin_lasts_at_most_max_pin_ttl(
    params: dict[str, Any], want: RetentionHint
) -> None:
    assert parse_hint(params, max_ttl=600.0) == (want, [])
    hint, echo = read_hint(params, "r", max_ttl=600.0)
    assert hint == want
    assert echo is not None
    # the response says the ttl that applies
    assert echo["tieredkv_hint"].get("ttl") == want.ttl


def test_the_operators_retention_keys_are_checked() -> None:
    cfg = parse_config({})
    assert (cfg.client_hints, cfg.max_pin_ttl, cfg.max_pinned_bytes) == (
        CLIENT_HINTS,
        None,
        None,
    )
    assert cfg.max_pinned_bytes_per_tenant is None
    assert parse_config({"max_pinned_bytes_per_tenant": 0}).max_pinned_bytes_per_tenant == 0
    cfg = parse_config(
        {"client_hints": ["next_turn_in"], "max_pin_ttl": 600, "max_pinned_bytes": 0}
    )
    assert (cfg.client_hints, cfg.max_pin_ttl, cfg.max_pinned_bytes) == (
        ("next_turn_in",),
        600.0,
        0,
    )
    assert parse_config({"client_hints": []}).client_hints == ()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"client_hints": "pin"}, "must be a list of hint names"),
        ({"client_hints": [1]}, "must be a list of hint names"),
        ({"client_hints": ["ttl"]}, "'ttl' goes with 'pin'"),
        ({"client_hints": ["pinned"]}, "'pinned', which is not a retention hint"),
        ({"client_hints": ["pin", "pin"]}, "names a hint twice"),
        ({"max_pin_ttl": 0}, "'max_pin_ttl'] must be a finite number of seconds > 0"),
        ({"max_pin_ttl": math.inf}, "finite number"),
        ({"max_pin_ttl": True}, "finite number"),
        ({"max_pin_ttl": "600"}, "finite number"),
        ({"max_pin_ttl": 10**400}, "finite number"),  # past the largest float
        ({"redis_timeout": -(10**400)}, "'redis_timeout'] must be a finite number"),
        ({"max_pinned_bytes": -1}, "'max_pinned_bytes'] must be an integer >= 0"),
        ({"max_pinned_bytes": 1.5}, "'max_pinned_bytes'] must be an integer >= 0"),
        (
            {"max_pinned_bytes_per_tenant": -1},
            "'max_pinned_bytes_per_tenant'] must be an integer >= 0",
        ),
    ]
    for extra, says in bad:
        with pytest.raises(InvalidArgumentError, match=re.escape(says)):
            parse_config(extra)


def _worker(tmp_path: Path, **extra: object) -> WorkerStore:
    cfg = parse_config({"ssd_path": str(tmp_path), "host_bytes": 1 << 20, **extra})
    store = WorkerStore(cfg, FP, BS)
    g = torch.Generator().manual_seed(0)
    layers = {f"layer.{i}": torch.randn(16, 1, BS, 8, generator=g) for i in range(2)}
    store.open(layers)
    return store


def _stored(store: WorkerStore, save: SaveOp) -> list[tuple[SaveOp, bool]]:
    """Have ``store`` store ``save``; the finished saves it reports (that one, stored)."""
    store.save(save)
    store.wait_idle()
    saves = store.finished_saves()
    assert [(done.req_id, ok) for done, ok in saves] == [(save.req_id, True)]
    return saves


def test_a_hint_rides_with_the_save_to_the_stored_conversation(tmp_path: Path) -> None:
    """The scheduler side plans the request's hint with its save; the worker stores the
    turn and applies it: the conversation's metadata carries the pin, the priority and
    the expected next turn, and the scheduler side's mirror hears of them."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS)
    store = _worker(tmp_path)
    try:
        hint = RetentionHint(pin=True, priority=3, next_turn_in=120.0)
        turn = list(range(1, 14))
        assert side.finished("r1", turn, [1, 2, 3, 4], 12, 1, hint=hint)
        [save] = side.plan().saves
        assert save.hint == hint
        saves = _stored(store, save)
        meta = store.cache.channel[save.session]
        assert (meta.pinned_until, meta.priority) == (math.inf, 3)
        assert meta.next_turn is not None
        assert meta.next_turn > meta.last_access + 100
        side.update(store.report([], saves), set())
        mirrored = side.channel.get(save.session)
        assert mirrored is not None
        assert (mirrored.pinned_until, mirrored.priority) == (math.inf, 3)
        # a request that stores nothing new (the same turn again) hints the stored
        # conversation its prompt continues whole: here it releases the pin
        release = RetentionHint(pin=False)
        assert side.drained()
        assert not side.finished("r2", turn, [5, 6, 7, 8], 12, 1, hint=release)
        # no request is left, but the hint is not sent yet: vLLM must keep stepping (the
        # connector's has_pending_push_work asks unsent()), and the side is not drained
        assert side.unsent()
        assert not side.drained()
        assert side.busy()["unsent_hints"] == 1
        plan = side.plan()
        assert not side.unsent()
        assert side.drained()
        assert (plan.saves, plan.hints) == ([], [("r2", save.session, release, "")])
        store.hint("r2", save.session, release)
        assert store.cache.channel[save.session].pinned_until is None
        side.update(store.report([], []), set())
        mirrored = side.channel.get(save.session)
        assert mirrored is not None
        assert mirrored.pinned_until is None
        # a request that continues no stored conversation whole hints nothing
        assert not side.finished("r3", [9] * 3, [1], 2, 1, hint=release)
        assert side.plan().hints == []
    finally:
        store.close()


def test_a_pin_past_the_bound_is_refused_and_the_turn_and_the_rest_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pinned bytes are bounded per worker cache: a request whose pin would pass the
    bound still has its turn stored and the rest of its hint applied, and the refusal is
    logged with what to do."""
    side = SchedulerSide(parse_config({"ssd_path": str(tmp_path)}), FP, BS)
    store = _worker(tmp_path, max_pinned_bytes=1)  # the operator's bound: nothing fits
    assert store.cache.max_pinned_bytes == 1
    try:
        hint = RetentionHint(pin=True, ttl=60.0, priority=-1)
        assert side.finished("r1", list(range(1, 14)), [1, 2, 3, 4], 12, 1, hint=hint)
        [save] = side.plan().saves
        with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.hints"):
            store.save(save)
            store.wait_idle()
        assert [ok for _, ok in store.finished_saves()] == [True]
        meta = store.cache.channel[save.session]
        assert (meta.tokens, meta.pinned_until, meta.priority) == (12, None, -1)
        assert store.counters["pins_refused"] == 1
        [record] = caplog.records
        assert "request r1: pin refused, the rest applied" in record.getMessage()
        assert "max_pinned_bytes" in record.getMessage()
    finally:
        store.close()


def test_a_tenant_is_its_cache_salt_as_a_digest() -> None:
    assert tenant_of(None) == tenant_of("") == ""
    a, b = tenant_of("tenant-a"), tenant_of("tenant-b")
    assert a != b
    assert a == tenant_of("tenant-a")
    assert "tenant-a" not in a  # logs carry the digest, never the salt
    assert tenant_of("\ud800") != ""  # a lone surrogate from JSON does not fail a request
    # each tenant's pins count in a pin group of its own, those without a salt too
    assert len({pin_group(""), pin_group(a), pin_group(b)}) == 3
    # the group is the server's to set: a client cannot name one
    hint, [problem] = parse_hint({"tieredkv_pin": True, "tieredkv_group": pin_group(b)})
    assert (hint, "'tieredkv_group' is not a tieredkv hint" in problem) == (
        RetentionHint(pin=True),
        True,
    )


def test_each_tenant_pins_within_its_own_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``max_pinned_bytes_per_tenant``, a request's pin counts against its tenant (its
    ``cache_salt``), the cache's pin group of the tenant: a pin past the tenant's bound is
    refused with a warning, the turn and the rest of the hint kept; another tenant pins
    within its own; a release makes room; and a pinned conversation that grows past its
    tenant's bound loses its pin."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS)
    probe = _worker(tmp_path / "probe")
    try:  # one 12-token conversation's bytes, to size the bound: one fits, two do not
        assert side.finished("p", list(range(1, 14)), [1, 2, 3, 4], 12, 1)
        [save] = side.plan().saves
        _stored(probe, save)
        one = probe.cache.channel[save.session].nbytes
    finally:
        probe.close()
    side = SchedulerSide(cfg, FP, BS)
    store = _worker(tmp_path / "kv", max_pinned_bytes_per_tenant=one + one // 2)
    assert store.cache.max_pinned_bytes_per_group == one + one // 2
    a, b = tenant_of("salt-a"), tenant_of("salt-b")
    pin = RetentionHint(pin=True, priority=2)

    def stored(req: str, first: int, tenant: str, hint: RetentionHint | None) -> str:
        tokens = list(range(first, first + 13))
        assert side.finished(req, tokens, [1, 2, 3, 4], 12, 1, hint=hint, tenant=tenant)
        [save] = side.plan().saves
        assert save.tenant == tenant
        saves = _stored(store, save)
        side.update(store.report([], saves), set())  # the scheduler side's index learns it
        return save.session

    try:
        with caplog.at_level(logging.WARNING, logger="tieredkv"):
            a1 = stored("a1", 100, a, pin)
            a2 = stored("a2", 200, a, pin)  # tenant a's second pin: past its bound
            b1 = stored("b1", 300, b, pin)  # tenant b's own bound
        channel = store.cache.channel
        assert channel[a1].pinned_until == math.inf
        assert channel[a1].pin_group == pin_group(a) == f"tenant {a}"
        assert (channel[a2].pinned_until, channel[a2].priority) == (None, 2)  # the rest kept
        assert (channel[b1].pinned_until, channel[b1].pin_group) == (math.inf, pin_group(b))
        [record] = caplog.records
        assert "request a2: pin refused, the rest applied" in record.getMessage()
        assert f"group 'tenant {a}'" in record.getMessage()
        assert "max_pinned_bytes_per_group" in record.getMessage()
        assert "salt-a" not in record.getMessage()
        assert store.counters["pins_refused"] == 1
        # a release makes room: the same pin now holds (a hint of a stored conversation)
        store.hint("r-a1", a1, RetentionHint(pin=False), a)
        store.hint("r-a2", a2, RetentionHint(pin=True), a)
        assert channel[a1].pinned_until is None
        assert channel[a2].pinned_until == math.inf
        # a2 grows (its next turn, stored without a hint) past tenant a's bound: unpinned
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tieredkv"):
            tokens = [*range(200, 213), *range(500, 520)]
            assert side.finished("a2-next", tokens, list(range(1, 10)), 32, 1, tenant=a)
            [save] = side.plan().saves
            assert save.session == a2
            _stored(store, save)
        assert channel[a2].nbytes > one + one // 2
        assert channel[a2].pinned_until is None
        [record] = caplog.records
        assert "its pin is released" in record.getMessage()
        assert channel[b1].pinned_until == math.inf  # another tenant's pin stays
        # b1 grows with a turn whose hint is advice only: unpinned, the advice applied
        tokens = [*range(300, 313), *range(600, 620)]
        hint = RetentionHint(priority=5)
        assert side.finished("b1-next", tokens, list(range(1, 10)), 32, 1, hint=hint, tenant=b)
        [save] = side.plan().saves
        assert save.session == b1
        _stored(store, save)
        assert (channel[b1].pinned_until, channel[b1].priority) == (None, 5)
    finally:
        store.close()
