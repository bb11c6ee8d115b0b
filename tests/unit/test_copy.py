"""copy_tensor: byte-exact for every dtype and layout, single-threaded where it can be."""

from __future__ import annotations

import pytest
import torch

from tieredkv._copy import copy_tensor


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.bool]
)
def test_strided_and_narrowed_layouts_copy_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2 if dtype == torch.bool else 100, (2, 4, 9, 16), generator=g)
    src = base.to(dtype)
    for view in (
        src,
        src[:, :, 3:7],  # a narrowed token range: last dim contiguous, others strided
        src.transpose(1, 2),  # strided, last dim contiguous
        src.transpose(2, 3),  # last dim not contiguous: torch copies it
    ):
        dst = torch.empty(view.shape, dtype=dtype)
        copy_tensor(dst, view)
        assert torch.equal(dst, view)
        out = torch.zeros(2, 4, 20, 16, dtype=dtype) if view.shape == (2, 4, 4, 16) else None
        if out is not None:  # into a narrowed destination, as a load scatters segments
            copy_tensor(out.narrow(2, 5, 4), view)
            assert torch.equal(out.narrow(2, 5, 4), view)
            assert not out.narrow(2, 0, 5).any()


def test_empty_and_scalar_tensors() -> None:
    copy_tensor(torch.empty(0, 3), torch.empty(0, 3))
    dst = torch.zeros(())
    copy_tensor(dst, torch.tensor(2.5))
    assert dst.item() == 2.5
