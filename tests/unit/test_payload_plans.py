"""plan_segment reuses the checks, schema and layout of tensors like the last few it
planned (the common case in serving: every turn of a model has the same tensors but for
their token count), and never a layout that does not fit: a turn whose tensors differ in
any name, order, dtype, shape, token count, stride, device, token dimension or codec is
planned, written and refused exactly as with nothing remembered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tieredkv.payload import SegmentPlan, plan_segment, segment_tensors, verify_segment
from tieredkv.payload._encode import _layouts


def _turn(tokens: int = 6, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 4, 8, generator=gen),
        "v": torch.randint(-100, 100, (tokens, 4, 8), dtype=torch.int16, generator=gen),
        "big": torch.randn(tokens, 4096, generator=gen),  # >= LAND_MIN: landing-aligned
    }


def _plan(tensors: dict[str, Any], session: str = "s", seq: int = 0, **kw: Any) -> SegmentPlan:
    kw.setdefault("token_dim", 0)
    return plan_segment(session, seq, tensors, answer_tokens=seq + 1, created=12.5, **kw)


def _written(plan: SegmentPlan) -> bytearray:
    buf = bytearray(plan.length)
    plan.write_into(memoryview(buf))
    return buf


def _outcome(
    make: Callable[[], SegmentPlan],
) -> tuple[str, bytes, bytearray] | tuple[str, str]:
    """What planning gives: the header bytes and the written segment, or the error."""
    try:
        plan = make()
    except Exception as exc:  # compared below, type and message
        return type(exc).__name__, str(exc)
    return "plan", plan.header_bytes, _written(plan)


@pytest.fixture(autouse=True)
def _forget() -> None:
    _layouts.clear()


def test_a_turn_like_the_last_reuses_its_layout_and_writes_the_same_bytes() -> None:
    first = _plan(_turn(seed=1), "conv-a", 0)
    again = _plan(_turn(seed=2), "conv-b", 7, base=(("conv-a", 0, 6),))
    assert again.schema is first.schema  # the remembered layout (a new one before)
    assert again.header.tensors is first.header.tensors
    remembered = _written(again)
    _layouts.clear()
    fresh = _plan(_turn(seed=2), "conv-b", 7, base=(("conv-a", 0, 6),))
    assert fresh.schema is not first.schema
    assert (again.header_bytes, remembered) == (fresh.header_bytes, _written(fresh))
    header = verify_segment(memoryview(remembered), "test")
    assert (header.session, header.seq, header.base) == ("conv-b", 7, (("conv-a", 0, 6),))
    got = segment_tensors(memoryview(remembered), header)
    for name, tensor in _turn(seed=2).items():
        assert torch.equal(got[name], tensor)


def test_a_turn_of_another_length_is_laid_out_anew_from_the_remembered_checks() -> None:
    first = _plan(_turn(tokens=6, seed=1))
    longer = _plan(_turn(tokens=40, seed=2), "s", 1)
    assert longer.schema is first.schema  # remembered (a new one before)
    assert [s.shape[0] for s in longer.header.tensors] == [40, 40, 40]
    remembered = _written(longer)
    _layouts.clear()
    fresh = _plan(_turn(tokens=40, seed=2), "s", 1)
    assert (longer.header_bytes, remembered) == (fresh.header_bytes, _written(fresh))
    got = segment_tensors(memoryview(remembered), verify_segment(memoryview(remembered), "t"))
    assert all(torch.equal(got[n], v) for n, v in _turn(tokens=40, seed=2).items())


def _strided(t: dict[str, Any]) -> dict[str, Any]:
    # the same shape, but every tensor a non-contiguous view (other strides)
    return {n: v.transpose(0, 1).contiguous().transpose(0, 1) for n, v in t.items()}


def _meta(t: dict[str, Any]) -> dict[str, Any]:
    return {**t, "v": torch.empty_like(t["v"], device="meta")}


def _sparse(t: dict[str, Any]) -> dict[str, Any]:
    return {**t, "k": t["k"].to_sparse()}


def _grad(t: dict[str, Any]) -> dict[str, Any]:
    return {**t, "k": t["k"].clone().requires_grad_(True)}


VARIANTS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], dict[str, Any]]] = {
    "same": (lambda t: t, {}),
    "other token count": (lambda t: _turn(tokens=9, seed=3), {}),
    "a name differs": (lambda t: {("K" if n == "k" else n): v for n, v in t.items()}, {}),
    "names reordered": (lambda t: {n: t[n] for n in ("v", "k", "big")}, {}),
    "a dtype differs": (lambda t: {**t, "k": t["k"].to(torch.float16)}, {}),
    "a non-token shape differs": (lambda t: {**t, "k": t["k"].reshape(6, 8, 4)}, {}),
    "other strides": (_strided, {}),
    "a tensor on the meta device": (_meta, {}),
    "a sparse tensor": (_sparse, {}),
    "a tensor that requires grad": (_grad, {}),
    "a numpy array": (lambda t: {**t, "v": t["v"].numpy()}, {}),
    "a token count mismatch": (lambda t: {**t, "v": t["v"][:5]}, {}),
    "no tokens": (lambda t: {n: v[:0] for n, v in t.items()}, {}),
    "token_dim out of range": (lambda t: t, {"token_dim": 3}),
    "another codec": (lambda t: t, {"codec": "kv-fp8"}),
    "token_dim counted from the end": (lambda t: t, {"token_dim": -2}),
    "token_dim as a bool": (lambda t: t, {"token_dim": False}),
    "another token dimension": (lambda t: {n: v.transpose(0, 1) for n, v in t.items()}, {}),
    "an empty name": (lambda t: {**t, "": t["k"]}, {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_differing_turn_is_planned_as_with_nothing_remembered(variant: str) -> None:
    change, kw = VARIANTS[variant]
    base = _turn()
    for codec in ("kv", "kv-fp8"):  # remember the base layout under both codecs
        _plan(base, codec=codec)
    make = lambda: _plan(change(_turn()), "other", 3, **kw)  # noqa: E731
    warm = _outcome(make)
    _layouts.clear()
    cold = _outcome(make)
    assert warm == cold
    if variant in ("a tensor on the meta device", "a sparse tensor", "token_dim as a bool"):
        assert warm[0] in ("InvalidTypeError", "InvalidArgumentError")
    if variant in ("a token count mismatch", "no tokens", "token_dim out of range"):
        assert warm[0] == "InvalidArgumentError"


def test_a_tensor_that_requires_grad_is_stored_detached() -> None:
    _plan(_turn())
    plan = _plan(_grad(_turn()))
    assert not any(t.requires_grad for t in plan.tensors)
    written = _written(plan)
    header = verify_segment(memoryview(written), "test")
    assert torch.equal(segment_tensors(memoryview(written), header)["k"], _turn()["k"])


def test_the_memory_is_bounded_and_keeps_the_latest() -> None:
    turns = [{"k": torch.zeros(2, n + 1)} for n in range(_layouts.MAX + 4)]
    for t in turns:
        _plan(t)
    assert len(_layouts._layouts) == _layouts.MAX
    latest = _plan(turns[-1])
    assert _plan(turns[-1]).schema is latest.schema
    oldest = _plan(turns[0])  # forgotten, so planned anew
    assert (
        oldest.schema
        == plan_segment(
            "s", 0, {"k": np.zeros((2, 1), dtype=np.float32)}, token_dim=0, answer_tokens=1
        ).schema
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_tensors_on_a_cuda_device_are_planned_as_with_nothing_remembered() -> None:
    _plan(_turn())  # remembered on the CPU
    make = lambda: _plan({n: v.cuda() for n, v in _turn().items()})  # noqa: E731
    warm = _outcome(make)
    _layouts.clear()
    assert warm == _outcome(make)
    assert warm[0] == "plan"
