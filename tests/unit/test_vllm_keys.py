"""The connector's keys below the engine: the model's identity (its files' digest, a pinned
``model_id``, a hub commit), the request's identity (LoRA adapter and its files,
``cache_salt``) and per-block keys (multimodal inputs) in the chained block hashes, the
index and the sidecars a restart rebuilds it from, and the requests that are refused.

The tests that build vLLM's own ``Request`` objects import vLLM (tens of seconds on a busy
machine): they are marked slow.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from tieredkv.errors import InvalidArgumentError
from tieredkv.integrations.vllm.config import parse_config
from tieredkv.integrations.vllm.index import Sidecar, read_sidecars, write_sidecar
from tieredkv.integrations.vllm.keys import (
    PLAIN,
    FilesDigests,
    RequestKeys,
    block_hashes,
    files_digest,
    fingerprint,
    identity_digest,
    model_identity,
)
from tieredkv.integrations.vllm.ops import LoadOp, SaveOp
from tieredkv.integrations.vllm.scheduler import SchedulerSide
from tieredkv.integrations.vllm.worker import WorkerStore

BS = 4
FP = fingerprint(
    model="m", identity="id:m", dtype="float32", kv_dtype="auto", block_size=BS, layout="L2"
)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def model_dir(path: Path, weights: bytes = b"w" * 1000) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"hidden_size": 8}')
    return path


# -- the model's identity -----------------------------------------------------------------
def test_model_identity_is_a_digest_of_the_files_that_follows_their_bytes(
    tmp_path: Path,
) -> None:
    d = model_dir(tmp_path / "m")
    first = model_identity(str(d), None, model_id=None)
    assert first.startswith("files:")
    assert model_identity(str(d), None, model_id=None) == first  # stable: a restart agrees
    # rewritten in place: the same path, the same size, other bytes
    (d / "model.safetensors").write_bytes(b"v" * 1000)
    rewritten = model_identity(str(d), None, model_id=None)
    assert rewritten != first
    # the config is part of it; files of no model (a README, a hidden folder) are not
    (d / "config.json").write_text('{"hidden_size": 9}')
    reconfigured = model_identity(str(d), None, model_id=None)
    assert reconfigured != rewritten
    (d / "README.md").write_text("notes")
    (d / ".cache").mkdir()
    (d / ".cache" / "x.json").write_text("{}")
    assert model_identity(str(d), None, model_id=None) == reconfigured
    # a file's name is part of it (bytes moved between shards are another model)
    digest, files, size = files_digest(d)
    os.rename(d / "model.safetensors", d / "model-00001.safetensors")
    assert files_digest(d) != (digest, files, size)


def test_a_pinned_model_id_wins_and_a_hub_model_needs_a_commit(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    assert model_identity(str(d), None, model_id="llama-3@2024-06") == "id:llama-3@2024-06"
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert model_identity("org/model", commit, model_id=None) == f"rev:org/model@{commit}"
    with pytest.raises(InvalidArgumentError, match="model_id"):
        model_identity("no-such-org/no-such-model", "main", model_id=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="no weight or config file"):
        files_digest(tmp_path / "empty")


def test_model_id_is_a_config_key() -> None:
    assert parse_config({"model_id": "m@1"}).model_id == "m@1"
    for bad in ("", 7):
        with pytest.raises(InvalidArgumentError, match="model_id"):
            parse_config({"model_id": bad})


def test_the_fingerprint_format_changed_so_old_sidecars_are_not_read(tmp_path: Path) -> None:
    """A sidecar written under the fingerprint of the earlier format (the model's path,
    revision, dtype and layout, nothing of its weights) is never read back: its
    conversation is a miss, not served under the new keys."""
    model, dtype, kv_dtype, layout = "/models/m", "float32", "auto", "L2"
    old = xxhash.xxh3_64_hexdigest(
        "\x1f".join([model, "", dtype, kv_dtype, str(BS), layout]).encode()
    )
    identity = model_identity(str(model_dir(tmp_path / "w")), None, model_id=None)
    new = fingerprint(
        model=model, identity=identity, dtype=dtype, kv_dtype=kv_dtype, block_size=BS, layout=layout
    )
    assert new != old
    tokens = list(range(8))
    write_sidecar(tmp_path / "kv" / "index", Sidecar(session="s", fingerprint=old, tokens=tokens))
    assert list(read_sidecars(tmp_path / "kv" / "index", new)) == []
    side = SchedulerSide(parse_config({"ssd_path": str(tmp_path / "kv")}), new, BS)
    assert side.match("r", [*tokens, 9], 0) == (0, False)


# -- the request's keys in the block hashes -----------------------------------------------
def test_block_hashes_cover_the_identity_and_each_blocks_own_keys() -> None:
    tokens = list(range(12))
    plain = block_hashes(FP, tokens, BS)
    assert block_hashes(FP, tokens, BS, PLAIN) == plain
    salted = block_hashes(FP, tokens, BS, RequestKeys(identity_digest([("cache_salt", "a")])))
    other = block_hashes(FP, tokens, BS, RequestKeys(identity_digest([("cache_salt", "b")])))
    assert len({*plain, *salted, *other}) == 9  # an identity changes every block
    image = xxhash.xxh3_128_hexdigest(b"img")
    mm = block_hashes(FP, tokens, BS, RequestKeys("", ("", image)))
    assert mm[0] == plain[0]  # a block's own key changes it and what follows it
    assert mm[1] != plain[1]
    assert mm[2] != plain[2]
    assert identity_digest([]) == ""
    # the order of the whole-request keys does not matter, their values do
    a, b = ("lora", "x", "/p", "files:1"), ("cache_salt", "s")
    assert identity_digest([a, b]) == identity_digest([b, a]) != identity_digest([a])


def test_the_index_serves_only_the_same_keys_and_its_sidecars_keep_them(
    tmp_path: Path,
) -> None:
    """A turn stored under a tenant's salt and a per-block key is matched only under the
    same keys, in this process and after a restart (from the sidecar the worker wrote)."""
    cfg = parse_config({"ssd_path": str(tmp_path), "host_bytes": 1 << 20})
    tenant = RequestKeys(identity_digest([("cache_salt", "tenant-a")]), ("", "ab" * 16))
    other = RequestKeys(identity_digest([("cache_salt", "tenant-b")]), ("", "ab" * 16))
    no_image = RequestKeys(tenant.identity)
    side = SchedulerSide(cfg, FP, BS)
    prompt = list(range(13))
    assert side.finished("r1", prompt, [3, 5, 6, 7], 12, 1, tenant)
    save = side.plan().saves[0]
    assert save.keys == tenant.prefix(3)
    kv = {name: torch.randn(16, 2, BS, 8) for name in LAYERS}
    store = WorkerStore(cfg, FP, BS)
    store.open(kv)
    try:
        store.save(save)
        store.wait_idle()
        assert [ok for _, ok in store.finished_saves()] == [True]
    finally:
        store.close()
    [sidecar] = read_sidecars(tmp_path / "index", FP)
    assert (sidecar.identity, sidecar.extra) == (tenant.identity, list(tenant.extra))
    from tieredkv.integrations.vllm.ops import WorkerReport

    side.update(WorkerReport(stored=[("r1", save.session, 3, True)]), set())
    restarted = SchedulerSide(cfg, FP, BS)
    for s in (side, restarted):
        assert s.match("t", [*prompt, 1], 0, tenant)[0] == 12
        assert s.match("o", [*prompt, 1], 0, other) == (0, False)
        assert s.match("p", [*prompt, 1], 0) == (0, False)
        # without the image the second block differs: only the first is shared
        assert s.match("n", [*prompt, 1], 0, no_image)[0] == 4


def test_a_lagging_sidecar_of_a_multimodal_engine_is_dropped_not_rebuilt(
    tmp_path: Path,
) -> None:
    """A restart rebuilds a sidecar that lags its stored KV from the stored token ids,
    keeping its identity; where requests may carry per-block keys (which only the request
    knew) it drops the conversation instead."""
    for per_block, kept in ((False, True), (True, False)):
        root = tmp_path / str(per_block)
        cfg = parse_config({"ssd_path": str(root), "host_bytes": 1 << 20})
        keys = RequestKeys(identity_digest([("cache_salt", "s")]))
        session = f"vllm-{FP}-1"
        store = WorkerStore(cfg, FP, BS, per_block_keys=per_block)
        store.open({name: torch.randn(16, 2, BS, 8) for name in LAYERS})
        tokens = tuple(range(100, 116))
        try:
            for op in (
                SaveOp("r1", session, (3, 5), 0, 2, tokens[:8], 1, keys),
                SaveOp("r2", session, (3, 5, 6, 7), 2, 4, tokens, 1, keys),
            ):
                store.save(op)
                store.wait_idle()
                assert [ok for _, ok in store.finished_saves()] == [True]
        finally:
            store.close()
        write_sidecar(  # the crash: the second turn's sidecar was not written
            root / "index",
            Sidecar(
                session=session, fingerprint=FP, tokens=list(tokens[:8]), identity=keys.identity
            ),
        )
        store = WorkerStore(cfg, FP, BS, per_block_keys=per_block)
        store.open({name: torch.zeros(16, 2, BS, 8) for name in LAYERS})
        try:
            sidecars = list(read_sidecars(root / "index", FP))
            if kept:
                assert [(s.tokens, s.identity) for s in sidecars] == [(list(tokens), keys.identity)]
                assert store.load_sync(LoadOp("r3", session, (0, 1, 2, 3), 0, 4, tokens, True))
            else:
                assert sidecars == []
                assert session not in store.cache.sessions()
        finally:
            store.close()


def test_adapter_digests_follow_the_files(tmp_path: Path) -> None:
    d = tmp_path / "lora"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(b"a" * 64)
    digests = FilesDigests()
    first = digests.digest(str(d))
    assert FilesDigests().digest(str(d)) == first  # another process computes the same
    (d / "adapter_model.safetensors").write_bytes(b"b" * 64)
    assert digests.digest(str(d)) != first
    with pytest.raises(InvalidArgumentError):
        digests.digest(str(tmp_path / "missing"))


# -- vLLM's requests ----------------------------------------------------------------------
def vllm_request(rid: str, tokens: list[int] | None, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kw)


@pytest.mark.slow
def test_request_keys_from_vllms_extra_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from tieredkv.integrations.vllm.connector import request_keys

    digests = FilesDigests()
    tokens = list(range(1, 13))

    def keys(**kw: Any) -> RequestKeys | None:
        return request_keys(vllm_request("r", tokens, **kw), BS, digests)

    assert keys() is PLAIN
    a, b = keys(cache_salt="tenant-a"), keys(cache_salt="tenant-b")
    assert a is not None
    assert b is not None
    assert a.identity
    assert b.identity
    assert a.identity != b.identity
    assert a.extra == ()
    lora_dir = tmp_path / "lora"
    lora_dir.mkdir()
    (lora_dir / "adapter_config.json").write_text('{"r": 8}')
    (lora_dir / "adapter_model.safetensors").write_bytes(b"a" * 64)
    lora = LoRARequest("A", 1, str(lora_dir))
    la = keys(lora_request=lora)
    assert la is not None
    assert la.identity not in ("", a.identity)
    assert keys(lora_request=LoRARequest("B", 2, str(lora_dir))) != la  # another name
    both = keys(lora_request=lora, cache_salt="tenant-a")
    assert both is not None
    assert both.identity not in (la.identity, a.identity)
    (lora_dir / "adapter_model.safetensors").write_bytes(b"b" * 64)  # rewritten in place
    assert keys(lora_request=lora) != la
    # an image at tokens 5..10: blocks 1 and 2 carry its key, block 0 none
    image = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img-1", mm_position=PlaceholderRange(5, 6)
    )
    mm = keys(mm_features=[image])
    assert mm is not None
    assert mm.identity == ""
    assert mm.extra[0] == ""
    assert mm.extra[1]
    assert mm.extra[2]
    assert len(mm.extra) == 3
    image2 = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img-2", mm_position=PlaceholderRange(5, 6)
    )
    mm2 = keys(mm_features=[image2])
    assert mm2 is not None
    assert mm2.extra[1:] != mm.extra[1:]
    # refused, with a log line saying why: prompt embeddings, an unreadable adapter
    with caplog.at_level(logging.INFO, logger="tieredkv.integrations.vllm.connector"):
        embeds = request_keys(
            vllm_request("e", None, prompt_embeds=torch.zeros(12, 8)), BS, digests
        )
        assert embeds is None
        gone = keys(lora_request=LoRARequest("C", 3, str(tmp_path / "missing")))
        assert gone is None
    assert "prompt is given as embeddings" in caplog.text
    assert "its keys cannot be established" in caplog.text


@pytest.mark.slow
def test_the_connector_checks_its_config_where_vllm_first_asks_its_class() -> None:
    from tieredkv.integrations.vllm.connector import TieredKVConnector

    with pytest.raises(InvalidArgumentError, match="host_byte"):
        TieredKVConnector.requires_piecewise_for_cudagraph({"host_byte": 1})
    assert TieredKVConnector.requires_piecewise_for_cudagraph({}) is True
    assert TieredKVConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["SlidingWindowSpec", "ChunkedLocalAttentionSpec", "RSWASpec"])
def test_a_model_whose_kv_cache_frees_blocks_out_of_its_window_is_refused(spec: str) -> None:
    """A sliding window's blocks that leave the window are vLLM's null block by the time a
    request finishes: a stored turn held its bytes, and a prompt sharing part of it was
    served them (a tiny Mistral with a 64-token window answered otherwise than recompute).
    The connector now refuses such a model when it starts, saying why; full attention and
    MLA are served."""
    from vllm.v1 import kv_cache_interface as kvi

    from tieredkv.integrations.vllm.connector import model_fingerprint

    base = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    extra = {
        "SlidingWindowSpec": {"sliding_window": 64},
        "ChunkedLocalAttentionSpec": {"attention_chunk_size": 64},
        "RSWASpec": {"rswa_window": 64},
    }[spec]
    kv_spec = getattr(kvi, spec)(**base, **extra)
    group = kvi.KVCacheGroupSpec(layer_names=["model.layers.0.self_attn"], kv_cache_spec=kv_spec)
    config = kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    with pytest.raises(InvalidArgumentError, match=f"keeps every block.*this one's is {spec}"):
        model_fingerprint(None, config)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_streaming_request_is_keyed_again_when_a_later_chunk_extends_it() -> None:
    """vLLM's streaming-input requests (realtime audio, say) keep one request id while later
    chunks extend the prompt and its multimodal inputs. The connector computed a request's
    keys once, at its first match: the turn it stored at the end keyed a later chunk's
    blocks without that chunk's media, and another stream with other media in the same
    place was offered them. Keys now follow the request's prompt as it grows."""
    from dataclasses import replace

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from tieredkv.integrations.vllm.connector import KeysByRequest, request_keys

    def audio(name: str, offset: int) -> MultiModalFeatureSpec:
        return MultiModalFeatureSpec(
            data=None, modality="audio", identifier=name, mm_position=PlaceholderRange(offset, 4)
        )

    def extend(request: Any, tokens: list[int], feature: MultiModalFeatureSpec) -> None:
        """A later chunk, as vLLM's ``Scheduler._update_request_as_session`` adds it."""
        feature.mm_position = replace(
            feature.mm_position, offset=feature.mm_position.offset + request.num_tokens
        )
        request.mm_features.append(feature)
        request._all_token_ids.extend(tokens)
        request.prompt_token_ids.extend(tokens)
        request.num_prompt_tokens = len(request.prompt_token_ids)

    first = [1, 2, 3, 4, 7, 7, 7, 7, 5, 6, 8, 9]  # audio A in block 1
    later = [10, 11, 12, 13, 7, 7, 7, 7]  # audio B (or C) in block 4
    cache = KeysByRequest(BS, FilesDigests())
    stream = vllm_request("stream-1", list(first), mm_features=[audio("A", 4)])
    before = cache.get(stream)
    assert before is not None
    assert len(before.extra) == 2
    extend(stream, later, audio("B", 4))
    now = cache.get(stream)
    assert now == request_keys(stream, BS, FilesDigests())
    assert now is not None
    assert now.extra[:2] == before.extra
    assert now.extra[4]  # block 4 keyed by audio B
    other = vllm_request("stream-2", list(first), mm_features=[audio("A", 4)])
    extend(other, later, audio("C", 4))
    theirs = cache.get(other)
    assert theirs is not None
    assert theirs.extra[:4] == now.extra[:4]
    assert theirs.extra[4] != now.extra[4]  # another stream's block 4 is never matched
    cache.pop("stream-1")
    assert len(cache) == 1
