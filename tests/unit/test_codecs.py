"""Codecs without a model library: layouts, exact costs, encode/decode against a fake model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tieredkv.codecs import (
    ActivationCodec,
    Codec,
    CodecInputError,
    KVCodec,
    ModelAccess,
    ModelSpec,
    TurnTensors,
    cost_efficiency,
    layer_flops_per_token,
    layer_groups,
    missing_members,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY_OPT = ModelSpec(
    architecture="opt",
    layers=2,
    hidden_size=64,
    heads=4,
    kv_heads=4,
    head_dim=16,
    dtype="float32",
    ffn_size=128,
)
TINY_GQA = ModelSpec(
    architecture="llama",
    layers=2,
    hidden_size=64,
    heads=4,
    kv_heads=1,
    head_dim=16,
    dtype="float32",
    ffn_size=128,
    ffn_gated=True,
    rotary=True,
)
OPT_13B = ModelSpec(
    architecture="opt",
    layers=40,
    hidden_size=5120,
    heads=40,
    kv_heads=40,
    head_dim=128,
    dtype="float16",
    ffn_size=4 * 5120,
)


class FakeModel:
    """Random K/V projections (with biases); a rotary stand-in that adds the position."""

    def __init__(self, spec: ModelSpec, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(0)
        d, kv = spec.hidden_size, spec.kv_size
        self._spec = spec
        self.weights = [
            tuple(
                torch.randn(*shape, generator=g).to(device)
                for shape in ((kv, d), (kv,), (kv, d), (kv,))
            )
            for _ in range(spec.layers)
        ]

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wk, bk, wv, bv = self.weights[layer]
        shape = (activation.shape[0], self._spec.kv_heads, self._spec.head_dim)
        k = F.linear(activation, wk, bk).view(shape).transpose(0, 1)
        v = F.linear(activation, wv, bv).view(shape).transpose(0, 1)
        if self._spec.rotary:
            k = k + positions.to(k.dtype)[None, :, None]
        return k, v


class WrongShape(FakeModel):
    """A model access that re-projects to one head too few."""

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().project_kv(layer, activation, positions)
        return k[1:], v[1:]


def activations(spec: ModelSpec, tokens: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(tokens, spec.hidden_size, generator=g).to(device) for _ in range(spec.layers)
    ]


def random_kv(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two layers' K and V of 5 tokens for :data:`TINY_OPT`."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(4, 5, 16, generator=g) for _ in range(2)]
    values = [torch.randn(4, 5, 16, generator=g) for _ in range(2)]
    return keys, values


def test_both_codecs_implement_the_protocol() -> None:
    assert isinstance(KVCodec(), Codec)
    assert isinstance(ActivationCodec(), Codec)
    assert isinstance(FakeModel(TINY_OPT), ModelAccess)


def test_each_codec_says_whether_it_decodes_in_place() -> None:
    assert KVCodec().decodes_in_place
    assert not ActivationCodec().decodes_in_place
    assert missing_members(KVCodec()) == missing_members(ActivationCodec()) == []
    assert "decode_layer" in missing_members(FakeModel(TINY_OPT))


def test_layer_groups_split_the_layout_per_layer_in_order() -> None:
    assert layer_groups(KVCodec(), TINY_OPT) == [
        ["layers.0.k", "layers.0.v"],
        ["layers.1.k", "layers.1.v"],
    ]
    assert layer_groups(ActivationCodec(), TINY_GQA) == [["layers.0.act"], ["layers.1.act"]]

    class Uneven(KVCodec):
        def layout(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
            return {"layers.0.k": (4, -1, 16), "layers.0.v": (4, -1, 16), "layers.1.k": (4, -1, 16)}

    with pytest.raises(CodecInputError, match="not the same number for each of the 2 layers"):
        layer_groups(Uneven(), TINY_OPT)


def test_decode_layer_gives_what_decode_gives_for_that_layer() -> None:
    keys, values = random_kv(4)
    kv = KVCodec()
    stored = kv.encode(TurnTensors(keys, values), TINY_OPT)
    for i, group in enumerate(layer_groups(kv, TINY_OPT)):
        k, v = kv.decode_layer({n: stored[n] for n in group}, FakeModel(TINY_OPT), i)
        assert k is stored[f"layers.{i}.k"]  # in place: the stored tensors themselves
        assert v is stored[f"layers.{i}.v"]
    act = ActivationCodec()
    model = FakeModel(TINY_GQA)
    stored = act.encode(TurnTensors([], [], activations(TINY_GQA, 6)), TINY_GQA)
    whole = act.decode(stored, model, start=7)
    for i, group in enumerate(layer_groups(act, TINY_GQA)):
        k, v = act.decode_layer({n: stored[n] for n in group}, model, i, start=7)
        assert torch.equal(k, whole[i][0])
        assert torch.equal(v, whole[i][1])
    with pytest.raises(CodecInputError, match="do not fit this model"):
        act.decode_layer(stored, model, 0)  # every layer's names, not layer 0's alone
    with pytest.raises(CodecInputError, match=r"expected \[tokens, 64\]"):
        act.decode_layer({"layers.1.act": torch.zeros(3, 32)}, model, 1)


def test_fingerprint_names_every_shape_fact() -> None:
    assert TINY_OPT.fingerprint == "opt-L2-d64-h4-kv4-hd16-float32"
    assert TINY_GQA.fingerprint == "llama-L2-d64-h4-kv1-hd16-float32"


def test_bytes_per_token_are_exact() -> None:
    # K/V: 2 * L * kv_heads * head_dim * itemsize; activation: L * d * itemsize
    assert KVCodec().bytes_per_token(TINY_OPT) == 2 * 2 * 64 * 4 == 1024
    assert ActivationCodec().bytes_per_token(TINY_OPT) == 2 * 64 * 4 == 512
    assert KVCodec().bytes_per_token(TINY_GQA) == 2 * 2 * 16 * 4 == 256
    assert ActivationCodec().bytes_per_token(TINY_GQA) == 512
    # OPT-13B in fp16: the paper's "800 KB per token" (40 layers x 5120 x 2 x 2 bytes)
    assert KVCodec().bytes_per_token(OPT_13B) == 40 * 5120 * 2 * 2 == 819_200
    assert ActivationCodec().bytes_per_token(OPT_13B) == 409_600


def test_decode_flops_are_the_two_projections() -> None:
    assert KVCodec().decode_flops_per_token(TINY_OPT) == 0
    # 2 FLOPs per multiply-add, K and V: 4 d^2 per layer for MHA
    assert ActivationCodec().decode_flops_per_token(TINY_OPT) == 2 * 4 * 64 * 64
    assert ActivationCodec().decode_flops_per_token(TINY_GQA) == 2 * 4 * 64 * 16


def test_opt_13b_cost_efficiency_matches_the_paper() -> None:
    d = 5120
    assert layer_flops_per_token(OPT_13B) == 40 * 24 * d * d
    kv = cost_efficiency(KVCodec(), OPT_13B) / 1000  # GFLOP per MB (10^6 bytes)
    act = cost_efficiency(ActivationCodec(), OPT_13B) / 1000
    assert kv == pytest.approx(6 * d / 1000)  # 24 d^2 / 4d bytes = 30.72
    assert act == pytest.approx(10 * d / 1000)  # (24 - 4) d^2 / 2d bytes = 51.2
    # the paper reports 30.5 and 51.0 GFLOP/MB: the same within 1%
    assert kv == pytest.approx(30.5, rel=0.01)
    assert act == pytest.approx(51.0, rel=0.01)


def test_kv_codec_round_trips_as_is() -> None:
    keys, values = random_kv(2)
    codec = KVCodec()
    stored = codec.encode(TurnTensors(keys, values), TINY_OPT)
    assert sorted(stored) == sorted(codec.layout(TINY_OPT))
    assert codec.layout(TINY_OPT)["layers.1.v"] == (4, -1, 16)
    assert codec.token_dim(TINY_OPT) == 1
    decoded = codec.decode(stored, FakeModel(TINY_OPT))
    for (k, v), k0, v0 in zip(decoded, keys, values, strict=True):
        assert torch.equal(k, k0)
        assert torch.equal(v, v0)


def test_activation_codec_reprojects_with_bias_and_rotary_positions() -> None:
    model = FakeModel(TINY_GQA)
    codec = ActivationCodec()
    acts = activations(TINY_GQA, 6)
    stored = codec.encode(TurnTensors([], [], acts), TINY_GQA)
    assert codec.layout(TINY_GQA) == {"layers.0.act": (-1, 64), "layers.1.act": (-1, 64)}
    assert codec.token_dim(TINY_GQA) == 0
    decoded = codec.decode(stored, model, start=10)
    for (k, v), x, (wk, bk, wv, bv) in zip(decoded, acts, model.weights, strict=True):
        want_k = F.linear(x, wk, bk).view(6, 1, 16).transpose(0, 1)
        want_k = want_k + torch.arange(10, 16, dtype=torch.float32)[None, :, None]
        want_v = F.linear(x, wv, bv).view(6, 1, 16).transpose(0, 1)
        assert k.shape == v.shape == (1, 6, 16)
        torch.testing.assert_close(k, want_k)
        torch.testing.assert_close(v, want_v)


def test_activation_codec_without_captured_activations_is_a_clear_error() -> None:
    keys = [torch.zeros(4, 3, 16)] * 2
    with pytest.raises(CodecInputError, match="no activations were captured"):
        ActivationCodec().encode(TurnTensors(keys, keys), TINY_OPT)


def test_wrong_shapes_and_layer_counts_are_refused() -> None:
    with pytest.raises(CodecInputError, match="1 layers, the model has 2"):
        ActivationCodec().encode(TurnTensors([], [], [torch.zeros(3, 64)]), TINY_OPT)
    with pytest.raises(CodecInputError, match=r"expected \[tokens, 64\]"):
        ActivationCodec().encode(TurnTensors([], [], [torch.zeros(3, 32)] * 2), TINY_OPT)
    bad = [torch.zeros(2, 3, 16)] * 2
    with pytest.raises(CodecInputError, match=r"expected \[4, tokens, 16\]"):
        KVCodec().encode(TurnTensors(bad, bad), TINY_OPT)
    with pytest.raises(CodecInputError, match="do not fit this model"):
        ActivationCodec().decode({"layers.0.act": torch.zeros(3, 64)}, FakeModel(TINY_OPT))
    with pytest.raises(CodecInputError, match="do not fit this model"):
        KVCodec().decode({"layers.0.k": torch.zeros(4, 3, 16)}, FakeModel(TINY_OPT))
    stored = ActivationCodec().encode(TurnTensors([], [], activations(TINY_OPT, 3)), TINY_OPT)
    with pytest.raises(CodecInputError, match=r"re-projected layer 0 to K \(3, 3, 16\)"):
        ActivationCodec().decode(stored, WrongShape(TINY_OPT))


@pytest.mark.cuda
@requires_cuda
def test_activation_decode_on_cuda_runs_on_a_low_priority_stream_and_matches_cpu() -> None:
    codec = ActivationCodec()
    cpu = codec.decode(
        codec.encode(TurnTensors([], [], activations(TINY_GQA, 7)), TINY_GQA),
        FakeModel(TINY_GQA),
        start=3,
    )
    stored = codec.encode(TurnTensors([], [], activations(TINY_GQA, 7, "cuda")), TINY_GQA)
    gpu = codec.decode(stored, FakeModel(TINY_GQA, "cuda"), start=3)
    torch.cuda.synchronize()
    stream = codec._stream(torch.device("cuda"))
    assert stream != torch.cuda.current_stream()
    assert stream.priority == max(stream.priority_range())  # the least urgent
    for (k, v), (k0, v0) in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(k.cpu(), k0, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v.cpu(), v0, rtol=1e-4, atol=1e-4)
