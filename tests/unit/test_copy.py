"""copy_tensor: byte-exact for every dtype and layout, single-threaded where it can be."""

from __future__ import annotations

import pytest
import torch

from tieredkv._copy import copy_bytes, copy_from, copy_tensor


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


def test_contiguous_copies_leave_the_bytes_around_them_alone() -> None:
    src = torch.arange(64 * 1024, dtype=torch.int32).view(64, 1024)
    out = torch.full((200, 1024), -1, dtype=torch.int32)
    copy_tensor(out.narrow(0, 100, 64), src)  # the memmove path: both contiguous
    assert torch.equal(out[100:164], src)
    assert bool((out[:100] == -1).all())
    assert bool((out[164:] == -1).all())


def test_views_whose_bytes_are_not_their_values_copy_their_values() -> None:
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    neg = torch._neg_view(x)  # a negative view: its bytes are x's
    assert neg.is_neg()
    assert neg.is_contiguous()
    dst = torch.empty(3, 4)
    copy_tensor(dst, neg)
    assert torch.equal(dst, -x)
    c = torch.complex(x, x).conj()  # a conjugate view
    dst_c = torch.empty(3, 4, dtype=torch.complex64)
    copy_tensor(dst_c, c)
    assert torch.equal(dst_c, torch.complex(x, -x))


def test_copy_bytes_takes_only_contiguous_cpu_tensors_of_the_size_given() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(16, dtype=torch.int16)
    assert not copy_bytes(buf.data_ptr(), src[::2], 16)  # strided: refused, nothing copied
    assert not copy_bytes(buf.data_ptr(), src, 31)  # another size: refused
    assert not buf.any()
    assert copy_bytes(buf.data_ptr() + 8, src, 32)
    assert torch.equal(buf[8:40].view(torch.int16), src)
    assert not buf[:8].any()
    assert not buf[40:].any()


def test_copy_from_fills_only_contiguous_cpu_tensors_of_the_size_given() -> None:
    src = torch.arange(16, dtype=torch.int16)
    out = torch.zeros(4, 8, dtype=torch.int16)
    assert not copy_from(out[:, :4], src.data_ptr(), 16)  # strided: refused, nothing copied
    assert not copy_from(out[1:3], src.data_ptr(), 31)  # another size: refused
    assert not out.any()
    assert copy_from(out[1:3], src.data_ptr(), 32)  # a narrowed token range: contiguous
    assert torch.equal(out[1:3].reshape(-1), src)
    assert not out[0].any()
    assert not out[3].any()
