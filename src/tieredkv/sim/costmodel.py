"""The simulator's cost model: models, GPUs, host memory and SSD, and what a step costs.

Everything is a roofline estimate from public numbers (``docs/explanation/simulator.md``
lists every default and its source):

- **prefill** is compute-bound: ``FLOPs / (peak * mfu)``, with FLOPs = the linear layers
  (``2 * weights`` per token) plus attention over the history;
- **decode** is memory-bound: one iteration reads the weights and every running request's
  KV once, ``(weights + KV) / (HBM bandwidth * hbm_efficiency)``, unless the batch's FLOPs
  take longer;
- **host -> GPU** transfers run over PCIe at ``pcie * link_efficiency``;
- **SSD** transfers at the SSD's bandwidth, one at a time (a shared device).

:func:`cost_efficiency` is the paper's metric for storage-efficient tensor caching: the
FLOPs a cached tensor saves per megabyte (10^6 bytes) it occupies.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..codecs import ActivationCodec, Codec, KVCodec
from ..codecs import ModelSpec as CodecModelSpec
from ..codecs.base import cost_efficiency as codec_cost_efficiency
from ..codecs.base import layer_flops_per_token

__all__ = [
    "GPUS",
    "MODELS",
    "CostModel",
    "GPUSpec",
    "ModelSpec",
    "StorageSpec",
    "cost_efficiency",
    "get_gpu",
    "get_model",
]

_FP16 = 2  # bytes per element


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A decoder-only transformer, as far as costs go (fp16 weights and KV).

    :param name: preset name
    :param layers: decoder layers
    :param hidden: hidden size d
    :param heads: attention (query) heads
    :param kv_heads: key/value heads (``heads`` for multi-head attention, fewer for GQA)
    :param ffn: feed-forward inner size
    :param gated_ffn: a gated FFN (SwiGLU: three matrices) rather than two
    :param vocab: vocabulary size (the LM head)
    :param params: parameters in total (weights read per decode iteration)
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated_ffn: bool = False
    vocab: int = 50272
    params: float

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (or V) per token per layer: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def mha(self) -> bool:
        """Multi-head attention (every head has its own K/V): storage-efficient caching pays."""
        return self.kv_heads == self.heads

    @property
    def shape(self) -> CodecModelSpec:
        """The model's shape as the codecs see it (fp16), for their byte and FLOP counts."""
        return CodecModelSpec(
            architecture="llama" if self.gated_ffn else "opt",
            layers=self.layers,
            hidden_size=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype="float16",
            ffn_size=self.ffn,
            ffn_gated=self.gated_ffn,
            rotary=self.gated_ffn,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers, fp16 (OPT-13B: 819,200)."""
        return KVCodec().bytes_per_token(self.shape)

    @property
    def activation_bytes_per_token(self) -> int:
        """The normalized activation feeding the K/V projections, one token, all layers."""
        return ActivationCodec().bytes_per_token(self.shape)

    @property
    def flops_per_token(self) -> float:
        """Linear FLOPs of one token through every layer (attention scores excluded)."""
        return float(layer_flops_per_token(self.shape))

    @property
    def layer_flops_per_token(self) -> float:
        """Linear-layer FLOPs of one layer for one token (``24 d^2`` for OPT)."""
        return self.flops_per_token / self.layers

    @property
    def reproject_flops_per_token(self) -> float:
        """FLOPs to rebuild K and V from the cached activation, one token, all layers."""
        return float(ActivationCodec().decode_flops_per_token(self.shape))

    @property
    def weight_bytes(self) -> float:
        """Bytes of the fp16 weights."""
        return self.params * _FP16

    def stored_bytes_per_token(self, codec: Literal["kv", "act"]) -> int:
        """Bytes per history token in host memory or on SSD with ``codec``."""
        return self.kv_bytes_per_token if codec == "kv" else self.activation_bytes_per_token


class GPUSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An accelerator: dense fp16 tensor peak, HBM, and its host link.

    :param name: preset name
    :param tflops: dense fp16/bf16 tensor-core peak, 10^12 FLOP/s
    :param memory_gb: HBM capacity, 10^9 bytes
    :param hbm_gbps: HBM bandwidth, 10^9 bytes/s
    :param pcie_gbps: host link bandwidth per direction, 10^9 bytes/s (spec)
    """

    name: str
    tflops: float
    memory_gb: float
    hbm_gbps: float
    pcie_gbps: float


class StorageSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The two cache tiers below the GPU.

    :param host_gb: host memory for history KV, 10^9 bytes (the performance layer)
    :param ssd_gbps: SSD bandwidth, 10^9 bytes/s, shared by reads and writes
    :param ssd_latency: fixed seconds per SSD transfer
    """

    host_gb: float = 200.0
    ssd_gbps: float = 1.5
    ssd_latency: float = 0.0


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(name="opt-6.7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=16384,
                  params=6.7e9),
        ModelSpec(name="opt-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=20480,
                  params=12.9e9),
        ModelSpec(name="opt-30b", layers=48, hidden=7168, heads=56, kv_heads=56, ffn=28672,
                  params=30.0e9),
        ModelSpec(name="qwen-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008,
                  gated_ffn=True, vocab=151936, params=7.7e9),
        ModelSpec(name="qwen-14b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13696,
                  gated_ffn=True, vocab=152064, params=14.2e9),
        ModelSpec(name="llama-3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                  gated_ffn=True, vocab=128256, params=8.03e9),
    )
}  # fmt: skip
"""Model presets (Hugging Face configs of each model; ``params`` from the model cards)."""

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        # A800 80GB PCIe = A100 80GB PCIe compute and memory (NVLink cut only).
        GPUSpec(name="a800", tflops=312.0, memory_gb=80.0, hbm_gbps=1935.0, pcie_gbps=32.0),
        GPUSpec(name="h100", tflops=989.0, memory_gb=80.0, hbm_gbps=3350.0, pcie_gbps=64.0),
        GPUSpec(name="h200", tflops=989.0, memory_gb=141.0, hbm_gbps=4800.0, pcie_gbps=64.0),
    )
}
"""GPU presets (NVIDIA data sheets: dense fp16 tensor peak, HBM, PCIe 4.0/5.0 x16)."""


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive).

    :raises ValueError: for an unknown name (the message lists the presets)
    """
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None


def get_gpu(name: str) -> GPUSpec:
    """The GPU preset ``name`` (case-insensitive).

    :raises ValueError: for an unknown name (the message lists the presets)
    """
    try:
        return GPUS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}") from None


def cost_efficiency(model: ModelSpec, tensor: Literal["kv", "act"]) -> float:
    """FLOPs saved per MB (10^6 bytes) of cache, in GFLOP/MB, per the Bidaw paper.

    Caching K and V (``4 d`` bytes per token per layer for MHA) saves the whole layer's
    linear work; caching the normalized activation (``2 d`` bytes) saves the same minus
    re-projecting K and V (``4 d^2`` for MHA). OPT-13B: about 30.7 and 51.2 (the paper
    rounds to 30.5 and 51.0).

    :param tensor: ``"kv"`` or ``"act"`` (the normalized activation)
    """
    codec: Codec = KVCodec() if tensor == "kv" else ActivationCodec()
    return codec_cost_efficiency(codec, model.shape) * 1e6 / 1e9


class CostModel:
    """Times of the engine's steps for one model on one GPU.

    :param model: the model
    :param gpu: the GPU
    :param mfu: fraction of the tensor peak a prefill reaches
    :param hbm_efficiency: fraction of HBM bandwidth a decode iteration reaches
    :param link_efficiency: fraction of the PCIe spec a host -> GPU copy reaches
    :param gpu_memory_utilization: fraction of HBM the engine may use (weights + KV)
    :param iteration_overhead: fixed seconds per engine iteration (scheduling, launches)
    """

    __slots__ = (
        "_attention",
        "_compute",
        "_flops_token",
        "_kv_s",
        "_link",
        "gpu",
        "gpu_kv_tokens",
        "hbm_efficiency",
        "iteration_overhead",
        "link_efficiency",
        "mfu",
        "model",
        "weights_s",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        *,
        mfu: float = 0.5,
        hbm_efficiency: float = 0.7,
        link_efficiency: float = 0.8,
        gpu_memory_utilization: float = 0.9,
        iteration_overhead: float = 0.002,
    ) -> None:
        for label, value in (
            ("mfu", mfu),
            ("hbm_efficiency", hbm_efficiency),
            ("link_efficiency", link_efficiency),
            ("gpu_memory_utilization", gpu_memory_utilization),
        ):
            if not 0 < value <= 1:
                raise ValueError(f"{label} must be in (0, 1] (got {value})")
        if iteration_overhead < 0:
            raise ValueError(f"iteration_overhead must be >= 0 s (got {iteration_overhead})")
        self.model = model
        self.gpu = gpu
        self.mfu = mfu
        self.hbm_efficiency = hbm_efficiency
        self.link_efficiency = link_efficiency
        self.iteration_overhead = iteration_overhead
        free = gpu.memory_gb * 1e9 * gpu_memory_utilization - model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                f"{gpu.name} ({gpu.memory_gb:.0f} GB); pick a larger GPU"
            )
        self.gpu_kv_tokens = int(free // model.kv_bytes_per_token)
        """Tokens of K/V the GPU holds for running requests."""
        hbm = gpu.hbm_gbps * 1e9 * hbm_efficiency
        self.weights_s = model.weight_bytes / hbm
        """Seconds to stream the weights once (the floor of a decode iteration)."""
        self._kv_s = model.kv_bytes_per_token / hbm
        self._compute = gpu.tflops * 1e12 * mfu
        self._link = gpu.pcie_gbps * 1e9 * link_efficiency
        self._flops_token = model.flops_per_token  # a property that walks the codec: cache it
        self._attention = 4.0 * model.layers * model.hidden

    def prefill_flops(self, new: int, history: int) -> float:
        """FLOPs to compute ``new`` tokens after ``history`` cached ones (linear layers
        plus attention scores, ``4 d`` FLOPs per token pair per layer)."""
        pairs = new * history + new * (new + 1) / 2
        return new * self._flops_token + self._attention * pairs

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` at the prefill rate ``tflops * mfu``."""
        return flops / self._compute

    def decode_iteration(self, batch: int, kv_tokens: float) -> float:
        """Seconds for one decode iteration of ``batch`` requests holding ``kv_tokens``."""
        memory = self.weights_s + kv_tokens * self._kv_s
        compute = batch * self._flops_token / self._compute
        return max(memory, compute) + self.iteration_overhead

    @property
    def kv_token_s(self) -> float:
        """Seconds a decode iteration spends per K/V token held."""
        return self._kv_s

    def decode_compute_s(self, batch: int) -> float:
        """Seconds of tensor work for one decode iteration of ``batch`` requests."""
        return batch * self._flops_token / self._compute

    def link_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from host memory to the GPU."""
        return nbytes / self._link
