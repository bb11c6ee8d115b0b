"""The vLLM connector's parts without an engine: its config, its keys and index, the
scheduler side's plans, and the worker side moving real paged-KV blocks through real tiers.

The worker tests give :class:`WorkerStore` KV tensors laid out as vLLM's standardized
per-layer view (``[blocks, heads, block tokens, C]``) and check the exact bytes that come
back in other blocks, after a restart, and that a damaged segment is refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hinting import Clock
from tieredkv.errors import InvalidArgumentError
from tieredkv.integrations.vllm.config import ConnectorConfig, parse_config
from tieredkv.integrations.vllm.index import PrefixIndex, Sidecar, read_sidecars
from tieredkv.integrations.vllm.keys import block_hashes, fingerprint, session_key
from tieredkv.integrations.vllm.ops import LoadOp, WorkerReport
from tieredkv.integrations.vllm.scheduler import SAVE_WAIT, Phase, SchedulerSide
from tieredkv.integrations.vllm.worker import HOST, SSD, WorkerStore, decode_meta

BS = 4  # tokens per block
FP = fingerprint(
    model="m", identity="id:m", dtype="float32", kv_dtype="auto", block_size=BS, layout="L2"
)


# -- config -------------------------------------------------------------------------------
def test_config_defaults_and_values() -> None:
    assert parse_config(None) == ConnectorConfig()
    cfg = parse_config({"host_bytes": 1 << 20, "eviction": "lru", "scheduler": "fcfs"})
    assert (cfg.host_bytes, cfg.eviction, cfg.scheduler) == (1 << 20, "lru", "fcfs")
    assert (parse_config({}).redis_timeout, parse_config({"redis_timeout": 1}).redis_timeout) == (
        10.0,
        1.0,
    )


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"host_byte": 1}, "host_byte"),
        ({"host_bytes": "1G"}, "host_bytes"),
        ({"ssd_bytes": 0}, "ssd_bytes"),
        ({"eviction": "nope"}, "eviction"),
        ({"scheduler": "sjf"}, "scheduler"),
        ({"mode": "both"}, "mode"),
        ({"ssd_path": ""}, "ssd_path"),
        ({"codec": "activation"}, "codec"),
        ({"max_loads": 0}, "max_loads"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"fsync": "yes"}, "fsync"),
        ({"layerwise": 1}, "layerwise"),
        ({"sync_load_bytes": -1}, "sync_load_bytes"),
        ({"redis_timeout": 0}, "'redis_timeout'] must be a finite number of seconds > 0"),
        ({"redis_timeout": "1s"}, "redis_timeout"),
        ({"redis_timeout": float("nan")}, "redis_timeout"),
        ({"redis_timeout": True}, "redis_timeout"),
    ],
)
def test_bad_config_names_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        parse_config(extra)


def test_every_key_has_a_row_in_the_how_tos_table() -> None:
    """docs/how-to/serve-with-vllm.md, section 4, lists each key the connector takes."""
    how_to = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "serve-with-vllm.md"
    text = how_to.read_text()
    section = text[text.index("## 4. The keys of `kv_connector_extra_config`") :]
    section = section[: section.index("\n## ", 1)]
    rows = {
        key
        for line in section.splitlines()
        if line.startswith("| `")
        for key in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    assert set(ConnectorConfig.__struct_fields__) - rows == set()
    assert rows - set(ConnectorConfig.__struct_fields__) == set()


# -- keys and index -----------------------------------------------------------------------
def test_fingerprint_separates_model_dtype_block_size_and_layout() -> None:
    base: dict[str, Any] = {
        "model": "m",
        "identity": "id:m",
        "dtype": "float32",
        "kv_dtype": "auto",
        "block_size": 16,
        "layout": "L2",
    }
    variants: list[dict[str, Any]] = [
        {"model": "m2"},
        {"dtype": "bfloat16"},
        {"kv_dtype": "fp8"},
        {"block_size": 32},
        {"layout": "L3"},
        {"identity": "files:0123"},
    ]
    fps = {fingerprint(**{**base, **v}) for v in variants}
    fps.add(fingerprint(**base))
    assert len(fps) == len(variants) + 1
    tokens = list(range(16))
    assert block_hashes("a", tokens, 16) != block_hashes("b", tokens, 16)


def test_index_matches_the_longest_stored_prefix() -> None:
    index = PrefixIndex(FP, BS)
    a = list(range(12))  # 3 blocks
    index.put("A", index.hashes(a))
    assert index.match(index.hashes([*a, 50, 51, 52, 53])) == ("A", 3)
    assert index.match(index.hashes([*a[:8], 99, 98, 97, 96])) == ("A", 2)
    assert index.match(index.hashes([7, *a[1:]])) == (None, 0)
    assert len(index.hashes(a[:7])) == 1  # a partial block is left out
    b = [*a[:8], 1, 1, 1, 1]
    index.put("B", index.hashes(b))
    index.remove("A")
    assert index.match(index.hashes(a)) == ("B", 2)  # B shares A's first two blocks
    assert "A" not in index


# -- scheduler side -----------------------------------------------------------------------
def test_scheduler_side_plans_saves_and_loads(tmp_path: Path) -> None:
    cfg = parse_config({"ssd_path": str(tmp_path), "scheduler": "bidaw"})
    clock = Clock()
    side = SchedulerSide(cfg, FP, BS, clock=clock)
    prompt = list(range(10))
    assert side.match("r1", prompt, 0) == (0, False)
    # r1 finished with KV for 13 tokens (prompt + 3 answer tokens computed): 3 blocks
    tokens = [*prompt, 100, 101, 102, 103]
    assert side.finished("r1", tokens, [7, 8, 9, 10], 13, 4)
    save = side.plan().saves[0]
    assert (save.start, save.end, save.block_ids) == (0, 3, (7, 8, 9))
    assert side.saving()
    # until the worker reports it stored, a prompt that continues it waits (vLLM asks
    # again next step), for SAVE_WAIT seconds at most; others do not wait
    assert side.match("r2", [*tokens, 5, 5], 0) == (None, False)
    assert side.match("other", [9] * 14, 0) == (0, False)
    clock.now += SAVE_WAIT + 1
    assert side.match("r2", [*tokens, 5, 5], 0) == (0, False)
    side.update(WorkerReport(stored=[("r1", save.session, 3, True)]), set())
    assert not side.saving()
    # the next turn: 3 blocks match; the channel mirror says nothing about placement yet,
    # which means no load is needed from a lower tier: a sync load
    assert side.match("r2", [*tokens, 5, 5], 0) == (12, False)
    side.allocated("r2", [*tokens, 5, 5], [1, 2, 3, 4], 12)
    load = side.plan().loads[0]
    assert (load.session, load.first, load.blocks, load.sync) == (save.session, 0, 3, True)
    assert side.from_host.pop("r2") is True  # vLLM counts it as a host hit
    assert load.tokens == tuple(tokens[:12])
    # the worker says the history went to the SSD: the next match loads asynchronously
    from tieredkv.meta import KVMeta

    meta = KVMeta(session=save.session, tier=SSD, copies=(SSD,), nbytes=4096, tokens=12)
    import msgspec

    side.update(WorkerReport(metas={save.session: msgspec.msgpack.encode(meta)}), set())
    assert side.match("r3", [*tokens, 6, 6], 4) == (8, True)  # 1 block held locally
    side.allocated("r3", [*tokens, 6, 6], [1, 2, 3, 4], 8)
    load = side.plan().loads[0]  # max_loads=1 and nothing in flight: it starts at once
    assert (load.first, load.blocks, load.sync, load.block_ids) == (1, 3, False, (1, 2, 3))
    assert side.from_host["r3"] is False  # ... and this one as a disk hit
    # a failed load: the request never matches again (no livelock), the session is kept
    side.update(WorkerReport(loaded=[("r3", save.session, False)]), {"r3"})
    assert side.match("r3", [*tokens, 6, 6], 0) == (0, False)
    assert side.match("r4", [*tokens, 6, 6], 0) == (12, True)
    # a damaged history: the worker reports it gone and the index forgets it
    side.update(WorkerReport(gone={save.session}), set())
    assert side.match("r4", [*tokens, 6, 6], 0) == (0, False)


def test_scheduler_side_orders_pending_loads_with_its_policy(tmp_path: Path) -> None:
    """Bidaw's disk-HRRN starts the smaller of two waiting loads first; FCFS the older."""
    import msgspec

    from tieredkv.meta import KVMeta

    for policy, first in (("bidaw", "small"), ("fcfs", "big")):
        clock = Clock()
        cfg = parse_config({"ssd_path": str(tmp_path / policy), "scheduler": policy})
        side = SchedulerSide(cfg, FP, BS, clock=clock)
        sizes = {"busy": 1 << 20, "big": 64 << 20, "small": 1 << 20}
        prompts = {name: [i + 1] * 9 for i, name in enumerate(sizes)}
        metas: dict[str, bytes | None] = {}
        for name, prompt in prompts.items():
            session = f"s-{name}"
            side.index.put(session, side.index.hashes(prompt[:8]))
            meta = KVMeta(session=session, tier=SSD, copies=(SSD,), nbytes=sizes[name], tokens=8)
            metas[session] = msgspec.msgpack.encode(meta)
        side.update(WorkerReport(metas=metas), set())
        for name in sizes:  # "busy" takes the one load slot; the other two wait
            clock.now += 1.0
            assert side.match(name, prompts[name], 0) == (8, True)
            side.allocated(name, prompts[name], [1, 2, 3], 8)
        assert [op.req_id for op in side.plan().loads] == ["busy"]
        clock.now += 1.0
        side.update(WorkerReport(loaded=[("busy", "s-busy", True)]), set())
        assert [op.req_id for op in side.plan().loads] == [first], policy


def test_scheduler_side_loads_a_small_ssd_history_within_the_step(tmp_path: Path) -> None:
    """With ``sync_load_bytes``, a history below host memory of at most that size loads
    within the step (layer by layer), counted as a disk hit; a bigger one still waits in
    the load queue; without ``layerwise`` none does."""
    import msgspec

    from tieredkv.meta import KVMeta

    for extra, small_sync in (
        ({"sync_load_bytes": 4096}, True),
        ({"sync_load_bytes": 4096, "layerwise": False}, False),
        ({}, False),
    ):
        cfg = parse_config({"ssd_path": str(tmp_path), **extra})
        side = SchedulerSide(cfg, FP, BS)
        metas: dict[str, bytes | None] = {}
        for name, nbytes, first in (("small", 4096, 1), ("big", 4097, 2)):
            side.index.put(name, side.index.hashes([first] * 8))
            meta = KVMeta(session=name, tier=SSD, copies=(SSD,), nbytes=nbytes, tokens=8)
            metas[name] = msgspec.msgpack.encode(meta)
        side.update(WorkerReport(metas=metas), set())
        assert side.match("a", [1] * 9, 0) == (8, not small_sync), extra
        side.allocated("a", [1] * 9, [4, 5, 6], 8)
        assert side.from_host.pop("a") is False  # a disk hit either way
        assert side.match("b", [2] * 9, 0) == (8, True)
        loads = side.plan().loads
        assert [(op.req_id, op.sync, op.host) for op in loads][:1] == [("a", small_sync, False)]


def test_scheduler_side_rebuilds_its_index_from_sidecars(tmp_path: Path) -> None:
    from tieredkv.integrations.vllm.index import write_sidecar

    index_dir = tmp_path / "index"
    write_sidecar(index_dir, Sidecar(session="s1", fingerprint=FP, tokens=list(range(8))))
    write_sidecar(index_dir, Sidecar(session="s2", fingerprint="other", tokens=list(range(8))))
    (index_dir / "junk.json").write_text("{not json")
    assert [s.session for s in read_sidecars(index_dir, FP)] == ["s1"]
    side = SchedulerSide(parse_config({"ssd_path": str(tmp_path)}), FP, BS)
    # after a restart a history is on the SSD: it loads asynchronously
    assert side.match("r", [*range(8), 9], 0) == (8, True)


# -- worker side --------------------------------------------------------------------------
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def paged_kv(blocks: int = 16, heads: int = 2, c: int = 8) -> dict[str, torch.Tensor]:
    """KV tensors as vLLM's CPU backend hands them over: ``[blocks, heads, BS, 2*D]``."""
    return {name: torch.zeros(blocks, heads, BS, c) for name in LAYERS}


def store(tmp_path: Path, kv: dict[str, torch.Tensor], **extra: object) -> WorkerStore:
    cfg = parse_config({"ssd_path": str(tmp_path), "host_bytes": 1 << 20, **extra})
    s = WorkerStore(cfg, FP, BS)
    s.open(kv)
    return s


def saved_turn(
    tmp_path: Path, session: str
) -> tuple[WorkerStore, dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[int, ...]]:
    """A store whose paged KV is random, with blocks 3, 5, 6 saved as ``session``'s first
    turn (12 tokens); returns the store, the paged KV, those blocks' KV and the tokens."""
    from tieredkv.integrations.vllm.ops import SaveOp

    kv = paged_kv()
    for layer in kv.values():
        layer.copy_(torch.randn_like(layer))
    expected = {name: layer[[3, 5, 6]].clone() for name, layer in kv.items()}
    tokens = tuple(range(100, 112))
    s = store(tmp_path, kv)
    s.save(SaveOp("r1", session, (3, 5, 6), 0, 3, tokens, answer_tokens=4))
    s.wait_idle()
    assert s.finished_saves()[0][1] is True
    return s, kv, expected, tokens


def test_worker_saves_blocks_and_loads_them_into_other_blocks(tmp_path: Path) -> None:
    s, kv, expected, tokens = saved_turn(tmp_path, "vllm-x-1")
    try:
        report = s.report([], [])
        meta = report.metas["vllm-x-1"]
        assert meta is not None
        # what the turn added (12 tokens, 4 of them the answer), for the scheduler's side
        decoded = decode_meta(meta)
        assert (decoded.turn_tokens, decoded.prev_answer_tokens) == (12, 4)
        sidecar = json.loads((tmp_path / "index" / "vllm-x-1.json").read_text())
        assert sidecar["tokens"] == list(tokens)
        # load blocks 1..2 of the history into blocks 9, 10 (block 0 held "locally")
        before = {name: layer.clone() for name, layer in kv.items()}
        ok = s.load_sync(LoadOp("r2", "vllm-x-1", (8, 9, 10), 1, 3, tokens, sync=True))
        assert ok
        for name, layer in kv.items():
            assert torch.equal(layer[[9, 10]], expected[name][1:])
            assert torch.equal(layer[8], before[name][8])  # untouched
        # the wrong tokens: refused, nothing copied
        wrong = (*tokens[:-1], 7)
        assert not s.load_sync(LoadOp("r3", "vllm-x-1", (11, 12, 13), 0, 3, wrong, sync=True))
        assert torch.equal(kv[LAYERS[0]][11:14], before[LAYERS[0]][11:14])
    finally:
        s.close()
    # a restart over the same directory: the history loads (asynchronously) byte for byte
    kv2 = paged_kv()
    s2 = store(tmp_path, kv2)
    try:
        assert s2.cache.where("vllm-x-1") == SSD
        s2.load_async(LoadOp("r4", "vllm-x-1", (0, 1, 2), 0, 3, tokens, sync=False, host=False))
        s2.wait_idle()
        assert [(op.req_id, ok) for op, ok in s2.finished_loads()] == [("r4", True)]
        for name, layer in kv2.items():
            assert torch.equal(layer[[0, 1, 2]], expected[name])
        assert s2.cache.where("vllm-x-1") == HOST  # promoted on the way
        counters = s2.take_counters()
        assert counters["lower_hits"] == 1
        assert counters["loaded_tokens"] == 12
    finally:
        s2.close()


def test_worker_refuses_a_damaged_segment_and_forgets_it(tmp_path: Path) -> None:
    from tieredkv.integrations.vllm.ops import SaveOp

    kv = paged_kv()
    kv[LAYERS[0]].fill_(1.5)
    tokens = tuple(range(8))
    s = store(tmp_path, kv)
    s.save(SaveOp("r1", "vllm-x-2", (1, 2), 0, 2, tokens, answer_tokens=1))
    s.wait_idle()
    s.finished_saves()
    s.close()
    segments = [p for p in (tmp_path / "rank0").rglob("*") if p.is_file() and p.stat().st_size]
    segments = [p for p in segments if p.name != "LOCK"]
    assert segments
    for p in segments:  # flip a byte in the middle of each segment file
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    kv2 = paged_kv()
    s2 = store(tmp_path, kv2)
    try:
        if s2.cache.where("vllm-x-2") is not None:  # recovery may already refuse it
            s2.load_async(LoadOp("r2", "vllm-x-2", (4, 5), 0, 2, tokens, sync=False, host=False))
            s2.wait_idle()
            assert [ok for _, ok in s2.finished_loads()] == [False]
            assert "vllm-x-2" in s2.report([], []).gone
        assert not kv2[LAYERS[0]].any()  # no byte of it reached the paged KV
        assert not (tmp_path / "index" / "vllm-x-2.json").exists()
    finally:
        s2.close()


def test_worker_skips_a_turn_that_does_not_follow_the_stored_one(tmp_path: Path) -> None:
    from tieredkv.integrations.vllm.ops import SaveOp

    s = store(tmp_path, paged_kv())
    try:
        s.save(SaveOp("r1", "vllm-x-3", (1,), 0, 1, tuple(range(4)), answer_tokens=1))
        s.wait_idle()
        # a turn that claims the conversation holds 2 blocks: skipped, nothing changes
        s.save(SaveOp("r2", "vllm-x-3", (1, 2, 3), 2, 3, tuple(range(12)), answer_tokens=1))
        s.wait_idle()
        assert [ok for _, ok in s.finished_saves()] == [True, False]
        assert s.cache.channel["vllm-x-3"].tokens == 4
    finally:
        s.close()


def test_worker_restart_catches_up_a_sidecar_that_lags_the_stored_kv(tmp_path: Path) -> None:
    """A turn is reported stored before its sidecar is written; a crash in between leaves
    a sidecar one turn behind: the restart rewrites it from the stored token ids."""
    from tieredkv.integrations.vllm.index import write_sidecar
    from tieredkv.integrations.vllm.ops import SaveOp

    s, _, _, tokens = saved_turn(tmp_path, "vllm-x-7")
    more = (*tokens, *range(200, 204))
    s.save(SaveOp("r2", "vllm-x-7", (3, 5, 6, 7), 3, 4, more, answer_tokens=1))
    s.wait_idle()
    assert [ok for _, ok in s.finished_saves()] == [True]
    s.close()
    write_sidecar(
        tmp_path / "index", Sidecar(session="vllm-x-7", fingerprint=FP, tokens=list(tokens))
    )
    s2 = store(tmp_path, paged_kv())
    try:
        assert [c.tokens for c in read_sidecars(tmp_path / "index", FP)] == [list(more)]
        assert s2.cache.channel["vllm-x-7"].tokens == 16
    finally:
        s2.close()


def test_a_stored_turn_whose_index_entry_cannot_be_written_is_logged_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar (what a restart rebuilds the index from) is written after the turn is
    stored; a write that failed (a full disk) was silent: nothing logged, no counter, and
    the restart dropped the conversation without a word before it. Now it is logged and
    counted (``index_errors``), the turn still reported stored. A removal that fails raised
    from the step's report, on the model's thread; now it is logged and counted too."""
    import errno

    from tieredkv.integrations.vllm import worker as worker_module
    from tieredkv.integrations.vllm.ops import SaveOp

    s, _, _, tokens = saved_turn(tmp_path, "vllm-x-8")
    try:
        s.take_counters()

        def full(*args: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(worker_module, "write_sidecar", full)
        more = (*tokens, *range(200, 204))
        s.save(SaveOp("r2", "vllm-x-8", (3, 5, 6, 7), 3, 4, more, answer_tokens=1))
        s.wait_idle()
        assert [ok for _, ok in s.finished_saves()] == [True]
        assert s.take_counters().get("index_errors") == 1
        assert "writing vllm-x-8's index entry failed" in caplog.text
        assert s.cache.channel["vllm-x-8"].tokens == 16

        def unremovable(*args: object) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        # nor does one that cannot be removed stop the step's report (the model's thread)
        monkeypatch.setattr(worker_module, "remove_sidecar", unremovable)
        assert s._portal is not None
        s._portal.call(s.cache.drop, "vllm-x-8")
        report = s.report([], [])
        assert report.gone == {"vllm-x-8"}
        assert s.take_counters().get("index_errors") == 1
        assert "removing vllm-x-8's index entry failed" in caplog.text
    finally:
        s.close()


def test_worker_loads_layer_by_layer_while_the_model_computes(tmp_path: Path) -> None:
    """A load within the step lands layer by layer: layer 0's blocks are filled while layer
    1's bytes may still be on their way, from host memory and from the SSD alike; a layer
    vLLM never waited for is filled before the step ends; the bytes are the saved ones."""
    s, kv, expected, tokens = saved_turn(tmp_path, "vllm-x-5")
    try:
        assert s.copied() == {"r1"}  # vLLM may free the request's blocks now
        before = {name: layer.clone() for name, layer in kv.items()}
        stream = s.start_stream(LoadOp("r2", "vllm-x-5", (8, 9, 10), 1, 3, tokens, sync=True))
        s.wait_layer([stream], LAYERS[0])  # what vLLM calls before layer 0's attention
        assert torch.equal(kv[LAYERS[0]][[9, 10]], expected[LAYERS[0]][1:])
        assert stream.done == {0}
        assert s.finish_stream(stream)  # layer 1: filled here; every byte verified
        for name, layer in kv.items():
            assert torch.equal(layer[[9, 10]], expected[name][1:])
            assert torch.equal(layer[8], before[name][8])  # untouched
        # the wrong tokens: refused before any block is filled
        wrong = (*tokens[:-1], 7)
        stream = s.start_stream(LoadOp("r3", "vllm-x-5", (11, 12, 13), 0, 3, wrong, sync=True))
        assert not s.finish_stream(stream)
        assert torch.equal(kv[LAYERS[0]][11:14], before[LAYERS[0]][11:14])
        # a conversation the cache does not hold: a miss, nothing filled
        stream = s.start_stream(LoadOp("r4", "vllm-x-none", (1,), 0, 1, tokens[:4], sync=True))
        assert not s.finish_stream(stream)
    finally:
        s.close()
    # from the SSD (a restart), within the step: promoted to host memory on the way
    kv2 = paged_kv()
    s2 = store(tmp_path, kv2)
    try:
        assert s2.cache.where("vllm-x-5") == SSD
        op = LoadOp("r5", "vllm-x-5", (0, 1, 2), 0, 3, tokens, sync=True, host=False)
        stream = s2.start_stream(op)
        for name in LAYERS:
            s2.wait_layer([stream], name)
        assert s2.finish_stream(stream)
        for name, layer in kv2.items():
            assert torch.equal(layer[[0, 1, 2]], expected[name])
        assert s2.cache.where("vllm-x-5") == HOST
        counters = s2.take_counters()
        assert (counters["lower_hits"], counters["loaded_tokens"]) == (1, 12)
        assert counters["streamed_layers"] == 2
    finally:
        s2.close()


def test_worker_layerwise_load_of_a_damaged_segment_fails_and_forgets_it(tmp_path: Path) -> None:
    """A layer-wise load from a damaged segment may fill blocks with unverified bytes, but
    it reports failure (vLLM recomputes those blocks and drops the step's output for the
    request) and the conversation is forgotten."""
    from tieredkv.integrations.vllm.ops import SaveOp

    kv = paged_kv()
    kv[LAYERS[0]].fill_(1.5)
    tokens = tuple(range(8))
    s = store(tmp_path, kv)
    s.save(SaveOp("r1", "vllm-x-6", (1, 2), 0, 2, tokens, answer_tokens=1))
    s.wait_idle()
    s.finished_saves()
    s.close()
    for p in (tmp_path / "rank0").rglob("*.seg"):  # flip a byte in the last layer's span
        data = bytearray(p.read_bytes())
        data[-16] ^= 0xFF
        p.write_bytes(bytes(data))
    s2 = store(tmp_path, paged_kv())
    try:
        if s2.cache.where("vllm-x-6") is not None:  # recovery may already refuse it
            op = LoadOp("r2", "vllm-x-6", (4, 5), 0, 2, tokens, sync=True, host=False)
            assert not s2.finish_stream(s2.start_stream(op))
            assert "vllm-x-6" in s2.report([], []).gone
            assert s2.take_counters()["load_errors"] == 1
        assert not (tmp_path / "index" / "vllm-x-6.json").exists()
    finally:
        s2.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_worker_moves_cuda_blocks_through_pinned_staging(tmp_path: Path) -> None:
    """The CUDA path: blocks leave device memory through pinned host buffers and come back
    to other device blocks byte for byte, in the step (sync) and in the background."""
    from tieredkv.integrations.vllm.ops import SaveOp

    kv = {name: t.cuda() for name, t in paged_kv().items()}
    for layer in kv.values():
        layer.copy_(torch.randn_like(layer))
    expected = {name: layer[[2, 4]].cpu() for name, layer in kv.items()}
    tokens = tuple(range(8))
    s = store(tmp_path, kv)
    try:
        s.save(SaveOp("r1", "vllm-x-c", (2, 4), 0, 2, tokens, answer_tokens=1))
        s.wait_idle()
        assert [ok for _, ok in s.finished_saves()] == [True]
        assert s.load_sync(LoadOp("r2", "vllm-x-c", (6, 7), 0, 2, tokens, sync=True))
        s.load_async(LoadOp("r3", "vllm-x-c", (9, 10), 0, 2, tokens, sync=False, host=False))
        s.wait_idle()
        assert [ok for _, ok in s.finished_loads()] == [True]
        for name, layer in kv.items():
            assert torch.equal(layer[[6, 7]].cpu(), expected[name])
            assert torch.equal(layer[[9, 10]].cpu(), expected[name])
    finally:
        s.close()


# -- the scheduler side through a request's life --------------------------------------------
def _ssd_side(tmp_path: Path, sessions: dict[str, list[int]], scheduler: str = "bidaw") -> Any:
    """A scheduler side whose index holds ``sessions`` (name -> tokens), all on the SSD."""
    import msgspec

    from tieredkv.meta import KVMeta

    clock = Clock()
    cfg = parse_config({"ssd_path": str(tmp_path / scheduler), "scheduler": scheduler})
    side = SchedulerSide(cfg, FP, BS, clock=clock)
    metas: dict[str, bytes | None] = {}
    for name, tokens in sessions.items():
        side.index.put(name, side.index.hashes(tokens))
        meta = KVMeta(session=name, tier=SSD, copies=(SSD,), nbytes=1 << 20, tokens=len(tokens))
        metas[name] = msgspec.msgpack.encode(meta)
    side.update(WorkerReport(metas=metas), set())
    return side, clock


def _idle(side: SchedulerSide) -> None:
    assert side.busy() == dict.fromkeys(side.busy(), 0)


@pytest.mark.parametrize("scheduler", ["bidaw", "fcfs"])
@pytest.mark.parametrize("ok", [True, False])
def test_a_request_that_joins_a_load_in_flight_gets_its_own_load_when_it_lands(
    tmp_path: Path, scheduler: str, ok: bool
) -> None:
    """Two requests continue one conversation on the SSD: the second joins the first's
    load in the policy; when it lands (or fails) the second's blocks are loaded at once,
    not when some third request happens to start a new load."""
    a = list(range(1, 9))
    side, clock = _ssd_side(tmp_path, {"A": a}, scheduler)
    for req in ("r1", "r2"):
        assert side.match(req, [*a, 50], 0) == (8, True)
        side.allocated(req, [*a, 50], [1, 2, 3], 8)
        if req == "r1":
            assert [op.req_id for op in side.plan().loads] == ["r1"]
    assert side.plan().loads == []  # r2 waits for r1's load
    assert side.phase("r2") is Phase.QUEUED
    clock.now += 1.0
    side.update(WorkerReport(loaded=[("r1", "A", ok)]), set() if ok else {"r1"})
    assert [(op.req_id, op.session, op.blocks) for op in side.plan().loads] == [("r2", "A", 2)]
    assert side.phase("r2") is Phase.LOADING
    clock.now += 0.5
    side.update(WorkerReport(loaded=[("r2", "A", True)]), set())
    assert side.phase("r1") is side.phase("r2") is Phase.LOADED
    for req in ("r1", "r2"):
        side.allocated(req, [*a, 50], [], 0)  # vLLM schedules it
        assert side.phase(req) is None
    assert side.longest_wait == 0.5  # r2: from r1's load landing to its scheduling
    for req in ("r1", "r2"):
        side.finished(req, [*a, 50, 60], [1, 2, 3], 9, 1)
    side.plan()
    _idle(side)


@pytest.mark.parametrize("scheduler", ["bidaw", "fcfs"])
def test_a_request_aborted_while_its_load_is_queued_stores_nothing_and_never_loads(
    tmp_path: Path, scheduler: str
) -> None:
    """The issue's engine death: a fork waits for its SSD load behind another; the client
    aborts. vLLM's num_computed_tokens already counts the unloaded blocks: no save of them
    may be planned (its blocks are reported received once, never also sent)."""
    busy, fork_of = [7] * 8, list(range(1, 13))
    side, clock = _ssd_side(tmp_path, {"B": busy, "F": fork_of}, scheduler)
    assert side.match("busy", [*busy, 1], 0) == (8, True)
    side.allocated("busy", [*busy, 1], [1, 2, 3], 8)
    fork = [*fork_of[:8], 99, 98, 97, 96, 95]  # shares 2 of F's 3 blocks
    assert side.match("fork", fork, 0) == (8, True)
    side.allocated("fork", fork, [4, 5, 6, 7], 8)
    assert [op.req_id for op in side.plan().loads] == ["busy"]
    assert side.phase("fork") is Phase.QUEUED
    # aborted: vLLM counts 8 tokens computed, the first two blocks never filled
    assert side.finished("fork", fork, [4, 5, 6, 7], 8, 0) is False
    plan = side.plan()
    assert (plan.saves, plan.loads, plan.cancelled) == ([], [], ["fork"])
    clock.now += 1.0
    side.update(WorkerReport(loaded=[("busy", "B", True)]), set())
    assert side.plan().loads == []  # F's load is withdrawn: nothing starts
    side.allocated("busy", [*busy, 1], [], 0)
    assert side.finished("busy", [*busy, 1, 2], [1, 2, 3], 9, 1) is False  # nothing new
    _idle(side)


def test_a_request_aborted_while_loading_stores_nothing_and_ends_with_its_load(
    tmp_path: Path,
) -> None:
    a = list(range(1, 9))
    b = [5] * 8
    side, _clock = _ssd_side(tmp_path, {"A": a, "B": b})
    assert side.match("r1", [*a, 1, 2, 3, 4, 5], 0) == (8, True)
    side.allocated("r1", [*a, 1, 2, 3, 4, 5], [1, 2, 3, 4], 8)
    assert [op.req_id for op in side.plan().loads] == ["r1"]  # sent to the workers
    assert side.finished("r1", [*a, 1, 2, 3, 4, 5], [1, 2, 3, 4], 12, 0) is False
    assert side.plan() == type(side.plan())()  # no save, nothing withdrawn: it runs
    # one planned this step and aborted before the workers saw it: withdrawn
    assert side.match("r2", [*b, 1], 0) == (8, True)
    side.allocated("r2", [*b, 1], [5, 6, 7], 8)  # waits: one load at a time
    side.update(WorkerReport(loaded=[("r1", "A", True)]), set())  # r2's load is planned
    assert side.phase("r2") is Phase.LOADING
    assert side.finished("r2", [*b, 1], [5, 6, 7], 8, 0) is False
    plan = side.plan()
    assert (plan.loads, plan.saves, plan.cancelled) == ([], [], ["r2"])
    # reported loaded, then aborted before vLLM scheduled it: nothing stored either
    assert side.match("r3", [*b, 1], 0) == (8, True)
    side.allocated("r3", [*b, 1], [5, 6, 7], 8)
    assert [op.req_id for op in side.plan().loads] == ["r3"]
    side.update(WorkerReport(loaded=[("r3", "B", True)]), set())
    assert side.finished("r3", [*b, 1], [5, 6, 7], 8, 0) is False
    assert side.plan().saves == []
    _idle(side)


@pytest.mark.parametrize("forks", [True, False])
def test_two_continuations_of_one_conversation_each_store_their_turn(
    tmp_path: Path, forks: bool
) -> None:
    cfg = parse_config({"ssd_path": str(tmp_path), "forks": forks})
    side = SchedulerSide(cfg, FP, BS)
    a = list(range(1, 9))
    side.index.put("A", side.index.hashes(a))
    x, y = [*a, 10, 11, 12, 13, 0], [*a, 20, 21, 22, 23, 0]
    assert side.finished("x", x, [1, 2, 3, 4], 12, 1)  # both in one step
    assert side.finished("y", y, [5, 6, 7, 8], 12, 1)
    sx, sy = side.plan().saves
    assert (sx.session, sx.start, sx.end, sx.parent) == ("A", 2, 3, None)
    assert sy.session == session_key(FP, side.index.hashes(y[:12]))
    # y stores its own block only, as a fork of A's 2 blocks (or all 3 without forks)
    assert (sy.start, sy.end, sy.parent) == ((2, 3, "A") if forks else (0, 3, None))
    side.update(WorkerReport(stored=[("x", "A", 3, True), ("y", sy.session, 3, True)]), set())
    assert side.index.match(side.index.hashes(x[:12])) == ("A", 3)
    assert side.index.match(side.index.hashes(y[:12])) == (sy.session, 3)
    # the same turn twice in one step (duplicate requests) is stored once, new or not
    assert side.finished("z1", [7] * 9, [1, 2], 8, 1)
    assert not side.finished("z2", [7] * 9, [3, 4], 8, 1)
    d = [*x, *range(1, 9)]  # x's next turn: blocks 3 and 4
    assert side.finished("d1", d, [1, 2, 3, 4, 5], 20, 1)
    assert not side.finished("d2", d, [6, 7, 8, 9, 10], 20, 1)
    assert [(op.req_id, op.session, op.start) for op in side.plan().saves] == [
        ("z1", session_key(FP, side.index.hashes([7] * 8)), 0),
        ("d1", "A", 3),
    ]


def test_a_request_continuing_part_of_a_conversation_is_planned_as_its_fork(
    tmp_path: Path,
) -> None:
    """A shared system prompt, an edited message: the finished request's matched blocks
    stay the stored conversation's, only its own are saved; the index then matches the
    fork's whole history, and a fork of the fork again stores only its own blocks."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS)
    system = list(range(1, 13))  # 3 blocks
    # the first chat stored the prompt and a block of its own
    side.index.put("S", side.index.hashes([*system, 90, 91, 92, 93]))
    chat = [*system, 50, 51, 52, 53, 54, 55, 56, 57, 0]  # 2 blocks of its own
    assert side.finished("c", chat, list(range(10, 16)), 20, 4)
    (save,) = side.plan().saves
    assert (save.parent, save.start, save.end) == ("S", 3, 5)
    assert save.block_ids == (10, 11, 12, 13, 14)  # from block 0: the worker copies 3..4
    assert save.tokens == tuple(chat[:20])
    side.update(WorkerReport(stored=[("c", save.session, 5, True)]), set())
    assert side.index.match(side.index.hashes(chat[:20])) == (save.session, 5)
    # an edit of the chat's message: a fork of the chat at the prompt
    edit = [*system, 50, 51, 52, 53, 70, 71, 72, 73, 74, 75, 76, 77, 0]
    assert side.finished("e", edit, list(range(20, 27)), 24, 4)
    (fork,) = side.plan().saves
    assert (fork.parent, fork.start, fork.end) == (save.session, 4, 6)
    # a request inside what is stored stores nothing
    assert not side.finished("short", [*system, 50, 51, 52, 53, 0], [1, 2, 3, 4, 5], 16, 1)
    # with a tier shared between replicas too; with forks off: stored whole
    for forks, planned in ((True, ("S", 3, 5)), (False, (None, 0, 5))):
        config = parse_config({"redis_url": "redis://localhost:1", "forks": forks})
        shared = SchedulerSide(config, FP, BS)
        shared.index.put("S", shared.index.hashes([*system, 90, 91, 92, 93]))
        assert shared.finished("c", chat, list(range(10, 16)), 20, 4)
        (op,) = shared.plan().saves
        assert (op.parent, op.start, op.end) == planned


def test_worker_stores_a_fork_with_its_own_blocks_and_loads_its_whole_history(
    tmp_path: Path,
) -> None:
    from tieredkv.integrations.vllm.ops import SaveOp

    s, kv, expected, tokens = saved_turn(tmp_path, "S")  # blocks 3, 5, 6: 12 tokens
    try:
        parent = s.cache.channel["S"]
        s.take_counters()
        own = tuple(range(200, 208))
        fork = SaveOp("c", "C", (3, 5, 9, 10), 2, 4, (*tokens[:8], *own), 4, parent="S")
        s.save(fork)
        s.wait_idle()
        assert [(op.req_id, ok) for op, ok in s.finished_saves()] == [("c", True)]
        meta = s.cache.channel["C"]
        assert (meta.parent, meta.parent_tokens, meta.tokens) == ("S", 8, 16)
        # the fork's own 2 blocks are stored, the parent's are not stored again
        assert meta.shared_bytes == parent.nbytes
        assert meta.owned_bytes == meta.nbytes - parent.nbytes
        assert s.cache.stats().tiers[0].used == parent.nbytes + meta.owned_bytes
        counters = s.take_counters()
        assert counters["forks"] == 1
        assert counters["saved_tokens"] == 8
        assert s.held()[HOST] == s.cache.stats().tiers[0].used
        sidecar = json.loads((tmp_path / "index" / "C.json").read_text())
        assert sidecar["tokens"] == [*tokens[:8], *own]
        # its whole history loads, byte for byte: the parent's first 2 blocks, its own 2
        ok = s.load_sync(LoadOp("r", "C", (11, 12, 13, 14), 0, 4, fork.tokens, sync=True))
        assert ok
        for name, layer in kv.items():
            assert torch.equal(layer[[11, 12]], expected[name][:2])
            assert torch.equal(layer[[13, 14]], layer[[9, 10]])
        # the parent leaves: its blocks stay for the fork (with a retirement marker on
        # the SSD); what either tier uses is what the stored conversations hold
        assert s._portal is not None
        s._portal.call(s.cache.flush)
        s._portal.call(s.cache.drop, "S")
        assert "S" not in s.cache.channel
        unheld = {k: v for k, v in s.busy().items() if k.endswith("_unheld_bytes")}
        assert unheld == {"host_unheld_bytes": 0, "ssd_unheld_bytes": 0}
        ok = s.load_sync(LoadOp("r1", "C", (11, 12, 13, 14), 0, 4, fork.tokens, sync=True))
        assert ok
        for name, layer in kv.items():
            assert torch.equal(layer[[11, 12]], expected[name][:2])
        # a fork whose parent is gone meanwhile is stored whole
        s.save(SaveOp("d", "D", (3, 5, 9, 10), 2, 4, (*tokens[:8], *own), 4, parent="gone"))
        s.wait_idle()
        assert [(op.req_id, ok) for op, ok in s.finished_saves()] == [("d", True)]
        whole = s.cache.channel["D"]
        assert (whole.parent, whole.tokens, whole.shared_bytes) == (None, 16, 0)
        assert s.take_counters()["saved_tokens"] == 16
        ok = s.load_sync(LoadOp("r2", "D", (0, 1, 2, 4), 0, 4, fork.tokens, sync=True))
        assert ok
        for name, layer in kv.items():
            assert torch.equal(layer[[0, 1]], expected[name][:2])
            assert torch.equal(layer[[2, 4]], layer[[9, 10]])
    finally:
        s.close()


def test_a_fork_of_a_turn_being_stored_waits_for_it(tmp_path: Path) -> None:
    """A fork that shares more of its prompt with a turn not yet reported stored than with
    the index waits for the report (the engine keeps stepping until it comes)."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS)
    turn = list(range(1, 14))
    assert side.finished("r1", turn, [1, 2, 3, 4], 12, 1)
    save = side.plan().saves[0]
    fork = [*turn[:8], 40, 41, 42, 43, 44]  # shares 2 of its 3 blocks
    assert side.match("fork", fork, 0) == (None, False)
    assert side.match("unrelated", [3] * 13, 0) == (0, False)
    side.update(WorkerReport(stored=[("r1", save.session, 3, True)]), set())
    assert side.match("fork", fork, 0) == (8, False)
    # a fork that shares no more than the index holds does not wait
    assert side.finished("r2", [*turn[:12], 5, 5, 5, 5, 5], [1, 2, 3, 4, 5], 16, 1)
    assert side.match("fork2", fork, 0) == (8, False)


# -- tensor parallelism: every rank reports its shard -----------------------------------------
def _meta(session: str, *copies: str, nbytes: int = 4096, tokens: int = 12) -> bytes:
    import msgspec

    from tieredkv.meta import KVMeta

    meta = KVMeta(session=session, tier=copies[0], copies=copies, nbytes=nbytes, tokens=tokens)
    return msgspec.msgpack.encode(meta)


def test_a_save_counts_stored_once_every_rank_reported_it(tmp_path: Path) -> None:
    """Under tensor parallelism each rank stores its own shard and may report it a step
    after another: until the last rank's report the turn is not served (a load would find
    a rank without its shard), and a turn one rank failed to store is never served."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS, workers=2)
    turn = list(range(1, 14))
    assert side.finished("r1", turn, [1, 2, 3, 4], 12, 1)
    save = side.plan().saves[0]
    done = side.update([WorkerReport(stored=[("r1", save.session, 3, True)], rank=1)], set())
    assert done.stored == []
    assert side.saving()
    assert side.match("next", [*turn, 5, 5, 5], 0) == (None, False)  # waits for rank 0
    assert side.busy()["rank_saves"] == 1
    done = side.update([WorkerReport(stored=[("r1", save.session, 3, True)], rank=0)], set())
    assert done.stored == [("r1", save.session, 3, True)]
    assert not side.saving()
    assert side.match("next", [*turn, 5, 5, 5], 0) == (12, False)
    side.finished("next", [*turn, 5, 5, 5], [], 0, 0)
    # one rank failed its shard: the turn is not indexed; both in one step work the same
    other = [9] * 13
    assert side.finished("r2", other, [5, 6, 7, 8], 12, 1)
    save2 = side.plan().saves[0]
    reports = [
        WorkerReport(stored=[("r2", save2.session, 3, True)], rank=0),
        WorkerReport(stored=[("r2", save2.session, 3, False)], rank=1),
    ]
    assert side.update(reports, set()).stored == [("r2", save2.session, 3, False)]
    assert save2.session not in side.index
    assert side.match("again", [*other, 1], 0) == (0, False)
    side.finished("again", [*other, 1], [], 0, 0)
    _idle(side)


def test_a_load_ends_once_every_rank_reported_it(tmp_path: Path) -> None:
    """An asynchronous load is loaded (its policy slot free, the requests that joined it
    released) once every rank filled its shard, and failed if any rank failed."""
    a, b = list(range(1, 9)), [5] * 8
    clock = Clock()
    cfg = parse_config({"ssd_path": str(tmp_path), "scheduler": "fcfs"})
    side = SchedulerSide(cfg, FP, BS, clock=clock, workers=2)
    for name, tokens in (("A", a), ("B", b)):
        side.index.put(name, side.index.hashes(tokens))
    for rank in (0, 1):
        metas: dict[str, bytes | None] = {n: _meta(n, SSD, tokens=8) for n in ("A", "B")}
        side.update([WorkerReport(metas=metas, rank=rank)], set())
    for req, tokens in (("r1", a), ("r2", b)):
        assert side.match(req, [*tokens, 1], 0) == (8, True)
        side.allocated(req, [*tokens, 1], [1, 2, 3], 8)
    assert [op.req_id for op in side.plan().loads] == ["r1"]  # one load at a time
    clock.now += 1.0
    assert side.update([WorkerReport(loaded=[("r1", "A", True)], rank=0)], set()).loaded == []
    assert side.phase("r1") is Phase.LOADING  # rank 1 still fills its shard
    assert side.plan().loads == []  # r2 waits for the slot
    clock.now += 1.0
    done = side.update([WorkerReport(loaded=[("r1", "A", False)], rank=1)], {"r1"})
    assert done.loaded == [("r1", "A", False)]
    assert side.phase("r1") is Phase.LOADED
    assert [op.req_id for op in side.plan().loads] == ["r2"]
    assert side.match("r1", [*a, 1], 0) == (0, False)  # failed on a rank: it recomputes
    side.finished("r1", [*a, 1], [], 0, 0)
    side.update([WorkerReport(loaded=[("r2", "B", True)], rank=r) for r in (1, 0)], set())
    assert side.phase("r2") is Phase.LOADED
    side.allocated("r2", [*b, 1], [], 0)
    side.finished("r2", [*b, 1], [1, 2, 3], 8, 0)
    _idle(side)


def test_a_conversations_placement_combines_its_shards(tmp_path: Path) -> None:
    """The scheduler side's mirror of a conversation's placement is its slowest shard's
    (the load waits for the last rank) and forgets it once any rank lost its shard."""
    cfg = parse_config({"ssd_path": str(tmp_path)})
    side = SchedulerSide(cfg, FP, BS, workers=2)
    side.update(
        [
            WorkerReport(metas={"A": _meta("A", HOST, SSD)}, rank=0),
            WorkerReport(metas={"A": _meta("A", SSD, nbytes=8192)}, rank=1),
        ],
        set(),
    )
    meta = side.channel.get("A")
    assert meta is not None
    assert (meta.tier, meta.copies, meta.nbytes) == (SSD, (SSD,), 8192)
    side.update([WorkerReport(metas={"A": _meta("A", HOST, SSD)}, rank=1)], set())
    meta = side.channel.get("A")
    assert meta is not None
    assert (meta.tier, meta.copies, meta.nbytes) == (HOST, (HOST, SSD), 4096)
    side.update([WorkerReport(metas={"A": None}, rank=0)], set())
    assert side.channel.get("A") is None
    side.update([WorkerReport(metas={"A": _meta("A", HOST)}, rank=1)], set())
    assert side.channel.get("A") is None  # rank 0's shard is still gone


def test_the_leak_check_finds_what_either_side_still_holds() -> None:
    """``tests.vllm_support.leaks``, which the engine tests end with: a count of what is
    held, a side that logged nothing, a stored conversation not indexed."""
    from tests.vllm_support import leaks

    side = {"requests": 0, "event_turns": 0, "finished": 9, "withdrawn": {"queued": 1}}
    worker = {"copies": 0, "ssd_unheld_bytes": 0, "stored_sessions": 3}
    assert leaks({**side, "indexed": 3}, worker) == {}
    assert leaks({**side, "indexed": 3, "event_turns": 2}, worker) == {
        "scheduler side: event_turns": 2
    }
    assert leaks({**side, "indexed": 3}, {**worker, "ssd_unheld_bytes": 4096}) == {
        "worker: ssd_unheld_bytes": 4096
    }
    assert leaks({**side, "indexed": 2}, worker) == {"stored_sessions != indexed": (3, 2)}
    assert leaks({}, worker) == {"scheduler side": "logged nothing at shutdown"}
