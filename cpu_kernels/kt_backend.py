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

Precision (`dtype`): bf16 (per-expert pointers into the given tensors, copied), or int8 / int4, which
kt-kernel quantizes itself at load (per-row scales; AMX kernels, or their AVX-512 build) and which
are kept on disk beside the model for the next start (quant_cache.py).

Workers: `threads.plan_workers` (physical cores minus two by default, one sub-pool per NUMA node).
On a CUDA device one token's call runs inside the stream (`forward_on_stream`): kt-kernel's
`submit_with_cuda_stream` / `sync_with_cuda_stream` enqueue host functions that start the task and
wait for it, between a copy of the inputs to page-locked buffers and a copy of the output back. No
Python thread waits, and a CUDA graph captures the whole call, so a decode step with CPU experts
stays one graph (KTransformers captures its CPU experts the same way).
Hidden and intermediate sizes must be multiples of 32: other sizes crash inside the kernels
(measured on the AVX-512-BF16 build: I=40 and I=48 segfault, 32/64/96 work), so they are refused here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

import torch

from . import CPU_DTYPES, ggml_types
from .quant_cache import QuantCache
from .threads import WorkerPlan, plan_workers, worker_pool_config

# kt-kernel's classes per dtype: the AMX ones also exist in its AVX-512 builds; AVX2 builds have BF16 only
MOE_CLASSES = {"bf16": ("AMXBF16_MOE", "AVX2BF16_MOE"), "int8": ("AMXInt8_MOE",), "int4": ("AMXInt4_MOE",)}
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}
# sizes the kernels' tiles take (measured on kt-kernel 0.7.2: INT8 refuses 96 or 32, INT4 refuses 64)
ALIGN = {"bf16": 32, "int8": 64, "int4": 128}
KT_WEIGHT_FIELDS = ("gate_proj", "up_proj", "down_proj")  # MOEConfig's whole-layer weight pointers
LLAMAFILE_ALIGN = 256  # QK_K: kt-kernel's llamafile MoE refuses other intermediate sizes


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

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, threads: int | WorkerPlan | None = None,
                 max_len: int = 4096, dtype: str = "bf16", model_dir: str | os.PathLike | None = None,
                 sources: list = ()):
        if not kt_kernel_supports(hidden, inter):
            raise ValueError(f"kt-kernel needs hidden and expert intermediate sizes that are multiples of {KT_ALIGN}; "
                             f"this model has {hidden} and {inter}")
        import kt_kernel
        from kt_kernel import kt_kernel_ext as ext

        if dtype not in CPU_DTYPES:
            raise ValueError(f"cpu_dtype {dtype!r} is not one of: {', '.join(CPU_DTYPES)}")
        plan = threads if isinstance(threads, WorkerPlan) else plan_workers(threads)
        pools = len(plan.threads)  # kt-kernel splits each layer's intermediate size across its sub-pools
        if hidden % ALIGN[dtype] or inter % pools or (inter // pools) % ALIGN[dtype]:
            split = f" split across {pools} NUMA sub-pools ({inter / pools:g} each)" if pools > 1 else ""
            raise ValueError(f"kt-kernel's {dtype} experts need hidden and expert intermediate sizes that are multiples "
                             f"of {ALIGN[dtype]}; this model has {hidden} and {inter}{split}")
        self.ext, self.variant, self.dtype = ext, kt_kernel.__cpu_variant__, dtype
        names = [n for n in MOE_CLASSES[dtype] if getattr(ext.moe, n, None) is not None]
        if not names:
            raise ValueError(f"cpu_dtype {dtype} needs kt-kernel's AMX or AVX-512 build; this CPU loads its "
                             f"{self.variant} build, which computes BF16 experts only (cpu_dtype: bf16)")
        self.moe_class = getattr(ext.moe, names[0])
        self.num_experts, self.top_k, self.hidden, self.inter = num_experts, top_k, hidden, inter
        self.plan = plan
        self.threads = self.plan.workers
        with quiet_native_stdout():  # the only reference, so the finalizer can free it
            self._infer = [ext.CPUInfer(worker_pool_config(self.plan, ext))]
        weakref.finalize(self, _release_quietly, self._infer)
        self.max_len = max_len
        self.cache = None
        if dtype != "bf16":  # quantized once, then read from disk (a directory model only)
            directory = model_dir if model_dir is not None and os.path.isdir(model_dir) else None
            shape = {"experts": num_experts, "hidden": hidden, "inter": inter}
            layout = {"variant": self.variant, "subpools": list(self.plan.threads), "numa": list(self.plan.nodes)}
            self.cache = QuantCache(directory, dtype, shape, getattr(kt_kernel, "__version__", "unknown"), layout,
                                    [p for p in sources])
        self.loaded_from_cache = 0
        self.stored_layers = 0  # layers served from GGUF's own types (add_layer_stored)
        self._stored: dict[int, tuple] = {}  # their bytes, which kt-kernel reads in place
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
        keep: tuple = ()
        cached = self.cache is not None and self.cache.has(layer)
        if self.cache is None:
            experts = range(self.num_experts)  # per-expert pointers: each (I, H) / (H, I) slice is contiguous
            config.gate_projs = [[gate_up[e, :inter].data_ptr() for e in experts]]
            config.up_projs = [[gate_up[e, inter:].data_ptr() for e in experts]]
            config.down_projs = [[down[e].data_ptr() for e in experts]]
            zeros = [[0] * self.num_experts]
            config.gate_scales, config.up_scales, config.down_scales = zeros, zeros, zeros
        elif cached:  # kt-kernel reads its own files from <cache>/_layer_N
            config.load, config.save, config.path = True, False, str(self.cache.root)
        else:  # kt-kernel quantizes (E, I, H) gate and up, (E, H, I) down, and writes <cache>/_layer_N
            keep = (gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous(), down.contiguous())
            for field_name, tensor in zip(KT_WEIGHT_FIELDS, keep):  # kt-kernel's MOEConfig fields
                setattr(config, field_name, tensor.data_ptr())
            config.load, config.save, config.path = False, True, str(self.cache.root)
        logical = torch.arange(self.num_experts, dtype=torch.int64)
        try:
            with quiet_native_stdout():
                moe = self.moe_class(config)
                self.cpu_infer.submit(moe.load_weights_task(logical.data_ptr()))
                self.cpu_infer.sync()  # `logical`, the weights and `keep` are alive until here; kt-kernel copied them
        except RuntimeError:
            if not cached:
                raise
            self.cache.forget(layer)  # files kt-kernel cannot read back (moved, cut short): quantize again
            return self.add_layer(layer, gate_up, down)
        del keep
        layer_bytes = int(self.num_experts * 3 * inter * self.hidden * BYTES_PER_WEIGHT[self.dtype])
        if self.cache is not None:
            if cached:
                self.loaded_from_cache += 1
            else:
                self.cache.saved(layer, layer_bytes)
        self.layers[layer] = moe
        self._configs.append(config)
        self._bytes += layer_bytes

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

    def takes_stored(self) -> bool:
        """Whether `add_layer_stored` can serve this model (the llamafile kernels' sizes, a BF16 backend)."""
        return (self.dtype == "bf16" and not self.inter % LLAMAFILE_ALIGN and not self.hidden % LLAMAFILE_ALIGN
                and getattr(self.ext.moe, "MOE", None) is not None)

    def add_layer_stored(self, layer: int, gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int],
                         down: tuple[torch.Tensor, int]) -> None:
        """Serve `layer` from GGUF experts as stored (raw bytes of (E, I, H), (E, I, H), (E, H, I) and
        their ggml types) through kt-kernel's llamafile kernels: no dequantization, no BF16 copy (the
        bytes are kept here, as the kernels read them in place). They take sizes that are multiples
        of 256 (QK_K)."""
        if self.inter % LLAMAFILE_ALIGN or self.hidden % LLAMAFILE_ALIGN:
            raise ValueError(f"kt-kernel's llamafile kernels need hidden and intermediate sizes that are multiples of "
                             f"{LLAMAFILE_ALIGN}; this model has {self.hidden} and {self.inter}")
        ext = self.ext
        config = ext.moe.MOEConfig(self.num_experts, self.top_k, self.hidden, self.inter, self.gpu_mask.data_ptr())
        config.layer_idx = layer
        config.pool = self.cpu_infer.backend_
        config.max_len = config.group_max_len = self.max_len
        config.m_block, config.group_min_len = 32, 10  # KTransformers' llamafile settings
        keep = tuple(t.contiguous() for t, _ in (gate, up, down))
        for field_name, tensor in zip(KT_WEIGHT_FIELDS, keep):
            setattr(config, field_name, tensor.data_ptr())
        config.gate_type, config.up_type, config.down_type = gate[1], up[1], down[1]
        config.hidden_type = ggml_types.BF16  # the activations' type in the llamafile kernels
        logical = torch.arange(self.num_experts, dtype=torch.int32)
        with quiet_native_stdout():
            moe = ext.moe.MOE(config)
            self.cpu_infer.submit(moe.load_weights_task(logical.data_ptr()))
            self.cpu_infer.sync()
        # the llamafile kernels compute on these bytes in place (KTransformers keeps the GGUF mapped for
        # them): they live as long as the layer (freeing them gave NaNs once the next layer reused the memory)
        self._stored[layer] = keep
        self.layers[layer] = moe
        self.stored_layers += 1
        self._configs.append(config)
        self._bytes += sum(t.numel() for t in keep)

    @property
    def streams(self) -> bool:
        """Whether one token's call can run inside a CUDA stream (and so inside a graph)."""
        return hasattr(self.cpu_infer, "submit_with_cuda_stream")

    def forward_on_stream(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
        """One token (1, H) on the CUDA device -> (1, H) there, ordered in the current stream with no host
        wait: inputs to page-locked buffers, the task started and awaited by host functions in the
        stream, the output copied back. The buffers are shared by every layer: the stream orders the
        layers' calls, so one's output is copied out before the next one's inputs are copied in."""
        self.begin_on_stream(layer, hidden, expert_ids, weights)
        return self.end_on_stream(hidden.device, hidden.dtype)

    def begin_on_stream(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                        weights: torch.Tensor) -> None:
        """The first half of `forward_on_stream`: inputs copied out, the task started (GPU work
        enqueued after this runs while the CPU computes; `end_on_stream` waits for it)."""
        if hidden.shape[0] != 1:
            raise ValueError(f"forward_on_stream takes one token, got {hidden.shape[0]}")
        buffers = self._stream_buffers(hidden.device)
        buffers["x"].copy_(hidden, non_blocking=True)
        buffers["ids"].copy_(expert_ids, non_blocking=True)
        buffers["w"].copy_(weights, non_blocking=True)
        stream = torch.cuda.current_stream(hidden.device).cuda_stream
        task = self.layers[layer].forward_task(buffers["bsz"].data_ptr(), self.top_k, buffers["ids"].data_ptr(),
                                               buffers["w"].data_ptr(), buffers["x"].data_ptr(),
                                               buffers["out"].data_ptr(), False)
        self.cpu_infer.submit_with_cuda_stream(stream, task)

    def end_on_stream(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The second half: the stream waits for the task, then the output comes back (1, H)."""
        buffers = self._stream_buffers(device)
        self.cpu_infer.sync_with_cuda_stream(torch.cuda.current_stream(device).cuda_stream, 0)
        buffers["device_out"].copy_(buffers["out"], non_blocking=True)
        return buffers["device_out"].to(dtype)

    def _stream_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        if getattr(self, "_buffers", None) is None:
            pinned = dict(pin_memory=True)
            self._buffers = {
                "x": torch.empty(1, self.hidden, dtype=torch.bfloat16, **pinned),
                "ids": torch.empty(1, self.top_k, dtype=torch.int64, **pinned),
                "w": torch.empty(1, self.top_k, dtype=torch.float32, **pinned),
                "out": torch.empty(1, self.hidden, dtype=torch.bfloat16, **pinned),
                "bsz": torch.ones(1, dtype=torch.int32, **pinned),  # always one token: never written again
                "device_out": torch.empty(1, self.hidden, dtype=torch.bfloat16, device=device),
            }
        return self._buffers

    @property
    def host_bytes(self) -> int:
        return self._bytes

    def describe(self) -> str:
        if self.stored_layers:
            copy = f"llamafile kernels on the GGUF's own types in {self.stored_layers} layers"
        elif self.cache is None:
            copy = "own BF16 copy"
        elif self.cache.temporary:
            copy = f"own {self.dtype.upper()} copy, quantized at load"
        else:
            copy = (f"own {self.dtype.upper()} copy, {self.loaded_from_cache} of {len(self.layers)} layers read from "
                    f"{self.cache.root}")
        return f"kt-kernel {self.variant} {self.moe_class.__name__} ({self.plan.describe()}, {copy})"
