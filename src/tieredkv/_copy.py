"""Host-to-host tensor copies that do not fight the model for its threads.

``torch.Tensor.copy_`` splits a large CPU copy over torch's intra-op thread pool. Inside a
worker thread of the cache, while the model runs its own parallel kernels on the same
cores, that pool is oversubscribed: measured on this project's 2-core machine under load,
64 copies of 1 MiB took 1.0-1.5 s through ``copy_`` with 2 threads against 0.14-0.17 s
single-threaded. So CPU copies go through numpy (one thread, GIL released), byte for byte;
anything else (CUDA, layouts numpy cannot view) keeps ``copy_``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_tensor"]


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for tensors of the same dtype and shape; single-threaded on CPU."""
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
