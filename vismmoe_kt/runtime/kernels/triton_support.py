"""Triton where it is installed, else None: every kernel module defines its kernels only when `tl`
is set, and its callers take the torch twins otherwise (CPU-only installs)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twins run instead
    triton = tl = None

# the weight dtypes the kernels read, as Triton names them
TL_DTYPES = {}
if tl is not None:
    TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def available(dtype: torch.dtype | None = None) -> bool:
    """Whether Triton is present (and, given a dtype, whether the kernels read weights of it)."""
    return triton is not None and (dtype is None or dtype in TL_DTYPES)
