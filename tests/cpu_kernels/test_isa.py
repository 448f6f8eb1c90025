"""ISA detection from (faked) /proc/cpuinfo contents, and the backend choice it drives."""

import sys
import types

import pytest

from cpu_kernels.isa import choose_backend, cpuinfo_flags, detect_isa

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse avx avx2 avx512f avx512bw avx512vl\n"
COOPER_LAKE = "flags\t: avx avx2 avx512f avx512_bf16\n"
HASWELL = "flags\t: fpu sse avx avx2 fma\n"
OLD = "flags\t: fpu sse sse2 sse4_2 avx\n"
NO_TABLE = {}  # as if cpufeature were missing: /proc/cpuinfo alone decides


@pytest.mark.parametrize("text,best", [(SAPPHIRE_RAPIDS, "amx"), (COOPER_LAKE, "avx512_bf16"),
                                       (ICE_LAKE, "avx512"), (HASWELL, "avx2"), (OLD, "none")])
def test_best_variant(text, best):
    assert detect_isa(text, NO_TABLE).best == best


def test_amx_needs_the_tile_flag():
    isa = detect_isa("flags\t: avx2 avx512f amx_bf16 amx_int8\n", NO_TABLE)
    assert not isa.amx_bf16 and isa.best == "avx512"


def test_os_without_avx512_state_masks_avx512():
    isa = detect_isa(SAPPHIRE_RAPIDS, {"OS_AVX": True, "OS_AVX512": False, "AVX2": True, "AVX512f": True})
    assert isa.avx2 and not isa.avx512f and not isa.avx512_bf16


def test_without_cpufeature_proc_cpuinfo_alone_decides(monkeypatch):
    """The GPU machine has no cpufeature: its import fails and the flags line still finds every ISA."""
    monkeypatch.setitem(sys.modules, "cpufeature", None)  # `import cpufeature` raises ImportError
    assert detect_isa(SAPPHIRE_RAPIDS) == detect_isa(SAPPHIRE_RAPIDS, NO_TABLE)
    assert detect_isa(SAPPHIRE_RAPIDS).best == "amx" and detect_isa(OLD).best == "none"


def test_installed_cpufeature_is_asked(monkeypatch):
    fake = types.ModuleType("cpufeature")
    fake.CPUFeature = {"OS_AVX": True, "OS_AVX512": False, "AVX2": True, "AVX512f": True}
    monkeypatch.setitem(sys.modules, "cpufeature", fake)
    assert detect_isa(ICE_LAKE).best == "avx2"  # the flags say avx512f, cpufeature says the OS does not save its state


def test_flags_parsing():
    assert cpuinfo_flags(HASWELL) == {"fpu", "sse", "avx", "avx2", "fma"}
    assert cpuinfo_flags("") == set()


def test_no_avx2_falls_back_to_torch_with_a_warning():
    old = detect_isa(OLD, NO_TABLE)
    with pytest.warns(RuntimeWarning, match="no AVX2"):
        assert choose_backend("auto", old, kt_available=True) == "torch"
    with pytest.warns(RuntimeWarning, match="no AVX2"):
        assert choose_backend("kt-kernel", old, kt_available=True) == "torch"


def test_choice_on_capable_cpus():
    spr = detect_isa(SAPPHIRE_RAPIDS, NO_TABLE)
    assert choose_backend("auto", spr, kt_available=True) == "kt-kernel"
    assert choose_backend("auto", spr, kt_available=False) == "torch"
    assert choose_backend("torch", spr, kt_available=True) == "torch"
    with pytest.warns(RuntimeWarning, match="multiples of 32"):
        assert choose_backend("auto", spr, kt_available=True, shape_ok=False) == "torch"


def test_explicit_kt_kernel_errors_say_why():
    spr = detect_isa(SAPPHIRE_RAPIDS, NO_TABLE)
    with pytest.raises(ValueError, match="kt_kernel is not installed"):
        choose_backend("kt-kernel", spr, kt_available=False)
    with pytest.raises(ValueError, match="multiples of 32"):
        choose_backend("kt-kernel", spr, kt_available=True, shape_ok=False)
    with pytest.raises(ValueError, match="not one of"):
        choose_backend("onednn", spr, kt_available=True)
