"""Page-locked host memory of exactly the size asked for, mapped into the device's address space.

torch's pinned allocator rounds every block up to a power of two and keeps freed blocks cached: a
1.125 GiB layer of experts took 2 GiB, and 58 GB of experts held 94 GB of host memory. Here each
buffer is an ordinary host tensor of the exact size, page-locked in place with `cudaHostRegister`
(portable, mapped: the decode kernels read it over PCIe through the same address) and unregistered
when released, so unloading gives the memory back.
"""

from __future__ import annotations

import warnings

import torch

REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class HostBuffer:
    def __init__(self, numel: int, dtype: torch.dtype, page_locked: bool):
        self.tensor: torch.Tensor | None = torch.empty(numel, dtype=dtype)
        self.registered = False
        if page_locked and numel:
            nbytes = numel * self.tensor.element_size()
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes,
                                                                            REGISTER_PORTABLE_MAPPED))
                self.registered = True
            except RuntimeError as exc:  # a host that refuses to lock memory in place: torch's allocator
                warnings.warn(f"cudaHostRegister failed ({exc}); using torch's page-locked allocator, which "
                              "rounds each block up to a power of two", RuntimeWarning, stacklevel=2)
                self.tensor = torch.empty(numel, dtype=dtype, pin_memory=True)

    def release(self) -> None:
        if self.registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self.registered = False
        self.tensor = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def host_resident_bytes() -> int:
    """This process's resident host memory (RSS), for the benchmarks' memory columns."""
    import psutil

    return psutil.Process().memory_info().rss


def empty_host_cache() -> None:
    """Give torch's cached page-locked blocks back (small ones: readback buffers, copy staging)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()
