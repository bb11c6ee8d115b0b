"""plan_segment refuses what it cannot store, with a TieredKVError that is also the
matching built-in: out-of-range counts, tensors without data (meta), sparse tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tieredkv.errors import InvalidArgumentError, InvalidTypeError, TieredKVError
from tieredkv.payload import MAX_COUNT, parse_header, plan_segment


def kv(**overrides: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"k": torch.randn(4, 8, generator=g), "v": torch.randn(4, 8, generator=g), **overrides}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("answer_tokens", 2**70, "answer_tokens must be from 0 to 2\\*\\*63 - 1"),
        ("answer_tokens", -1, "answer_tokens must be from 0"),
        ("answer_tokens", 1.5, "answer_tokens must be an int"),
        ("seq", -1, "seq must be from 0"),
        ("seq", 2**64, "seq must be from 0"),
    ],
)
def test_out_of_range_counts_are_refused(field: str, value: Any, match: str) -> None:
    """answer_tokens=2**70 gave a bare OverflowError from the header encoder; negative or
    huge counts are now an InvalidArgumentError (a ValueError) naming the argument."""
    args: dict[str, Any] = {"seq": 0, "answer_tokens": 1, field: value}
    with pytest.raises(InvalidArgumentError, match=match):
        plan_segment("s", args["seq"], kv(), token_dim=0, answer_tokens=args["answer_tokens"])


def test_largest_counts_round_trip() -> None:
    """The bounds are inclusive: 2**63 - 1 is stored and read back."""
    plan = plan_segment("s", MAX_COUNT, kv(), token_dim=0, answer_tokens=MAX_COUNT)
    buf = memoryview(bytearray(plan.length))
    plan.write_into(buf)
    header, _ = parse_header(buf, "max", len(buf))
    assert (header.seq, header.answer_tokens) == (MAX_COUNT, MAX_COUNT)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.empty(4, 8, device="meta"), "'meta' device"),
        (torch.randn(4, 8).to_sparse(), "not a dense"),
    ],
    ids=["meta", "sparse-coo"],
)
def test_tensors_without_copyable_data_are_refused(tensor: torch.Tensor, match: str) -> None:
    """A meta-device tensor (before: a bare NotImplementedError when it was copied) and
    sparse tensors are an InvalidTypeError (a TypeError) naming the tensor."""
    with pytest.raises(InvalidTypeError, match=match) as info:
        plan_segment("s", 0, kv(v=tensor), token_dim=0, answer_tokens=1)
    assert "'v'" in str(info.value)
    assert isinstance(info.value, TieredKVError)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"token_dim": 0.0}, InvalidArgumentError),
        ({"codec": ""}, InvalidArgumentError),
    ],
)
def test_bad_layout_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    """A float token_dim and an empty codec name are refused before any layout."""
    args: dict[str, Any] = {"token_dim": 0, "answer_tokens": 1, **kwargs}
    with pytest.raises(error):
        plan_segment("s", 0, kv(), **args)
