"""Codecs: what tieredkv stores per token of a conversation (K/V, or the activation that
feeds the K/V projections), and what each costs. See :mod:`tieredkv.codecs.base`."""

from __future__ import annotations

from .activation import ActivationCodec as ActivationCodec
from .base import Codec as Codec
from .base import CodecInputError as CodecInputError
from .base import ModelAccess as ModelAccess
from .base import ModelSpec as ModelSpec
from .base import TurnTensors as TurnTensors
from .base import cost_efficiency as cost_efficiency
from .base import layer_flops_per_token as layer_flops_per_token
from .base import layer_groups as layer_groups
from .base import missing_members as missing_members
from .kv import KVCodec as KVCodec

__all__ = [
    "ActivationCodec",
    "Codec",
    "CodecInputError",
    "KVCodec",
    "ModelAccess",
    "ModelSpec",
    "TurnTensors",
    "cost_efficiency",
    "layer_flops_per_token",
    "layer_groups",
    "missing_members",
]
