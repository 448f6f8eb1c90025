"""Triton launches with less of the host's time: once Triton has compiled a kernel for a call's specialization,
later calls with the same one go straight to its compiled launcher. A package below vismmoe_kt (it imports nothing
of it), so that every stage with Triton kernels may use it: the runtime's expert kernels, the engine's norms,
router and attention heads.

Why: a prompt whose experts are all on the GPU is paced by the host's launches, layer by layer (an H100 issued
a decoder layer in 0.83 ms while its kernels took 0.63 ms at 236 tokens), and under cProfile Triton's
`JITFunction.run` was about a third of a layer's Python: on every call it binds and specializes each argument,
builds a cache key, checks the kernel's globals and asks for launch metadata before its C launcher runs. Here a
call's key is what that specialization depends on, made finer: each tensor's dtype and whether its address is a
multiple of 16 bytes, and every other argument's type and value (a constexpr's, an integer's: Triton specializes
integers on being 1 and on dividing by 16), with the launch options and the device. The first call with a key
goes through Triton (which compiles, or finds its compiled kernel) and keeps what it returns; later calls launch
it with the same arguments in the kernel's order. Launch hooks (a profiler's) and anything that is not a compiled
CUDA kernel (Triton's interpreter) always go through Triton, and so does every launch where the environment sets
VISMMOE_KT_KERNEL_LAUNCH=triton (read when a kernel's launcher is made), and every launch under a Triton release
other than KNOWN_TRITON's, whose compiled launcher may take its arguments differently.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

# the Triton releases whose compiled launcher takes the arguments this module passes (read from their source)
KNOWN_TRITON = ("3.6.",)

try:
    import triton
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # no Triton (CPU-only installs), or one without them: every launch goes through the kernel
    knobs = driver = JITFunction = None
else:
    if not triton.__version__.startswith(KNOWN_TRITON):  # another release: its own path every time
        driver = None

_THROUGH_TRITON = object()  # a key whose calls go through Triton every time


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain integers, for grids and constexprs. Why not `triton.cdiv`: in Triton 3.6 it is a
    constexpr function that unwraps its arguments on every call, about 1.5 us on the host against 0.02, and a
    prompt's layer, paced by the host, works out a dozen grids and block sizes."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` (0 for 0) in plain integers, for the same reason."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _device() -> int:
    return driver.active.get_current_device()


def _stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def _hooked() -> bool:
    """Whether launch hooks are set (a profiler's): Triton's hook chains, empty unless one was added."""
    runtime = knobs.runtime
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


class Launcher:
    """`launcher(grid, *args, **kwargs)` for a `@triton.jit` kernel: as `kernel[grid](*args, **kwargs)`, faster
    from a key's second call on."""

    def __init__(self, kernel: Any, direct: bool | None = None):
        """`direct`: whether calls may skip Triton's Python (default: for a JIT kernel, not the interpreter's)."""
        self.kernel = kernel
        self.direct = driver is not None and os.environ.get("VISMMOE_KT_KERNEL_LAUNCH") != "triton" \
            and (isinstance(kernel, JITFunction) if direct is None else direct)
        parameters = inspect.signature(kernel.fn).parameters if self.direct else {}
        self.names = tuple(parameters)
        self.known = frozenset(self.names)
        self.defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
        self.launches: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        # (written for the host's time: one comprehension a step, no call per argument)
        if not self.direct or _hooked():
            self.kernel[grid](*args, **kwargs)
            return
        defaults, known = self.defaults, self.known
        try:
            values = [*args, *[kwargs[name] if name in kwargs else defaults[name] for name in self.names[len(args):]]]
            device = _device()
            # what the specialization depends on, or finer: a tensor's dtype and 16-byte alignment, any other
            # argument's type and value (True is not 1), the options, the device
            key = (device, tuple(sorted((name, value) for name, value in kwargs.items() if name not in known)),
                   *[(value.dtype, value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor)
                     else (type(value), value) for value in values])
            launch = self.launches.get(key)
        except (KeyError, TypeError):  # an argument missing (Triton names it) or unhashable: Triton's own path
            self.kernel[grid](*args, **kwargs)
            return
        if launch is None:
            self.launches[key] = compiled_launch(self.kernel[grid](*args, **kwargs))
        elif launch is _THROUGH_TRITON:
            self.kernel[grid](*args, **kwargs)
        else:
            launch((*grid, 1, 1)[:3], _stream(device), values)


def compiled_launch(compiled: Any) -> Any:
    """A function (grid (3,), stream, arguments in the kernel's order) -> None that launches `compiled` as Triton's
    JITFunction.run does, without its Python; `_THROUGH_TRITON` where `compiled` is not such a kernel."""
    run = getattr(compiled, "run", None)
    if run is None or getattr(compiled, "function", None) is None or not hasattr(compiled, "packed_metadata"):
        return _THROUGH_TRITON
    function, metadata = compiled.function, compiled.packed_metadata
    launch = getattr(run, "launch", None)
    if launch is not None and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
        cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl

        def direct(grid, stream, values):  # no scratch memory to allocate: the C launcher itself
            launch(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, None, None, metadata, None, None, None,
                   *values)
        return direct

    def through_launcher(grid, stream, values):
        run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *values)
    return through_launcher


_LAUNCHERS: dict[Any, Launcher] = {}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)` through the kernel's Launcher (made on its first launch)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    launcher(grid, *args, **kwargs)
