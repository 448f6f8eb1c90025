"""How many kt-kernel workers, on which NUMA nodes, and how many cores stay free for everything else.

kt-kernel's worker pool pins each worker to a core of its NUMA node (the first cores of the node).
If the pool takes every core, the threads that feed it (the Python thread driving the GPU, kt-kernel's
queue thread, CUDA's host-callback thread that submits and awaits CPU work inside a graph) share
cores with pinned, spinning workers, and their waits land on scheduler ticks (4 ms each: the 8.0 /
8.0 / 24.0 ms per layer measured for 1 / 8 / 64 tokens with 16 workers on 16 cores). KTransformers
therefore runs fewer workers than cores; so do we:

    workers = the requested count (`--cpu_infer`), else physical cores - RESERVED_CORES (at least 1)
    one sub-pool per NUMA node that has cores this process may use, workers split in proportion to
    the node's cores (largest remainder), so every worker reads the memory of its own node

Physical cores are the ones in this process's affinity mask, counted once per SMT sibling group
(sysfs topology; without sysfs, the affinity mask's size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RESERVED_CORES = 2  # the GPU-feeding Python thread, and kt-kernel's queue / CUDA's callback thread
SYSFS = Path("/sys/devices/system")


def _cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _core_of(cpu: int, root: Path) -> tuple[str, str]:
    """(package, core) of a logical CPU: SMT siblings share it."""
    topology = root / "cpu" / f"cpu{cpu}" / "topology"
    try:
        return ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
    except OSError:
        return ("", str(cpu))  # no topology: every logical CPU counts as a core


def numa_cores(root: Path = SYSFS, allowed: set[int] | None = None) -> dict[int, int]:
    """NUMA node -> physical cores of it this process may run on (nodes without any left out)."""
    allowed = _allowed_cpus() if allowed is None else allowed
    nodes: dict[int, list[int]] = {}
    for node_dir in sorted((root / "node").glob("node[0-9]*")) if (root / "node").is_dir() else []:
        try:
            cpus = [c for c in _cpu_list((node_dir / "cpulist").read_text()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(node_dir.name[4:])] = cpus
    if not nodes:  # no NUMA information: one node with everything allowed
        nodes = {0: sorted(allowed)}
    return {node: len({_core_of(cpu, root) for cpu in cpus}) for node, cpus in nodes.items()}


@dataclass(frozen=True)
class WorkerPlan:
    nodes: tuple[int, ...]         # NUMA node of each sub-pool
    threads: tuple[int, ...]       # workers of each sub-pool
    cores: int                     # physical cores this process may use
    requested: int | None          # `--cpu_infer`, or None for the default

    @property
    def workers(self) -> int:
        return sum(self.threads)

    @property
    def free_cores(self) -> int:
        """Cores no worker is pinned to (negative: more workers than cores, as requested)."""
        return self.cores - self.workers

    def describe(self) -> str:
        pools = ", ".join(f"node {n}: {t}" for n, t in zip(self.nodes, self.threads))
        why = f"--cpu_infer {self.requested}" if self.requested else f"{self.cores} cores - {RESERVED_CORES} reserved"
        return f"{self.workers} workers ({pools}; {why})"


def plan_workers(requested: int | None = None, cores_by_node: dict[int, int] | None = None) -> WorkerPlan:
    """The worker pool for this machine (see the module docstring)."""
    if requested is not None and requested < 1:
        raise ValueError(f"CPU expert workers must be at least 1, got {requested}")
    by_node = numa_cores() if cores_by_node is None else dict(cores_by_node)
    cores = sum(by_node.values())
    total = requested if requested is not None else max(1, cores - RESERVED_CORES)
    nodes = sorted(by_node)
    shares = [total * by_node[n] / cores for n in nodes]
    threads = [int(s) for s in shares]
    for i in sorted(range(len(nodes)), key=lambda i: threads[i] - shares[i])[:total - sum(threads)]:
        threads[i] += 1  # largest remainders first
    kept = [(n, t) for n, t in zip(nodes, threads) if t > 0]
    return WorkerPlan(tuple(n for n, _ in kept), tuple(t for _, t in kept), cores, requested)


def worker_pool_config(plan: WorkerPlan, ext):
    """kt-kernel's WorkerPoolConfig for `plan` (`ext`: kt_kernel.kt_kernel_ext)."""
    config = ext.WorkerPoolConfig()
    config.subpool_count = len(plan.threads)
    config.subpool_numa_map = list(plan.nodes)
    config.subpool_thread_count = list(plan.threads)
    return config


def leave_cores_to_workers() -> None:
    """While kt-kernel serves a CUDA model, torch's CPU threads do little (the GPU computes the rest):
    keep them to the reserved cores, so they do not compete with the pinned workers."""
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), RESERVED_CORES))


def live_threads() -> dict[int, tuple[str, frozenset[int]]]:
    """This process's threads: id -> (name, the CPUs it may run on). Linux only (empty elsewhere)."""
    out: dict[int, tuple[str, frozenset[int]]] = {}
    task_dir = Path("/proc/self/task")
    if not task_dir.is_dir():
        return out
    for entry in task_dir.iterdir():
        try:
            tid = int(entry.name)
            out[tid] = ((entry / "comm").read_text().strip(), frozenset(os.sched_getaffinity(tid)))
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return out
