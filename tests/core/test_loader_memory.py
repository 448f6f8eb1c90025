"""Loading holds one copy of the weights: peak RSS growth measured against checkpoint size.

Runs in fresh subprocesses so that the measurement sees only the load. The model (~300 MB of fp32
weights) is built in one process and loaded in another, after a warm-up load of a tiny model that
pays for every lazy import, and all loaded weights are read once so that mapped pages count. The
peak is the kernel's high-water mark reset after the warm-up (`/proc/self/clear_refs`), so spikes
from importing libraries (large on CUDA machines) are not charged to the load.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

BUILD = textwrap.dedent("""
    import os, sys
    from vismmoe_kt.demo.tiny import TinySpec, save_tiny_model
    spec = TinySpec(layers=4, experts=32, top_k=4, hidden=512, moe_intermediate=384, heads=8, kv_heads=4, head_dim=64)
    out = save_tiny_model(sys.argv[1], spec, seed=0, max_shard_size=sys.argv[2])
    print(sum(f.stat().st_size for f in out.glob("*.safetensors")))
""")

MEASURE = textwrap.dedent("""
    import json, sys
    import psutil, torch
    from vismmoe_kt import load
    cpu = dict(generate_device="cpu", prefill_device="cpu", progress=False)
    def high_water_mark():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    load(sys.argv[2], None, **cpu)  # warm-up: imports and first-use costs
    base = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    model, _ = load(sys.argv[1], None, **cpu)
    with torch.no_grad():
        checksum = sum(float(p.sum()) for p in model.parameters())  # touch every weight
    peak = high_water_mark()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"base": base, "peak": peak, "weights": weights}))
""")


def run(code, *args):
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_loading_does_not_hold_two_copies(tmp_path, tiny_dir):
    for shard_size in ("5GB", "100MB"):  # one file, then several shards
        model_dir = tmp_path / f"big-{shard_size}"
        checkpoint_bytes = int(run(BUILD, model_dir, shard_size))
        assert checkpoint_bytes > 250e6
        stats = json.loads(run(MEASURE, model_dir, tiny_dir))
        assert stats["weights"] >= 0.99 * checkpoint_bytes  # the whole model really was loaded
        growth = stats["peak"] - stats["base"]
        # one copy is ~1.0x; a second full copy would be >= 2.0x
        assert growth < 1.4 * checkpoint_bytes, (shard_size, growth / checkpoint_bytes)
