"""resolve_plan and the compatibility table, over the whole product of the options they read."""

import itertools

import pytest
import torch

from vismmoe_kt.runtime.budget import BudgetError
from vismmoe_kt.runtime.offload_compat import RULES
from vismmoe_kt.runtime.offload_plan import PlanFacts, resolve_plan
from vismmoe_kt.runtime.offload_settings import OffloadSettings

STORE = ("model", "q8_0", "q4_k", "auto")
SLABS = ("auto", "dequantized", "quantized")
MISS = ("wait", "cpu", "auto")
BACKEND = ("torch", "kt-kernel", "auto")
CPU_DTYPE = ("auto", "bf16", "int8")
BATCH = ("auto", "table", "grouped-gemm", "expert-major")


def auto_store(checkpoint, miss_policy, cpu_backend, lookahead):
    """store_dtype auto: the checkpoint's format, unless the predictor runs or a CPU share would compute from the
    model's dtype (cpu with a backend other than kt-kernel, auto with the backend left to choose)."""
    cpu_wants_model = miss_policy != "wait" and cpu_backend != "kt-kernel" and \
        (miss_policy == "cpu" or cpu_backend == "auto")
    return checkpoint if checkpoint and not lookahead and not cpu_wants_model else "model"


def expected_error(store_dtype, slab_format, miss_policy, cpu_backend, cpu_dtype, checkpoint, lookahead, tiles):
    """The rules restated plainly, in the table's order: the first message fragment that must be raised, or None."""
    hybrid = miss_policy != "wait"
    if slab_format == "quantized" and store_dtype == "model":
        return "or auto with a GGUF's quantized experts"
    if slab_format == "quantized" and hybrid:
        return f"works with miss_policy wait, not {miss_policy}"
    if cpu_dtype == "int8" and cpu_backend == "torch":
        return "cpu_dtype int8 needs cpu_backend kt-kernel"
    store = store_dtype if store_dtype != "auto" else auto_store(checkpoint, miss_policy, cpu_backend, lookahead)
    if slab_format == "quantized" and store == "model":
        return "not store_dtype model"
    if slab_format == "quantized" and not tiles:
        return "decodes whole 256-weight tiles"
    if slab_format == "quantized" and lookahead:
        return "slab_format quantized does not work with the lookahead predictor"
    if store != "model" and lookahead:
        return f"store_dtype {store} does not work with the lookahead predictor"
    if store != "model" and hybrid and cpu_backend == "torch":
        return f"store_dtype {store} with the hybrid mode needs cpu_backend: kt-kernel"
    return None


@pytest.mark.parametrize("tiles", [True, False])
def test_every_combination_of_options_is_refused_or_planned_consistently(tiles):
    hidden = inter = 256 if tiles else 64  # Q4_K takes whole 256-weight rows only: Q8_0 beside partial tiles
    stores, checkpoints = (STORE, (None, "q4_k")) if tiles else (("model", "q8_0", "auto"), (None, "q8_0"))
    experts, layers, top_k = 4, 3, 2
    checked = refused = 0
    for store_dtype, slab_format, miss_policy, cpu_backend, cpu_dtype, checkpoint, lookahead in itertools.product(
            stores, SLABS, MISS, BACKEND, CPU_DTYPE, checkpoints, (False, True)):
        asked = miss_policy
        # auto with the torch backend fetches every miss of a quantized store (its blocks are quantized bytes)
        # (quantized slabs asked for beside auto are refused before, with the settings)
        store = store_dtype if store_dtype != "auto" else auto_store(checkpoint, asked, cpu_backend, lookahead)
        miss_policy = "wait" if asked == "auto" and cpu_backend == "torch" and store in ("q8_0", "q4_k") \
            and slab_format != "quantized" else asked
        want = expected_error(store_dtype, slab_format, miss_policy, cpu_backend, cpu_dtype, checkpoint, lookahead,
                              tiles)
        facts = PlanFacts(layers, experts, hidden, inter, top_k, torch.float32, checkpoint_format=checkpoint,
                          lookahead=lookahead, table_kernels=False)
        try:
            settings = OffloadSettings(expert_budget=10**9, store_dtype=store_dtype, slab_format=slab_format,
                                       miss_policy=asked, cpu_backend=cpu_backend, cpu_dtype=cpu_dtype,
                                       predictor="p.pt" if lookahead else None, reservations="ahead")
            plan = resolve_plan(settings, facts, "cpu")
        except BudgetError as error:
            assert want is not None and want in str(error), (store_dtype, slab_format, miss_policy, cpu_backend,
                                                             cpu_dtype, checkpoint, lookahead, str(error))
            refused += 1
            continue
        checked += 1
        assert want is None, (store_dtype, slab_format, miss_policy, cpu_backend, cpu_dtype, checkpoint, lookahead)
        quantized_store = plan.store_format != "model"
        assert plan.settings.store_dtype == plan.store_format
        assert store_dtype == "auto" or plan.store_format == store_dtype
        if plan.quantized_slabs:  # only where quantized slabs work, and auto takes them wherever they do
            assert quantized_store and miss_policy == "wait" and not lookahead and tiles
        elif slab_format == "auto":
            assert not (quantized_store and miss_policy == "wait" and not lookahead and tiles)
        assert plan.hybrid == (miss_policy != "wait") and plan.decode_cpu == plan.hybrid  # on the CPU: decode's too
        assert plan.table_decode is not None  # on the CPU, every valid combination decodes through the table
        assert plan.batch_table == (not plan.hybrid and not lookahead)
        assert set(plan.why) - {"fill"} == {"store", "slabs", "pinned", "misses", "decode", "batch", "eviction", "prefill",
                                            "reservations"}
        # landings reserved a step ahead (asked for) wherever decode's host work between steps needs no step's records
        assert (plan.reservations == "ahead") == (not plan.decode_cpu and not lookahead)
        assert bool(plan.why["misses"]) == (asked != miss_policy) and plan.settings.miss_policy == miss_policy
        # a prompt skips placement only where every offloaded expert has a quantized slab
        assert (plan.prefill == "filled-slabs") == (plan.fill_slabs and plan.quantized_slabs)
        assert not plan.prefill_kernels  # the CPU: the torch twin
        assert len(plan.describe()) == 9 + plan.fill_slabs and plan.eviction == "vismmoe"  # no `eviction` key: the policy's
    assert checked and refused


def test_every_row_of_the_table_is_reachable():
    """Each row of the compatibility table is the first to hold for some combination (none is dead)."""
    seen = set()
    for store_dtype, slab_format, miss_policy, cpu_backend, cpu_dtype, lookahead, tiles, built in itertools.product(
            STORE, SLABS, MISS, BACKEND, CPU_DTYPE, (False, True), (False, True), (None, "torch")):
        store = "model" if store_dtype in ("model", "auto") else store_dtype
        values = {"slab_format": slab_format, "store_dtype": store_dtype, "miss_policy": miss_policy,
                  "cpu_backend": cpu_backend, "cpu_dtype": cpu_dtype, "store": "model" if store == "model" else
                  "quantized", "store_format": store, "lookahead": lookahead, "whole_tiles": tiles,
                  "backend_built": built}
        first = next((i for i, rule in enumerate(RULES) if rule.holds(values)), None)
        seen.add(first)
    assert seen >= set(range(len(RULES)))


@pytest.mark.parametrize("batch_experts", BATCH)
@pytest.mark.parametrize("kernels", [False, True])
def test_the_batched_executors_by_batch_experts_and_kernels(batch_experts, kernels):
    """batch_experts: auto is the table kernel then expert-major where the Triton kernels run (CUDA),
    grouped GEMM where not; table needs the kernels; quantized slabs run an offloaded layer's tokens at
    once for auto and expert-major."""
    facts = PlanFacts(3, 4, 256, 256, 2, torch.bfloat16, table_kernels=kernels, expert_major_kernels=True,
                      quantized_major_kernels=True)
    device = torch.device("cuda") if kernels else "cpu"
    settings = OffloadSettings(expert_budget=10**9, store_dtype="q4_k", batch_experts=batch_experts)
    plan = resolve_plan(settings, facts, device)
    want = {"auto": "table-then-expert-major" if kernels else "grouped-gemm",
            "table": "table" if kernels else "grouped-gemm"}.get(batch_experts, batch_experts)
    assert plan.batch_pinned == want and plan.table_kernels == kernels
    assert plan.batch_offloaded == ("quantized-expert-major" if batch_experts in ("auto", "expert-major") else "table")
    assert plan.batch_pinned_kernels == kernels and plan.table_decode == "quantized-slabs"
    with pytest.raises(BudgetError, match="batch_experts 'sideways' is not one of"):
        OffloadSettings(expert_budget=10**9, batch_experts="sideways")


def test_no_table_decode_before_the_activation_is_known_nor_on_cuda_without_kernels():
    settings = OffloadSettings(expert_budget=10**9)
    facts = PlanFacts(3, 4, 256, 256, 2, torch.bfloat16)
    assert resolve_plan(settings, facts, "cpu").table_decode is None  # enable_table not called yet
    cuda = resolve_plan(settings, PlanFacts(3, 4, 256, 256, 2, torch.bfloat16, table_kernels=False), "cuda")
    assert cuda.table_decode is None and "no Triton kernels" in cuda.why["decode"]
    assert resolve_plan(settings, PlanFacts(3, 4, 256, 256, 2, torch.bfloat16, table_kernels=True),
                        "cuda").table_decode == "slabs"


def test_the_runtime_summary_carries_the_plan_and_stats_print_it():
    from vismmoe_kt.core.stats import format_stats
    from vismmoe_kt.runtime.offload import OffloadRuntime

    settings = OffloadSettings(expert_budget=3 * 4 * 3 * 256 * 256 * 4, store_dtype="q8_0", pinned_layers=1)
    runtime = OffloadRuntime(settings, [0, 1, 2], 4, 256, 256, torch.float32, "cpu", top_k=2)
    assert runtime.enable_table(torch.nn.SiLU())
    plan = runtime.summary()["plan"]
    assert plan == runtime.plan.describe() and plan[0] == "store: q8_0 (given)"
    assert "decode: table (quantized-slabs)" in plan[4]
    entry = {"count": 3, "pinned_layers": 1, "slabs": runtime.num_slabs, "fetches": 0, "evictions": 0, "plan": plan}
    text = format_stats({"torch_threads": 1, "operators": {"VisExperts": entry}})
    assert "offload plan:\n    store: q8_0 (given)" in text and "plan=" not in text


def hybrid_plan(device, cpu_streams, cpu_backend="torch"):
    """The default rule file's hybrid (miss_policy auto, eviction auto) with the activation known: one pinned
    layer, four slabs for the two offloaded layers' eight experts."""
    layer = 4 * 3 * 256 * 256 * 2
    settings = OffloadSettings(expert_budget=2 * layer, pinned_layers=1, miss_policy="auto", cpu_backend=cpu_backend,
                               eviction="auto")
    facts = PlanFacts(3, 4, 256, 256, 2, torch.bfloat16, table_kernels=True, expert_major_kernels=True,
                      quantized_major_kernels=True, cpu_streams=cpu_streams)
    plan = resolve_plan(settings, facts, device)
    assert plan.num_slabs == 4 and plan.pinned_depth == 1
    return plan


def test_a_cpu_backend_that_cannot_run_in_a_cuda_stream_serves_prefill_and_decode_fetches_through_the_table():
    """cpu_backend torch on CUDA: the hybrid stays for prefill; decode reads through the table (one graph a
    step) with its misses over PCIe, as under wait, so `eviction: auto` reaches its trial and a batched step's
    offloaded layers take the table."""
    plan = hybrid_plan("cuda", cpu_streams=False)
    assert plan.hybrid and not plan.decode_cpu  # prefill's misses may go to the CPU, decode's not
    assert plan.table_decode == "slabs" and plan.table_kernels
    assert "misses in decode go over PCIe" in plan.why["decode"] and "cannot run inside a CUDA stream" in \
        plan.why["decode"] and "it serves prefill" in plan.why["decode"]
    assert plan.eviction == "auto" and "time lru against vismmoe" in plan.why["eviction"]
    assert plan.batch_offloaded == "table" and plan.batch_table
    lines = plan.describe()
    assert lines[3] == "misses: hybrid, auto in prefill, fetched in decode"
    assert lines[4].startswith("decode: table (slabs, Triton kernels)") and "over PCIe" in lines[4]


@pytest.mark.parametrize("device, cpu_streams", [("cuda", True), ("cpu", False), ("cpu", True)])
def test_a_cpu_backend_that_runs_inside_the_step_keeps_decodes_cpu_share(device, cpu_streams):
    """kt-kernel's in-stream calls on CUDA, and any backend on the CPU device: decode's misses may go to the CPU
    inside the table step, as before (the batched step's offloaded layers on the placement path)."""
    plan = hybrid_plan(device, cpu_streams, "kt-kernel" if cpu_streams else "torch")
    assert plan.hybrid and plan.decode_cpu and plan.table_decode == "slabs"
    assert "PCIe" not in plan.why["decode"] and plan.batch_offloaded == "placement"
    assert plan.eviction == ("auto" if device == "cuda" else "vismmoe")
    assert plan.describe()[3] == "misses: hybrid, auto"


def test_without_table_decode_the_placement_paths_decode_keeps_the_cpu():
    """No Triton kernels on CUDA: decode on the placement path, whose misses the hybrid still splits."""
    layer = 4 * 3 * 256 * 256 * 2
    settings = OffloadSettings(expert_budget=2 * layer, pinned_layers=1, miss_policy="auto", eviction="auto")
    plan = resolve_plan(settings, PlanFacts(3, 4, 256, 256, 2, torch.bfloat16, table_kernels=False), "cuda")
    assert plan.table_decode is None and plan.hybrid and plan.decode_cpu and plan.batch_offloaded == "placement"
    assert "PCIe" not in plan.why["decode"] and plan.eviction == "vismmoe"


def test_the_default_rules_keep_a_gguf_s_quantized_experts_as_stored():
    """qwen3vl.yaml's miss_policy auto with the torch backend on a Q4_K GGUF: the store keeps the file's blocks
    (in the model's dtype the budget would hold 3.6x fewer experts) and misses are fetched, since that backend
    cannot read blocks; a CPU share asked for (cpu) keeps the model's dtype for it, kt-kernel takes the blocks."""
    facts = PlanFacts(48, 128, 2048, 768, 8, torch.bfloat16, checkpoint_format="q4_k")
    defaults = OffloadSettings(expert_budget="6GiB", miss_policy="auto", cpu_backend="torch")
    plan = resolve_plan(defaults, facts, "cpu")
    assert plan.store_format == "q4_k" and plan.quantized_slabs and not plan.hybrid
    assert "misses are fetched" in plan.why["store"] and plan.settings.miss_policy == "wait"
    asked = resolve_plan(OffloadSettings(expert_budget="6GiB", miss_policy="cpu", cpu_backend="torch"), facts, "cpu")
    assert asked.store_format == "model" and "computes misses from the model's dtype" in asked.why["store"]
    kt = resolve_plan(OffloadSettings(expert_budget="6GiB", miss_policy="cpu", cpu_backend="kt-kernel"), facts, "cpu")
    assert kt.store_format == "q4_k" and kt.hybrid
