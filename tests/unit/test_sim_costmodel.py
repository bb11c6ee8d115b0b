"""The cost model: byte sizes, the paper's cost-efficiency figures, step times."""

from __future__ import annotations

import pytest

from tieredkv.sim.costmodel import (
    GPUS,
    MODELS,
    CostModel,
    cost_efficiency,
    get_gpu,
    get_model,
)


def test_opt_13b_kv_is_819200_bytes_per_token() -> None:
    m = get_model("OPT-13B")
    assert m.kv_bytes_per_token == 819_200
    assert m.activation_bytes_per_token == 819_200 // 2
    assert m.mha


@pytest.mark.parametrize(("tensor", "paper"), [("kv", 30.5), ("act", 51.0)])
def test_cost_efficiency_matches_the_paper_for_opt_13b(tensor: str, paper: float) -> None:
    value = cost_efficiency(get_model("opt-13b"), tensor)  # type: ignore[arg-type]
    assert value == pytest.approx(paper, rel=0.02)


def test_activation_pays_only_for_mha_models() -> None:
    for m in MODELS.values():
        act_denser = cost_efficiency(m, "act") > cost_efficiency(m, "kv")
        smaller = m.activation_bytes_per_token < m.kv_bytes_per_token
        assert act_denser == smaller == m.mha, m.name
    assert not get_model("llama-3-8b").mha


def test_opt_linear_flops_are_24_d_squared_per_layer() -> None:
    m = get_model("opt-13b")
    assert m.layer_flops_per_token == 24 * 5120**2


def test_step_times_follow_the_roofline() -> None:
    cost = CostModel(get_model("opt-13b"), get_gpu("a800"), mfu=0.5, iteration_overhead=0.0)
    # prefill is compute-bound: twice the tokens, about twice the time
    t1 = cost.compute_time(cost.prefill_flops(1000, 0))
    t2 = cost.compute_time(cost.prefill_flops(2000, 0))
    assert 1.9 < t2 / t1 < 2.2
    assert 0.1 < t1 < 0.3  # 26 TFLOP at 156 TFLOP/s
    # decode is memory-bound: the weights alone take weights / (HBM * efficiency)
    assert cost.decode_iteration(1, 0) == pytest.approx(12.9e9 * 2 / (1935e9 * 0.7))
    assert cost.decode_iteration(8, 10_000) > cost.decode_iteration(8, 0)
    assert cost.link_time(25.6e9) == pytest.approx(1.0)
    assert cost.gpu_kv_tokens * 819_200 <= 80e9 * 0.9 - 25.8e9


def test_presets_and_errors() -> None:
    assert {"a800", "h100", "h200"} <= set(GPUS)
    assert {"opt-6.7b", "opt-13b", "opt-30b", "qwen-7b", "qwen-14b", "llama-3-8b"} <= set(MODELS)
    with pytest.raises(ValueError, match=r"presets: opt-6\.7b"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("tpu")
    with pytest.raises(ValueError, match="mfu"):
        CostModel(get_model("opt-13b"), get_gpu("a800"), mfu=0)
    small = get_gpu("a800").__class__(
        name="tiny", tflops=1, memory_gb=16, hbm_gbps=100, pcie_gbps=16
    )
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(get_model("opt-30b"), small)
