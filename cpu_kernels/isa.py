"""Which vector instructions this CPU has, and which CPU expert backend to use.

cpufeature reports AVX2/AVX-512 (and whether the OS saves their registers) but not AMX or
AVX-512-BF16, so those come from the flags line of /proc/cpuinfo. A CPU without AVX2 gets the torch
backend with a warning: kt-kernel's kernels would die of an illegal instruction there.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IsaInfo:
    avx2: bool
    avx512f: bool
    avx512_bf16: bool
    amx_bf16: bool
    amx_int8: bool

    @property
    def best(self) -> str:
        """kt-kernel's variant names: amx, avx512_bf16, avx512, avx2, or none."""
        if self.amx_bf16 and self.amx_int8:
            return "amx"
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx512f:
            return "avx512"
        return "avx2" if self.avx2 else "none"


def cpuinfo_flags(cpuinfo_text: str) -> set[str]:
    for line in cpuinfo_text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def detect_isa(cpuinfo_text: str | None = None, cpufeature_table: dict | None = None) -> IsaInfo:
    """Detect from /proc/cpuinfo (and cpufeature where installed); both can be passed in for tests."""
    if cpuinfo_text is None:
        path = Path("/proc/cpuinfo")
        cpuinfo_text = path.read_text() if path.exists() else ""
    flags = cpuinfo_flags(cpuinfo_text)
    if cpufeature_table is None:
        try:
            import cpufeature

            cpufeature_table = dict(cpufeature.CPUFeature)
        except Exception:  # not installed, or not an x86 machine
            cpufeature_table = {}
    os_avx = cpufeature_table.get("OS_AVX", True)
    os_avx512 = cpufeature_table.get("OS_AVX512", True)
    avx2 = os_avx and (cpufeature_table.get("AVX2", False) or "avx2" in flags)
    avx512f = os_avx512 and (cpufeature_table.get("AVX512f", False) or "avx512f" in flags)
    return IsaInfo(
        avx2=avx2,
        avx512f=avx512f,
        avx512_bf16=avx512f and "avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags and "amx_tile" in flags,
        amx_int8="amx_int8" in flags and "amx_tile" in flags,
    )


def kt_kernel_installed() -> bool:
    return importlib.util.find_spec("kt_kernel") is not None


def choose_backend(requested: str = "auto", isa: IsaInfo | None = None, kt_available: bool | None = None,
                   shape_ok: bool = True) -> str:
    """`auto` | `kt-kernel` | `torch` -> the backend to build. Never kt-kernel on a CPU without AVX2,
    nor for expert shapes its kernels cannot take (`shape_ok`)."""
    isa = isa or detect_isa()
    kt_available = kt_kernel_installed() if kt_available is None else kt_available
    if requested not in ("auto", "kt-kernel", "torch"):
        raise ValueError(f"cpu_backend {requested!r} is not one of: auto, kt-kernel, torch")
    if requested == "torch":
        return "torch"
    if not isa.avx2:
        warnings.warn("this CPU has no AVX2: kt-kernel cannot run here, using the torch CPU backend", RuntimeWarning,
                      stacklevel=2)
        return "torch"
    if requested == "kt-kernel":
        if not kt_available:
            raise ValueError("cpu_backend kt-kernel requested but kt_kernel is not installed "
                             "(pip install --no-deps kt-kernel==0.7.2 gguf; `make test` installs it)")
        if not shape_ok:
            raise ValueError("cpu_backend kt-kernel cannot take this model's expert sizes (multiples of 32 needed)")
        return "kt-kernel"
    if kt_available and not shape_ok:
        warnings.warn("kt-kernel cannot take this model's expert sizes (multiples of 32 needed): using torch",
                      RuntimeWarning, stacklevel=2)
    return "kt-kernel" if kt_available and shape_ok else "torch"
