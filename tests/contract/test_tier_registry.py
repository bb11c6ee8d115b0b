"""The tier registry: every kind built from a configuration passes the tier contract, and a
bad configuration fails with an error naming the key, before anything is built.

The contract kit's checks (:mod:`tieredkv.testing`, a selection) run here again over
tiers that :func:`~tieredkv.backends.registry.tier_from_config` built from plain dicts,
as a JSON file or the vLLM connector's extra config would hold them; Redis is a real
``redis-server`` (:mod:`tests.redis_server`).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import tieredkv
from tests import redis_server as redis_testing
from tests.contract import test_tier_contract as contract
from tests.contract.test_tier_contract import kind as kind  # the fixture: every kind
from tests.redis_server import redis_server as redis_server  # the fixture
from tests.segments import SegmentFactory, read_back, store
from tieredkv.backends import HostMemoryTier, MmapTier, SSDTier, Tier, registry
from tieredkv.backends.redis import RedisTier
from tieredkv.backends.registry import (
    HostMemoryConfig,
    SSDConfig,
    UnknownTierError,
    make_tier,
    register_tier,
    tier_from_config,
    tier_names,
)
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import InvalidArgumentError, InvalidTypeError, TieredKVError
from tieredkv.testing import CHECKS, Check, run_check

CAPACITY = contract.CAPACITY


def config_of(kind: str, root: Path, capacity: int = CAPACITY) -> dict[str, Any]:
    """The configuration (a plain dict) of a tier of the contract's ``kind`` under ``root``."""
    if kind == "host":
        return {"kind": "host", "capacity": capacity}
    if kind == "mmap":
        return {"kind": "mmap", "path": str(root / "tier.mmap"), "capacity": capacity}
    if kind in ("ssd-direct", "ssd-buffered"):
        direct = kind == "ssd-direct"
        return {"kind": "ssd", "directory": str(root / "ssd"), "capacity": capacity,
                "direct_io": direct}  # fmt: skip
    if kind == "redis":
        assert redis_testing.current is not None
        prefix = redis_testing.new_prefix()
        return {"kind": "redis", "server": redis_testing.current.url, "capacity": capacity,
                "prefix": prefix}  # fmt: skip
    raise AssertionError(kind)


@pytest.fixture
async def tier(kind: str, tmp_path: Path) -> AsyncIterator[Tier]:
    """An open tier of every kind, built from its configuration, closed after the test."""
    t = tier_from_config(config_of(kind, tmp_path))
    assert await t.open() == []
    yield t
    await t.aclose()


# The contract, over the registry's tiers (these use this module's ``kind`` and ``tier``).
test_every_tier_implements_the_protocol = contract.test_every_tier_implements_the_protocol

REGISTRY_CHECKS = [
    check
    for check in CHECKS
    if check.__name__
    in {
        "write_then_read_is_byte_exact",
        "sessions_stay_apart",
        "contains_and_length_follow_commit",
        "reserve_beyond_capacity_returns_false",
        "delete_frees_space",
        "stats_counters_are_exact",
        "use_after_aclose_raises_closed_error",
    }
]


@pytest.mark.parametrize("check", REGISTRY_CHECKS, ids=[c.__name__ for c in REGISTRY_CHECKS])
async def test_the_contract_kit_on_tiers_built_from_configurations(
    kind: str, tmp_path: Path, check: Check
) -> None:
    made = itertools.count()

    def make(capacity: int) -> Tier:
        root = tmp_path / str(next(made))
        root.mkdir()
        return tier_from_config(config_of(kind, root, capacity))

    await run_check(check, make, capacity=CAPACITY)


# -- what each kind builds -------------------------------------------------------------------


def test_the_built_in_kinds_are_registered() -> None:
    assert tier_names() == ["memory", "host", "ssd", "mmap", "redis"]


def test_each_kind_builds_its_class_with_every_option_passed(tmp_path: Path) -> None:
    """Every option of a configuration reaches the tier's constructor: the tier built from
    it equals, attribute for attribute, the one built directly."""
    host = make_tier("memory", capacity=5 << 20, name="h", pin=False, max_threads=3)
    assert type(host) is HostMemoryTier
    assert (host.name, host.capacity, host._want_pin, host._max_threads) == ("h", 5 << 20, False, 3)
    assert type(make_tier("host", capacity=4096)) is HostMemoryTier
    options: dict[str, Any] = {
        "directory": tmp_path / "d",  # a path-like is taken as its path
        "capacity": 1 << 30,
        "name": "s",
        "direct_io": False,
        "fsync": False,
        "max_threads": 2,
        "chunk_size": 1 << 20,
        "secret": b"0123456789abcdef",
    }
    ssd, direct = make_tier("ssd", **options), SSDTier(**options)
    assert type(ssd) is SSDTier
    for attr in ("name", "directory", "capacity", "span_bytes", "authenticated"):
        assert getattr(ssd, attr) == getattr(direct, attr), attr
    assert (ssd._want_direct, ssd._writer._fsync, ssd._max_threads) == (False, False, 2)
    mm = make_tier("mmap", path=str(tmp_path / "m"), capacity=8192, keep_file=True)
    assert type(mm) is MmapTier
    assert (mm.path, mm.capacity, mm.name, mm._keep) == (tmp_path / "m", 8192, "mmap", True)
    redis = make_tier(
        "redis",
        server="redis://127.0.0.1:1/0",
        capacity=1 << 20,
        prefix="p",
        value_size=1 << 16,
        timeout=2,
        lease_ttl=5,
        owner="me",
    )
    assert type(redis) is RedisTier
    assert (redis.name, redis.capacity, redis.url) == ("redis", 1 << 20, "redis://127.0.0.1:1/0")


def test_kinds_are_case_insensitive_and_underscores_are_dashes() -> None:
    register_calls: list[str] = []

    class Config(msgspec.Struct, frozen=True, kw_only=True):
        capacity: int

    def factory(config: Config) -> Tier:
        register_calls.append("made")
        return HostMemoryTier(config.capacity)

    original = dict(registry._TIERS)
    try:
        register_tier("My_Kind", factory, Config)
        assert "my-kind" in tier_names()
        assert type(make_tier(" MY-KIND ", capacity=4096)) is HostMemoryTier
        assert type(tier_from_config({"kind": "my_kind", "capacity": 4096})) is HostMemoryTier
        assert register_calls == ["made", "made"]
    finally:
        registry._TIERS.clear()
        registry._TIERS.update(original)
    assert type(make_tier("HOST", capacity=4096)) is HostMemoryTier


async def test_an_ssd_tier_reads_its_secret_from_secret_file(
    tmp_path: Path, seg: SegmentFactory
) -> None:
    """``secret_file`` gives the tier the file's bytes as its secret: what it writes (the
    segment with its MACs set, the body exact) reads back through a tier given those bytes
    directly, and a tier with another secret refuses it (sets it aside at open)."""
    secret = b"a secret of 24 bytes...."
    (tmp_path / "secret").write_bytes(secret)
    config = {"kind": "ssd", "directory": str(tmp_path / "ssd"), "capacity": CAPACITY,
              "secret_file": str(tmp_path / "secret")}  # fmt: skip
    s = seg(tokens=1200, seed=7)
    built = tier_from_config(config)
    assert isinstance(built, SSDTier)
    async with built as t:
        assert t.authenticated
        await store(t, s)
    path = tmp_path / "ssd" / "segments" / segment_file_name(s.key)
    start = s.header.body_offset
    async with SSDTier(tmp_path / "ssd", CAPACITY, secret=secret) as t:
        got = await read_back(t, s)  # the file: the segment with its MACs set
        assert got == path.read_bytes()
        assert got[start:] == s.data[start:]
    async with SSDTier(tmp_path / "ssd", CAPACITY, secret=b"another secret, 24 bytes") as t:
        assert not t.contains(s.key)
        assert t.set_aside(s.key[0]) == (s.key[1],)


async def test_a_third_party_tier_registers_and_stores_exact_bytes(
    tmp_path: Path, seg: SegmentFactory
) -> None:
    """A tier from outside the package joins with register_tier(name, factory, config):
    its configuration is checked like a built-in's, and the tier it builds works."""

    class FileDirConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        root: str
        capacity: int
        name: str = "files"

    def build(config: FileDirConfig) -> Tier:  # an SSD tier under a fixed subdirectory
        return SSDTier(Path(config.root) / "kv", config.capacity, name=config.name)

    original = dict(registry._TIERS)
    try:
        register_tier("files", build, FileDirConfig)
        t = tier_from_config({"kind": "files", "root": str(tmp_path), "capacity": CAPACITY})
        assert t.name == "files"
        s = seg(tokens=8000, seed=8)
        await t.open()
        try:
            await store(t, s)
            assert await read_back(t, s) == s.data
        finally:
            await t.aclose()
        assert (tmp_path / "kv" / "segments").is_dir()
        with pytest.raises(InvalidArgumentError, match=r"unknown key\(s\) \['rot'\]"):
            make_tier("files", rot=str(tmp_path), capacity=CAPACITY)
    finally:
        registry._TIERS.clear()
        registry._TIERS.update(original)
    with pytest.raises(UnknownTierError):
        make_tier("files", root=str(tmp_path), capacity=CAPACITY)


def test_register_refuses_what_it_cannot_use() -> None:
    with pytest.raises(InvalidArgumentError, match="non-empty name"):
        register_tier(" ", lambda c: HostMemoryTier(4096), HostMemoryConfig)
    with pytest.raises(InvalidTypeError, match=r"msgspec\.Struct type"):
        register_tier("x", lambda c: HostMemoryTier(4096), dict)  # type: ignore[type-var]
    with pytest.raises(InvalidTypeError, match="factory must be callable"):
        register_tier("x", "HostMemoryTier", HostMemoryConfig)  # type: ignore[arg-type]
    assert "x" not in tier_names()


# -- bad configurations ----------------------------------------------------------------------


def test_an_unknown_kind_lists_the_known_ones() -> None:
    with pytest.raises(UnknownTierError) as info:
        tier_from_config({"kind": "nvme", "capacity": 1})
    assert str(info.value) == "unknown tier kind 'nvme'; known: host, memory, mmap, redis, ssd"
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, TieredKVError)
    assert info.value.kind == "nvme"


SSD = {"kind": "ssd", "directory": "/nonexistent/kv", "capacity": 1 << 30}

BAD: dict[str, tuple[Any, str]] = {
    "unknown key": (
        {**SSD, "fsyncc": True},
        "tier config of kind 'ssd': unknown key(s) ['fsyncc']; it takes ['capacity', "
        "'chunk_size', 'direct_io', 'directory', 'fsync', 'huge_pages', 'max_threads', "
        "'name', 'secret', 'secret_file']",
    ),
    "missing key": (
        {"kind": "ssd", "capacity": 1 << 30},
        "tier config of kind 'ssd': missing required key 'directory'",
    ),
    "a string for an int": (
        {**SSD, "capacity": "64G"},
        "tier config of kind 'ssd': key 'capacity': Expected `int`, got `str`",
    ),
    "a float for an int": (
        {**SSD, "capacity": 1e9},
        "tier config of kind 'ssd': key 'capacity': Expected `int`, got `float`",
    ),
    "a bool for an int": (
        {"kind": "host", "capacity": True},
        "tier config of kind 'host': key 'capacity': Expected `int`, got `bool`",
    ),
    "a number for a bool": (
        {**SSD, "fsync": 1},
        "tier config of kind 'ssd': key 'fsync': Expected `bool`, got `int`",
    ),
    "a bad nested value": (
        {"kind": "redis", "server": "redis://h", "capacity": 1, "client_options": {1: 2}},
        "tier config of kind 'redis': key 'client_options': Expected `str`, got `int` (at "
        "`key` in `$.client_options`)",
    ),
    "no kind": (
        {"capacity": 1},
        "a tier config needs a 'kind' (one of ['memory', 'host', 'ssd', 'mmap', 'redis']); "
        "it has ['capacity']",
    ),
    "not a mapping": (
        [("kind", "ssd")],
        "a tier config is a mapping with a 'kind' and the tier's options, not [('kind', 'ssd')]",
    ),
    "a kind that is not a name": (
        {"kind": 3, "capacity": 1},
        "a tier kind is a name (one of ['memory', 'host', 'ssd', 'mmap', 'redis']), not 3",
    ),
    "a secret and a secret file": (
        {**SSD, "secret": b"0123456789abcdef", "secret_file": "/etc/kv-secret"},
        "tier 'ssd': give 'secret' or 'secret_file', not both",
    ),
    "an unreadable secret file": (
        {**SSD, "secret_file": "/nonexistent/secret"},
        "tier 'ssd': 'secret_file' '/nonexistent/secret' cannot be read (No such file or "
        "directory); name a readable file holding the secret",
    ),
    "client options repeating a key": (
        {"kind": "redis", "server": "redis://h", "capacity": 1, "client_options": {"timeout": 1}},
        "tier 'redis': 'client_options' may not repeat the tier's own keys ['timeout']; set "
        "them at the top level",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_config_is_refused_naming_the_key(case: str, tmp_path: Path) -> None:
    config, message = BAD[case]
    with pytest.raises(InvalidArgumentError) as info:
        tier_from_config(config)
    assert str(info.value) == message
    assert not Path("/nonexistent").exists()  # nothing was created


def test_a_value_out_of_range_is_refused_by_the_tier_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"tier 'ssd': capacity \(bytes\) must be"):
        tier_from_config({**SSD, "capacity": 0})
    with pytest.raises(InvalidArgumentError, match=r"tier 'host': max_threads must be"):
        make_tier("memory", capacity=4096, max_threads=0)
    with pytest.raises(InvalidArgumentError, match="chunk_size must be a positive multiple"):
        make_tier("ssd", directory=str(tmp_path), capacity=1 << 20, chunk_size=4097)
    with pytest.raises(ValueError, match="is not a redis://"):
        make_tier("redis", server="http://h", capacity=1)
    assert list(tmp_path.iterdir()) == []  # a tier touches nothing before it opens


def test_the_registry_is_public() -> None:
    assert tieredkv.make_tier is make_tier
    assert tieredkv.tier_from_config is tier_from_config
    assert tieredkv.UnknownTierError is UnknownTierError
    assert SSDConfig.__struct_fields__[0] == "capacity"
