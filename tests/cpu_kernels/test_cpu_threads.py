"""The CPU experts' worker plan: cores minus the reserved ones, split by NUMA node; sysfs topology
read with SMT siblings counted once; and kt-kernel's live pool never oversubscribing the cores."""

import gc

import pytest
import torch

from cpu_kernels.isa import kt_kernel_installed
from cpu_kernels.threads import RESERVED_CORES, live_threads, numa_cores, plan_workers


def test_default_leaves_the_reserved_cores_free():
    plan = plan_workers(None, {0: 16})
    assert plan.workers == 16 - RESERVED_CORES and plan.free_cores == RESERVED_CORES
    assert plan.nodes == (0,) and "16 cores - 2 reserved" in plan.describe()


def test_small_machines_keep_one_worker_and_requests_win():
    assert plan_workers(None, {0: 2}).workers == 1
    assert plan_workers(None, {0: 1}).workers == 1
    plan = plan_workers(6, {0: 16})
    assert plan.workers == 6 and "--cpu_infer 6" in plan.describe()
    with pytest.raises(ValueError, match="at least 1"):
        plan_workers(0, {0: 4})


def test_workers_split_across_numa_nodes_by_their_cores():
    plan = plan_workers(None, {0: 32, 1: 32})
    assert plan.nodes == (0, 1) and plan.threads == (31, 31)
    plan = plan_workers(7, {0: 12, 1: 4})  # 5.25 and 1.75: the larger remainder gets the odd worker
    assert plan.threads == (5, 2) and plan.workers == 7
    plan = plan_workers(1, {0: 8, 1: 8})  # a node with no worker gets no sub-pool
    assert plan.nodes == (0,) and plan.threads == (1,)


def _fake_sysfs(root, nodes, siblings):
    """nodes: node -> logical CPUs; siblings: logical CPU -> core id (SMT pairs share one)."""
    for node, cpus in nodes.items():
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    for cpu, core in siblings.items():
        topology = root / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")


def test_numa_cores_counts_smt_siblings_once_within_the_affinity(tmp_path):
    # two nodes of 2 cores x 2 threads: cpus 0-3 on node 0 (cores 0,1), 4-7 on node 1 (cores 2,3)
    _fake_sysfs(tmp_path, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, {c: c // 2 for c in range(8)})
    assert numa_cores(tmp_path, allowed=set(range(8))) == {0: 2, 1: 2}
    assert numa_cores(tmp_path, allowed={0, 2, 3}) == {0: 2}  # node 1 not allowed at all
    (tmp_path / "node" / "node0" / "cpulist").write_text("0-3\n")  # the range form
    assert numa_cores(tmp_path, allowed=set(range(8)))[0] == 2


def test_numa_cores_without_sysfs_uses_the_affinity(tmp_path):
    assert numa_cores(tmp_path / "absent", allowed={0, 1, 5}) == {0: 3}


@pytest.mark.skipif(not kt_kernel_installed(), reason="kt_kernel is not installed")
def test_kt_kernel_pool_pins_one_worker_per_core_and_leaves_cores_free():
    from cpu_kernels.kt_backend import KtKernelBackend

    before = live_threads()
    backend = KtKernelBackend(16, 4, 128, 64)  # the default plan
    new = {tid: v for tid, v in live_threads().items() if tid not in before}
    plan = backend.plan
    pinned = [cpus for _, cpus in new.values() if len(cpus) == 1]
    assert len(pinned) == plan.workers  # one pinned thread per worker, no more
    assert len({next(iter(c)) for c in pinned}) == plan.workers  # each on its own core
    assert len(new) <= plan.workers + 2  # plus kt-kernel's queue thread (and at most one more)
    if plan.cores > RESERVED_CORES:
        assert plan.free_cores == RESERVED_CORES
    assert torch.get_num_threads() >= 1
    del backend
    gc.collect()
