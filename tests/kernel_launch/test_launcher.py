"""The Triton launcher that skips the JIT's per-call Python (kernel_launch/), on the CPU: a stand-in for a
JIT kernel records which path each call took. A key's first call goes through the kernel (Triton compiles or finds
its compiled form), later calls with the same specialization go to the compiled launcher with every argument in the
kernel's order; anything the specialization depends on (an address's alignment, a dtype, an integer, a constexpr,
an option) makes a new key, and launch hooks send every call through Triton."""

import types

import pytest
import torch

launch_module = pytest.importorskip("kernel_launch")
if launch_module.driver is None:
    pytest.skip("this Triton has no driver or knobs module: every launch goes through Triton", allow_module_level=True)


def source(x_ptr, y_ptr, n, scale, BLOCK: "constexpr" = 64, FLAG: "constexpr" = False):  # the kernel's signature
    pass


class FakeLauncher:
    """Triton's CudaLauncher: `launch` is the C launcher, no scratch memory."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, False

    def __init__(self, calls):
        self.calls = calls

    def launch(self, *args):
        self.calls.append(("compiled", args))


class FakeKernel:
    """A JIT kernel: `kernel[grid](...)` is Triton's path; it returns the compiled kernel."""
    fn = staticmethod(source)

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return types.SimpleNamespace(run=FakeLauncher(self.calls), function="FUNCTION", packed_metadata="META")
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launch_module, "_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_stream", lambda device: 77)
    return FakeKernel()


def paths(kernel):
    return [call[0] for call in kernel.calls]


def test_a_keys_second_call_goes_to_the_compiled_launcher_with_every_argument_in_order(kernel):
    launcher = launch_module.Launcher(kernel, direct=True)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((4,), x, y, 64, 0.5, BLOCK=128, num_warps=4)
    launcher((4,), x, y, 64, 0.5, BLOCK=128, num_warps=4)
    assert paths(kernel) == ["triton", "compiled"]
    args = kernel.calls[1][1]
    # grid padded to three, the stream, the compiled function, then the kernel's arguments with their defaults
    assert args[:5] == (4, 1, 1, 77, "FUNCTION") and args[9] == "META"
    assert args[13:] == (x, y, 64, 0.5, 128, False)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "integer", "one", "constexpr", "bool", "option"])
def test_whatever_the_specialization_depends_on_makes_a_new_key(kernel, change):
    launcher = launch_module.Launcher(kernel, direct=True)
    x, y = torch.zeros(64), torch.zeros(64)
    call = dict(args=(x, y, 64, 0.5), kwargs={"BLOCK": 128, "FLAG": False, "num_warps": 4})
    launcher((4,), *call["args"], **call["kwargs"])
    args, kwargs = list(call["args"]), dict(call["kwargs"])
    if change == "misaligned":
        args[0] = torch.zeros(65)[1:]  # 4 bytes past an aligned address
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "integer":
        args[2] = 48
    elif change == "one":
        args[2] = True  # equal to 1 as a Python value, not as Triton specializes it
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "bool":
        kwargs["FLAG"] = 0  # 0 == False, but not the same constexpr
    else:
        kwargs["num_warps"] = 8
    launcher((4,), *args, **kwargs)
    assert paths(kernel) == ["triton", "triton"]
    launcher((4,), *args, **kwargs)
    assert paths(kernel) == ["triton", "triton", "compiled"]


def test_launch_hooks_and_non_jit_kernels_go_through_triton(kernel, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64)
    launcher = launch_module.Launcher(kernel, direct=True)
    launcher((2, 3), x, y, 64, 0.5)
    chain = launch_module.knobs.runtime.launch_enter_hook
    if hasattr(chain, "calls"):  # Triton's hook chain: a profiler adds to it
        monkeypatch.setattr(chain, "calls", [lambda metadata: None])
    else:
        monkeypatch.setattr(launch_module.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher((2, 3), x, y, 64, 0.5)
    assert paths(kernel) == ["triton", "triton"]
    interpreted = FakeKernel()  # not a JIT function (the interpreter's kernels): Triton's path every time
    plain = launch_module.Launcher(interpreted)
    plain((1,), x, y, 64, 0.5)
    plain((1,), x, y, 64, 0.5)
    assert not plain.direct and paths(interpreted) == ["triton", "triton"]


def test_a_missing_argument_is_left_to_triton_to_name(kernel):
    launcher = launch_module.Launcher(kernel, direct=True)
    launcher((1,), torch.zeros(4), torch.zeros(4), 4)  # `scale` missing: Triton's own path says so
    launcher((1,), torch.zeros(4), torch.zeros(4), 4)
    assert paths(kernel) == ["triton", "triton"]


def test_a_compiled_kernel_with_scratch_memory_goes_through_its_launcher(kernel):
    calls = []

    class ScratchLauncher(FakeLauncher):
        global_scratch_size = 128

        def __call__(self, *args):
            calls.append(args)

    compiled = types.SimpleNamespace(run=ScratchLauncher(calls), function="F", packed_metadata="M")
    run = launch_module.compiled_launch(compiled)
    run((2, 1, 1), 5, [1, 2])
    assert calls == [(2, 1, 1, 5, "F", "M", None, None, None, 1, 2)]
    assert launch_module.compiled_launch(types.SimpleNamespace()) is launch_module._THROUGH_TRITON


def test_the_environment_can_send_every_launch_through_triton(kernel, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_KERNEL_LAUNCH", "triton")
    launcher = launch_module.Launcher(kernel, direct=True)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((1,), x, y, 64, 0.5)
    launcher((1,), x, y, 64, 0.5)
    assert not launcher.direct and paths(kernel) == ["triton", "triton"]


def test_grid_arithmetic_in_plain_integers_is_tritons():
    """`cdiv` and `next_power_of_2` replace Triton's host-side helpers (constexpr functions, slow to call): the
    same values wherever the kernels' grids and block sizes use them."""
    triton = pytest.importorskip("triton")
    from kernel_launch import cdiv, next_power_of_2

    for n in range(0, 5000, 7):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for b in (1, 3, 16, 64, 256, 4096):
            assert cdiv(n, b) == triton.cdiv(n, b)
    assert next_power_of_2(2**20) == 2**20 and next_power_of_2(2**20 + 1) == 2**21
