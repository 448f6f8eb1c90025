"""CPU expert backends at Qwen3-VL-30B-A3B's expert shape: time per call for 8 routed experts.

One MoE layer (128 experts, H 2048, I 768, BF16, random weights), tokens routed to 8 fixed experts,
for 1, 8 and 64 tokens; kt-kernel (its AMX / AVX-512 build) vs torch (oneDNN), same threads. Also
the host memory bandwidth (a large copy), to read the 1-token figure against.

    PYTHONPATH=.:KT_DIR python3 -m benchmarks.cpu_backend_bench --threads 16
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch


from cpu_kernels.isa import detect_isa, kt_kernel_installed
from cpu_kernels.torch_backend import TorchCpuBackend
from vismmoe_kt.apps.arguments import FlagParser

E, K, H, I = 128, 8, 2048, 768


def median_ms(fn, repeats=20):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main():
    parser = FlagParser()
    parser.add_argument("--threads", type=int, default=16, help="torch and kt-kernel CPU threads")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    big = torch.empty(2 * 2**30, dtype=torch.uint8)
    big.fill_(1)
    dst = torch.empty_like(big)
    copy_ms = median_ms(lambda: dst.copy_(big), repeats=5)
    rows = {"isa": detect_isa().best, "threads": args.threads, "host_copy_GBps": 2 * 2 * 2**30 / copy_ms / 1e6}
    del big, dst
    gate_up = (torch.randn(E, 2 * I, H) * 0.02).bfloat16()
    down = (torch.randn(E, H, I) * 0.02).bfloat16()
    backends = [TorchCpuBackend()]
    if kt_kernel_installed():
        from cpu_kernels.kt_backend import KtKernelBackend

        backends.append(KtKernelBackend(E, K, H, I, threads=args.threads))
    for backend in backends:
        backend.add_layer(0, gate_up, down)
        for tokens in (1, 8, 64):
            hidden = torch.randn(tokens, H).bfloat16()
            ids = torch.arange(K).repeat(tokens, 1)
            weights = torch.full((tokens, K), 1 / K)
            ms = median_ms(lambda: backend.submit(0, hidden, ids, weights).wait())
            rows[f"{backend.name}_{tokens}tok_ms"] = round(ms, 3)
            rows[f"{backend.name}_{tokens}tok_ms_per_expert_token"] = round(ms / (K * tokens), 4)
        print(backend.describe(), flush=True)
    print(json.dumps(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
