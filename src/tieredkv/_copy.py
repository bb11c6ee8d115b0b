"""Host-to-host tensor copies that do not fight the model for its threads.

``torch.Tensor.copy_`` splits a large CPU copy over torch's intra-op thread pool. Inside a
worker thread of the cache, while the model runs its own parallel kernels on the same
cores, that pool is oversubscribed: measured on this project's 2-core machine under load,
64 copies of 1 MiB took 1.0-1.5 s through ``copy_`` with 2 threads against 0.14-0.17 s
single-threaded. So CPU copies are one thread's, GIL released, byte for byte: contiguous
tensors through libc's ``memmove`` (a ctypes call: about 3.5 us of overhead per call, against
about 14 us for the torch views and numpy arrays of the strided path, which matters at one
call per tensor per turn; ``benchmarks/bench_api.py`` prints the CPU seconds per GB), other
strided ones through numpy; anything else (CUDA, layouts numpy cannot view) keeps ``copy_``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["copy_bytes", "copy_from", "copy_tensor", "memmove", "plain_cpu"]

memmove = ctypes.memmove
"""libc's ``memmove(dst, src, n)`` on addresses: a ctypes foreign call, which releases the GIL."""


def _lazy(t: torch.Tensor) -> bool:
    """A conjugate or negative view: its bytes are not its values."""
    return t.is_conj() or t.is_neg()


def plain_cpu(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor whose bytes are its values: one ``memmove`` copies it."""
    return t.is_cpu and t.is_contiguous() and not _lazy(t)


def copy_bytes(dst: int, src: torch.Tensor, nbytes: int) -> bool:
    """Copy a contiguous CPU tensor's ``nbytes`` bytes to the address ``dst`` (which the
    caller owns, for at least ``nbytes``) in this thread; ``False`` (nothing copied) when
    ``src`` is not such a tensor of exactly ``nbytes``."""
    if not (plain_cpu(src) and src.nbytes == nbytes and nbytes):
        return False
    memmove(dst, src.data_ptr(), nbytes)
    return True


def copy_from(dst: torch.Tensor, src: int, nbytes: int) -> bool:
    """Copy ``nbytes`` bytes from the address ``src`` (which the caller owns, for at least
    ``nbytes``) into a contiguous CPU tensor of exactly ``nbytes``, in this thread; ``False``
    (nothing copied) when ``dst`` is not such a tensor. The inverse of :func:`copy_bytes`:
    a segment's bytes straight into their place in an output, with no view of them."""
    if not (plain_cpu(dst) and dst.nbytes == nbytes and nbytes):
        return False
    memmove(dst.data_ptr(), src, nbytes)
    return True


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for tensors of the same dtype and shape; single-threaded on CPU."""
    if (
        plain_cpu(dst)
        and plain_cpu(src)
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.nbytes
    ):
        memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
        return
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.dim() > 0
        and dst.numel() > 0
        and dst.stride(-1) == 1
        and src.stride(-1) == 1
    ):
        try:
            dst_bytes, src_bytes = dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy()
        except RuntimeError:  # a layout whose bytes torch cannot view: let torch copy it
            pass
        else:
            np.copyto(dst_bytes, src_bytes)
            return
    dst.copy_(src, non_blocking=non_blocking)
