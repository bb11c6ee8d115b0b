"""Re-projection: K and V rebuilt from a stored activation, as a registered family's
attention computes them (:class:`~tieredkv.codecs.ModelAccess` for the activation codec).

:class:`ArchitectureAccess` checks an :class:`~tieredkv.integrations.architectures.Architecture`
entry against the model's modules when it is built, and :meth:`ArchitectureAccess.check`
re-projects a probe's activations against the K/V the probe cached: a wrong entry is an
error there, never a wrong answer later. :class:`KVOnlyAccess` is the access of a model
the activation codec is not offered for.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...codecs import ModelSpec
from ..architectures import Architecture
from .errors import ArchitectureMismatchError, UnsupportedModelError
from .probe import PROBE_TOKENS, Probe

__all__ = ["ArchitectureAccess", "KVOnlyAccess", "k_modules"]


def _decoder_layers(model: Any, entry: Architecture, count: int | None = None) -> Any:
    """The decoder's list of layers that ``entry`` names (of ``count`` layers, if given)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, entry.layers, None)
    if not isinstance(layers, torch.nn.ModuleList) or count not in (None, len(layers)):
        of = f"{count} layers" if count is not None else "layers"
        raise ArchitectureMismatchError(
            entry.model_type, f"its decoder has no {entry.layers!r} list of {of}"
        )
    return layers


def k_modules(model: Any, entry: Architecture) -> list[torch.nn.Module]:
    """Each decoder layer's K projection module, as ``entry`` locates it (what
    :class:`~tieredkv.integrations.transformers.ActivationCapture` hooks)."""
    found: list[torch.nn.Module] = []
    for i, layer in enumerate(_decoder_layers(model, entry)):
        proj = getattr(getattr(layer, entry.attention, None), entry.k_proj, None)
        if not isinstance(proj, torch.nn.Linear):
            raise ArchitectureMismatchError(
                entry.model_type,
                f"layer {i} has no nn.Linear {entry.attention}.{entry.k_proj}",
            )
        found.append(proj)
    return found


class KVOnlyAccess:
    """The :class:`~tieredkv.codecs.ModelAccess` of a model the activation codec is not
    offered for: its shape, and nothing to re-project with."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise UnsupportedModelError(
            f"the activation codec is not offered for this {self._spec.architecture!r} model"
        )


class ArchitectureAccess(KVOnlyAccess):
    """:class:`~tieredkv.codecs.ModelAccess` for a model of a registered architecture.

    Checks the entry against the model's modules at construction; re-projection reads the
    model's weights and calls its norm and rotary modules (whose state is left as is: the
    adapter never offers this for RoPE types that rewrite it)."""

    def __init__(self, model: Any, spec: ModelSpec, entry: Architecture) -> None:
        super().__init__(spec)
        self._entry = entry
        self._attn: list[Any] = []
        self._k: list[torch.nn.Linear] = []
        self._v: list[torch.nn.Linear] = []
        for i, layer in enumerate(_decoder_layers(model, entry, spec.layers)):
            attn = getattr(layer, entry.attention, None)
            if not isinstance(attn, torch.nn.Module):
                raise self._mismatch(f"layer {i} has no attention module {entry.attention!r}")
            self._k.append(self._projection(i, attn, entry.k_proj))
            self._v.append(self._projection(i, attn, entry.v_proj))
            self._check_k_norm(i, attn)
            self._attn.append(attn)
        self._clip: float | None = None
        if entry.clip_qkv:
            clip = getattr(model.config, "clip_qkv", None)
            self._clip = float(clip) if clip is not None else None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._rotary: Any = getattr(decoder, "rotary_emb", None)
        self._apply: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._layer_types: list[str] | None = None
        if entry.rotary == "none":
            if self._rotary is not None:
                raise self._mismatch("the decoder has a rotary_emb module, the entry no rotary")
            return
        if not isinstance(self._rotary, torch.nn.Module):
            raise self._mismatch("its decoder has no rotary_emb module")
        apply = getattr(sys.modules[type(self._attn[0]).__module__], "apply_rotary_pos_emb", None)
        if not callable(apply):
            raise self._mismatch("its modeling module has no apply_rotary_pos_emb function")
        self._apply = apply
        layer_types = getattr(model.config, "layer_types", None)
        if layer_types and "layer_type" in inspect.signature(self._rotary.forward).parameters:
            self._layer_types = list(layer_types)

    def _mismatch(self, detail: str) -> ArchitectureMismatchError:
        return ArchitectureMismatchError(self._spec.architecture, detail)

    def _projection(self, i: int, attn: torch.nn.Module, name: str) -> torch.nn.Linear:
        spec = self._spec
        proj = getattr(attn, name, None)
        if not isinstance(proj, torch.nn.Linear):
            raise self._mismatch(f"layer {i}'s attention has no nn.Linear {name!r}")
        if tuple(proj.weight.shape) != (spec.kv_size, spec.hidden_size):
            raise self._mismatch(
                f"layer {i}'s {name} weight is {tuple(proj.weight.shape)}, not "
                f"[kv_heads * head_dim, hidden_size] = {(spec.kv_size, spec.hidden_size)}"
            )
        return proj

    def _check_k_norm(self, i: int, attn: torch.nn.Module) -> None:
        entry, spec = self._entry, self._spec
        norms = sorted(n for n, _ in attn.named_children() if "norm" in n.lower())
        if entry.k_norm == "none":
            if norms:
                raise self._mismatch(f"layer {i}'s attention has {norms}, the entry no K norm")
            return
        norm = getattr(attn, "k_norm", None)
        weight = getattr(norm, "weight", None)
        want = spec.head_dim if entry.k_norm == "head" else spec.kv_size
        if not isinstance(norm, torch.nn.Module) or (
            isinstance(weight, torch.Tensor) and weight.shape[-1] != want
        ):
            raise self._mismatch(
                f"layer {i}'s attention has no k_norm over {want} features "
                f"(k_norm={entry.k_norm!r})"
            )

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec, entry = self._spec, self._entry
        kp, vp = self._k[layer], self._v[layer]
        x = activation.to(kp.weight.dtype)
        tokens = x.shape[0]
        k = F.linear(x, kp.weight, kp.bias)
        v = F.linear(x, vp.weight, vp.bias)
        if self._clip is not None:
            k, v = k.clamp(-self._clip, self._clip), v.clamp(-self._clip, self._clip)
        attn = self._attn[layer]
        if entry.k_norm == "full":
            k = attn.k_norm(k)
        k = k.view(tokens, spec.kv_heads, spec.head_dim)
        if entry.k_norm == "head":
            k = attn.k_norm(k)
        k = k.transpose(0, 1)
        v = v.view(tokens, spec.kv_heads, spec.head_dim).transpose(0, 1)
        if self._apply is None:
            return k, v
        args: tuple[Any, ...] = (x[None], positions[None])
        if self._layer_types is not None:
            args += (self._layer_types[layer],)
        cos, sin = self._rotary(*args)
        k4 = k[None]
        if entry.rotary == "partial":
            rot = cos.shape[-1]
            _, turned = self._apply(k4[..., :rot], k4[..., :rot], cos, sin)
            k4 = torch.cat([turned, k4[..., rot:]], dim=-1)
        else:
            _, k4 = self._apply(k4, k4, cos, sin)
        return k4[0], v

    def check(self, probe: Probe) -> None:
        """Re-project the probe's activations and compare them with its cached K/V."""
        assert probe.activations is not None
        tol = 1e-3 if probe.dtype == "float32" else 5e-2
        positions = torch.arange(PROBE_TOKENS, device=probe.keys[0].device)
        with torch.no_grad():
            for i, act in enumerate(probe.activations):
                k, v = self.project_kv(i, act, positions)
                for name, got, want in (("K", k, probe.keys[i]), ("V", v, probe.values[i])):
                    got = got[:, got.shape[1] - want.shape[1] :]
                    scale = max(1.0, float(want.abs().max()))
                    err = float((got.float() - want.float()).abs().max())
                    if err > tol * scale:
                        raise ArchitectureMismatchError(
                            self._spec.architecture,
                            f"re-projecting layer {i}'s activation does not give the {name} "
                            f"the model cached (largest difference {err:.3g})",
                        )
