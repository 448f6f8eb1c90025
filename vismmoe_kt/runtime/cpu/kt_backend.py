"""kt-kernel backend: the KTransformers team's BF16 MoE kernels (AMX, AVX-512-BF16 or AVX2 build,
chosen by kt_kernel at import from the CPU), through its low-level API:

    CPUInfer(threads)                          a worker pool with a task queue
    moe.MOEConfig(E, K, H, I, gpu_mask_ptr)    per layer; per-expert weight pointers in gate_projs/...
    moe.AMXBF16_MOE(config)                    (AVX2BF16_MOE where the build lacks it)
    submit(moe.load_weights_task(p2l_ptr)); sync()
    submit(moe.forward_task(bsz_ptr, K, ids_ptr, weights_ptr, in_ptr, out_ptr, incremental)); sync()

Its tasks read raw pointers asynchronously, so every tensor handed to a task is kept alive until the
matching `sync()` (a freed temporary there is a use-after-free). `load_weights_task` repacks the
weights into kt-kernel's own memory: a layer served here costs its BF16 size again in host memory
(measured: 302 MB of experts -> +304 MB RSS), after which the tensors given to it may be freed.
Expert ids of -1 are skipped by the kernels. Inputs are BF16; other dtypes are converted.
Hidden and intermediate sizes must be multiples of 32: other sizes crash inside the kernels
(measured on the AVX-512-BF16 build: I=40 and I=48 segfault, 32/64/96 work), so they are refused here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

import torch


@contextlib.contextmanager
def quiet_native_stdout():
    """kt-kernel's C++ code prints progress lines on the process's stdout at set-up; keep them out of
    the user's answer stream (they would interleave with `vismmoe-kt chat` output)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real stdout (embedded use): nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _release_quietly(holder: list) -> None:
    """Drop the last reference to a CPUInfer with stdout silenced: its destructor prints a farewell
    line, which at interpreter exit would land after the caller's own last words."""
    with quiet_native_stdout():
        holder.clear()


class _KtTask:
    def __init__(self, cpu_infer, out: torch.Tensor, dtype: torch.dtype, keep: tuple):
        self.cpu_infer, self.out, self.dtype, self._keep = cpu_infer, out, dtype, keep

    def wait(self) -> torch.Tensor:
        self.cpu_infer.sync()
        self._keep = ()
        return self.out.to(self.dtype)


KT_ALIGN = 32


def kt_kernel_supports(hidden: int, inter: int) -> bool:
    return hidden % KT_ALIGN == 0 and inter % KT_ALIGN == 0


class KtKernelBackend:
    name = "kt-kernel"

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, threads: int | None = None,
                 max_len: int = 4096):
        if not kt_kernel_supports(hidden, inter):
            raise ValueError(f"kt-kernel needs hidden and expert intermediate sizes that are multiples of {KT_ALIGN}; "
                             f"this model has {hidden} and {inter}")
        import kt_kernel
        from kt_kernel import kt_kernel_ext as ext

        self.ext, self.variant = ext, kt_kernel.__cpu_variant__
        self.num_experts, self.top_k, self.hidden, self.inter = num_experts, top_k, hidden, inter
        self.threads = threads or torch.get_num_threads()
        with quiet_native_stdout():
            self._infer = [ext.CPUInfer(self.threads)]  # the only reference, so the finalizer can free it
        weakref.finalize(self, _release_quietly, self._infer)
        self.moe_class = getattr(ext.moe, "AMXBF16_MOE", None) or ext.moe.AVX2BF16_MOE
        self.max_len = max_len
        self.gpu_mask = torch.zeros(num_experts, dtype=torch.bool)  # no expert of these layers is on a GPU
        self.layers: dict[int, object] = {}
        self._configs: list = []
        self._bytes = 0

    @property
    def cpu_infer(self):
        return self._infer[0]

    def add_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        inter = self.inter
        gate_up = gate_up.to(torch.bfloat16)  # no copy when already BF16
        down = down.to(torch.bfloat16)
        config = self.ext.moe.MOEConfig(self.num_experts, self.top_k, self.hidden, inter, self.gpu_mask.data_ptr())
        config.layer_idx = layer
        config.pool = self.cpu_infer.backend_
        config.max_len = self.max_len
        experts = range(self.num_experts)  # per-expert pointers: each (I, H) / (H, I) slice is contiguous
        config.gate_projs = [[gate_up[e, :inter].data_ptr() for e in experts]]
        config.up_projs = [[gate_up[e, inter:].data_ptr() for e in experts]]
        config.down_projs = [[down[e].data_ptr() for e in experts]]
        zeros = [[0] * self.num_experts]
        config.gate_scales, config.up_scales, config.down_scales = zeros, zeros, zeros
        logical = torch.arange(self.num_experts, dtype=torch.int64)
        with quiet_native_stdout():
            moe = self.moe_class(config)
            self.cpu_infer.submit(moe.load_weights_task(logical.data_ptr()))
            self.cpu_infer.sync()  # `logical`, gate_up and down are alive until here; kt-kernel copied them
        self.layers[layer] = moe
        self._configs.append(config)
        self._bytes += self.num_experts * 3 * inter * self.hidden * 2

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> _KtTask:
        tokens = hidden.shape[0]
        if tokens > self.max_len:
            raise ValueError(f"kt-kernel backend takes at most {self.max_len} tokens per call, got {tokens}")
        x = hidden.to(torch.bfloat16).contiguous()
        ids = expert_ids.to(torch.int64).contiguous()
        w = weights.to(torch.float32).contiguous()
        out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        bsz = torch.tensor([tokens], dtype=torch.int32)
        task = self.layers[layer].forward_task(bsz.data_ptr(), ids.shape[1], ids.data_ptr(), w.data_ptr(),
                                               x.data_ptr(), out.data_ptr(), False)
        self.cpu_infer.submit(task)
        return _KtTask(self.cpu_infer, out, hidden.dtype, (x, ids, w, bsz))

    @property
    def host_bytes(self) -> int:
        return self._bytes

    def describe(self) -> str:
        return f"kt-kernel {self.variant} {self.moe_class.__name__} ({self.threads} threads, own BF16 copy)"
