"""Build any tier by name, from a configuration.

>>> from tieredkv.backends.registry import make_tier, tier_from_config
>>> make_tier("memory", capacity=1 << 20).capacity
1048576
>>> tier_from_config({"kind": "ssd", "directory": "/var/kv", "capacity": 64 << 30}).kind
'ssd'

Each kind of tier has a typed configuration, a :class:`msgspec.Struct` whose fields are the
tier's constructor arguments: :class:`HostMemoryConfig` (``"memory"``, also ``"host"``),
:class:`SSDConfig` (``"ssd"``), :class:`MmapConfig` (``"mmap"``) and :class:`RedisConfig`
(``"redis"``). A configuration from JSON, the vLLM connector's extra config or a command
line is checked against it before anything is built: an unknown key, a missing one or a
value of the wrong type is an :class:`~tieredkv.errors.InvalidArgumentError` naming the
key (a value out of range is refused by the tier's constructor, which names it too).
Building a tier touches no file and no server: that happens when it is opened.

Names are case-insensitive and ``_`` equals ``-``. A tier module is imported only when a
tier of its kind is built (``"redis"`` needs the optional ``redis`` client). Third-party
tiers join with :func:`register_tier`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ..errors import InvalidArgumentError, InvalidTypeError, TieredKVError
from .base import Tier

__all__ = [
    "HostMemoryConfig",
    "MmapConfig",
    "RedisConfig",
    "SSDConfig",
    "TierConfig",
    "UnknownTierError",
    "make_tier",
    "register_tier",
    "tier_from_config",
    "tier_names",
]

C = TypeVar("C", bound=msgspec.Struct)


class UnknownTierError(TieredKVError, KeyError):
    """A tier kind that the registry does not know."""

    def __init__(self, kind: str, known: list[str]) -> None:
        self.kind = kind
        super().__init__(f"unknown tier kind {kind!r}; known: {', '.join(sorted(known))}")

    def __str__(self) -> str:
        return str(self.args[0])


class TierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every built-in tier's configuration holds.

    :param capacity: the tier's byte budget
    :param name: the tier's name in metadata and events (unique within a cache)
    """

    capacity: int
    name: str


class HostMemoryConfig(TierConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """:class:`~tieredkv.HostMemoryTier` (kind ``"memory"`` or ``"host"``); the fields are
    its arguments."""

    name: str = "host"
    pin: bool | None = None
    prefault: bool = True
    max_threads: int = 2


class SSDConfig(TierConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """:class:`~tieredkv.SSDTier` (kind ``"ssd"``); the fields are its arguments, and:

    :param secret_file: a file whose bytes are the tier's ``secret`` (what a configuration
        in JSON names, rather than the secret itself); at most one of the two
    """

    directory: str
    name: str = "ssd"
    direct_io: bool | None = None
    fsync: bool = True
    max_threads: int = 4
    chunk_size: int = 8 << 20
    secret: bytes | None = None
    secret_file: str | None = None
    huge_pages: bool = True


class MmapConfig(TierConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """:class:`~tieredkv.MmapTier` (kind ``"mmap"``); the fields are its arguments."""

    path: str
    name: str = "mmap"
    keep_file: bool = False
    max_threads: int = 2


class RedisConfig(TierConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """:class:`~tieredkv.RedisTier` (kind ``"redis"``, extra ``tieredkv[redis]``); the
    fields are its arguments (``server`` a URL), and ``client_options`` the keyword
    arguments it passes to the redis client."""

    server: str
    name: str = "redis"
    prefix: str = "tieredkv"
    value_size: int = 4 << 20
    timeout: float = 10.0
    max_connections: int = 32
    lease_ttl: float = 30.0
    part_ttl: float = 300.0
    read_batch: int = 4
    recover: bool = True
    owner: str | None = None
    client_options: dict[str, Any] = msgspec.field(default_factory=dict)


def _arguments(config: msgspec.Struct) -> dict[str, Any]:
    return msgspec.structs.asdict(config)


def _memory(config: HostMemoryConfig) -> Tier:
    from .memory import HostMemoryTier

    return HostMemoryTier(**_arguments(config))


def _ssd(config: SSDConfig) -> Tier:
    from .ssd import SSDTier

    arguments = _arguments(config)
    path = arguments.pop("secret_file")
    if path is not None:
        if config.secret is not None:
            raise InvalidArgumentError(
                f"tier {config.name!r}: give 'secret' or 'secret_file', not both"
            )
        try:
            arguments["secret"] = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(
                f"tier {config.name!r}: 'secret_file' {path!r} cannot be read "
                f"({exc.strerror}); name a readable file holding the secret"
            ) from exc
    return SSDTier(**arguments)


def _mmap(config: MmapConfig) -> Tier:
    from .mmap import MmapTier

    return MmapTier(**_arguments(config))


def _redis(config: RedisConfig) -> Tier:
    from .redis import RedisTier

    arguments = _arguments(config)
    options = arguments.pop("client_options")
    clash = sorted(set(options) & set(arguments))
    if clash:
        raise InvalidArgumentError(
            f"tier {config.name!r}: 'client_options' may not repeat the tier's own keys "
            f"{clash}; set them at the top level"
        )
    return RedisTier(**arguments, **options)


_TIERS: dict[str, tuple[Callable[[Any], Tier], type[msgspec.Struct]]] = {
    "memory": (_memory, HostMemoryConfig),
    "host": (_memory, HostMemoryConfig),
    "ssd": (_ssd, SSDConfig),
    "mmap": (_mmap, MmapConfig),
    "redis": (_redis, RedisConfig),
}


def _key(kind: str) -> str:
    return kind.strip().lower().replace("_", "-")


def register_tier(name: str, factory: Callable[[C], Tier], config: type[C]) -> None:
    """Register (or replace) a kind of tier: :func:`make_tier` checks the options against
    ``config`` and calls ``factory`` with the resulting configuration.

    :param name: the kind's name (case-insensitive, ``_`` equals ``-``)
    :param factory: builds the tier from a configuration (without I/O: a tier opens later)
    :param config: the configuration's type, a :class:`msgspec.Struct` whose fields are the
        options the kind takes (the ones without a default are required)
    :raises ~tieredkv.errors.InvalidArgumentError: an empty name
    :raises ~tieredkv.errors.InvalidTypeError: ``config`` is not a Struct type, or
        ``factory`` is not callable
    """
    if not isinstance(name, str) or not _key(name):
        raise InvalidArgumentError(f"a tier kind needs a non-empty name, not {name!r}")
    if not (isinstance(config, type) and issubclass(config, msgspec.Struct)):
        raise InvalidTypeError(
            f"tier kind {name!r}: config must be a msgspec.Struct type, not {config!r}"
        )
    if not callable(factory):
        raise InvalidTypeError(f"tier kind {name!r}: factory must be callable, not {factory!r}")
    _TIERS[_key(name)] = (factory, config)


def tier_names() -> list[str]:
    """Registered tier kinds, in registration order."""
    return list(_TIERS)


def make_tier(kind: str, /, **options: Any) -> Tier:
    """A new (unopened) tier of ``kind``, configured by ``options``.

    Path-like values are taken as their path strings.

    :param kind: one of :func:`tier_names`
    :param options: the fields of the kind's configuration (``capacity``, ...)
    :raises UnknownTierError: for a kind not registered (the message lists the known ones)
    :raises ~tieredkv.errors.InvalidArgumentError: an unknown or missing option, or one of
        the wrong type (the message names it); the tier's constructor raises for a value
        out of range
    """
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"a tier kind is a name (one of {tier_names()}), not {kind!r}")
    try:
        factory, config_type = _TIERS[_key(kind)]
    except KeyError:
        raise UnknownTierError(kind, list(_TIERS)) from None
    return factory(_convert(kind, config_type, options))


def tier_from_config(config: Mapping[str, Any]) -> Tier:
    """A new (unopened) tier from a configuration: ``{"kind": ..., **options}`` (see
    :func:`make_tier`).

    :raises ~tieredkv.errors.InvalidArgumentError: ``config`` is not a mapping with a
        ``kind``, or (as :func:`make_tier`) an option is wrong
    :raises UnknownTierError: for a kind not registered
    """
    if not isinstance(config, Mapping):
        raise InvalidArgumentError(
            f"a tier config is a mapping with a 'kind' and the tier's options, not {config!r}"
        )
    options = dict(config)
    if "kind" not in options:
        raise InvalidArgumentError(
            f"a tier config needs a 'kind' (one of {tier_names()}); it has {sorted(options)}"
        )
    return make_tier(options.pop("kind"), **options)


_AT = re.compile(r"(?P<problem>.*) - at (?P<path>.*)", re.DOTALL)
"""msgspec's "Expected `int`, got `str` - at `$.capacity`" (or "- at `key` in `$.x`")."""
_KEY = re.compile(r"`\$\.(?P<key>\w+)")
_MISSING = re.compile(r"Object missing required field `(?P<key>\w+)`")


def _convert(kind: str, config_type: type[C], options: dict[str, Any]) -> C:
    """``options`` checked against ``config_type``, or an error naming the key."""
    where = f"tier config of kind {kind!r}"
    fields = config_type.__struct_fields__
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown key(s) {unknown}; it takes {sorted(fields)}")
    values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
    try:
        return msgspec.convert(values, config_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        missing = _MISSING.fullmatch(text)
        if missing is not None:
            raise InvalidArgumentError(
                f"{where}: missing required key {missing['key']!r}"
            ) from None
        at = _AT.fullmatch(text)
        key = None if at is None else _KEY.search(at["path"])
        if at is None or key is None:
            raise InvalidArgumentError(f"{where}: {text}") from None
        inside = "" if at["path"] == f"`$.{key['key']}`" else f" (at {at['path']})"
        raise InvalidArgumentError(
            f"{where}: key {key['key']!r}: {at['problem']}{inside}"
        ) from None
