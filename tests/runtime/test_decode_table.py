"""The decode table under random interleavings of decode steps, prefills, prefetches and late copies.

An OffloadRuntime on the CPU with copies that land late: a copy first poisons its slab with NaN and
writes the real weights only when its (fake) event completes, so a table entry that pointed at a
slab still being written, or at a slab overwritten while the table still pointed at it, would show
as NaN or wrong outputs. After every operation: each table entry points at a resident slab holding
exactly that expert, no landing reservation is pointed at, and every layer's output equals the
experts computed straight from the host store. With a lookahead, every layer of a decode step also
prefetches random (layer, expert) pairs into landing slots (claims racing the layers' own misses).
"""

import random
import threading
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vismmoe_kt.runtime.budget import BudgetError
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_plan import PlanFacts, resolve_plan
from vismmoe_kt.runtime.offload_settings import OffloadSettings
from vismmoe_kt.runtime.slab_cache import SlabState
from vismmoe_kt.runtime.store import block_views
from vismmoe_kt.runtime.transfers import Transfers

E, H, I, K = 8, 16, 8, 2
LAYERS = [0, 1, 2, 3]


class LateCopy:
    """A copy event that completes when the test's random source says so (or when waited on)."""

    def __init__(self, transfers, slab, key, rng):
        self.transfers, self.slab, self.key, self.rng, self.done = transfers, slab, key, rng, False

    def _finish(self):
        if not self.done:
            for dst, src in zip((self.transfers.pool[0][self.slab], self.transfers.pool[1][self.slab]),
                                self.transfers.store.block_parts(*self.key)):
                dst.copy_(src)
            self.done = True

    def query(self):
        if not self.done and self.rng.random() < 0.3:
            self._finish()
        return self.done

    def synchronize(self):
        self._finish()


class LateTransfers(Transfers):
    def __init__(self, *args, rng, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = rng

    def _copy_batch(self, slabs, keys, urgent):
        for slab, key in zip(slabs, keys):  # each copy of a batch lands on its own (as late as the batch, or sooner)
            self.counters.bytes_copied += self.store.block_bytes
            self.counters.copies += 1
            self.pool[0][slab].fill_(float("nan"))  # the slab is being written: garbage until the copy lands
            self.pool[1][slab].fill_(float("nan"))
            self.events[slab] = LateCopy(self, slab, key, self.rng)

    def wait_for(self, slabs):  # the placement path's compute waits for the copies it needs
        for slab in slabs:
            if slab in self.events:
                self.events[slab].synchronize()
        self.poll()


class RandomLookahead:
    """Candidates from a seeded generator, some blank (-1), some pinned or resident, some repeated
    across layers: the table must land each expert at most once, wherever the claims fall."""

    def __init__(self, seed, budget=5):
        self.generator, self.budget, self.steps = torch.Generator().manual_seed(seed), budget, 0

    def candidates(self, row, hidden, routed):
        rows = torch.randint(0, len(LAYERS), (self.budget,), generator=self.generator)
        experts = torch.randint(-1, E, (self.budget,), generator=self.generator)
        return rows, experts

    def predicts_at(self, row):
        return True

    def end_step(self, routed):
        self.steps += 1

    def start_decode(self, visual):
        pass


def make_runtime(seed, slabs, policy, lookahead=False, reservations="before-step"):
    torch.manual_seed(seed)
    block = 3 * I * H * 4
    settings = OffloadSettings(expert_budget=(E + slabs) * block, policy=policy, pinned_layers=1 if policy == "vismmoe" else 0,
                               prefetch_window=2, reservations=reservations)
    runtime = OffloadRuntime(settings, LAYERS, E, H, I, torch.float32, "cpu", top_k=K,
                             lookahead=RandomLookahead(seed) if lookahead else None)
    weights = {}
    for layer in LAYERS:
        gate_up, down = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
        runtime.load_layer(layer, gate_up, down)
        weights[layer] = (gate_up, down)
    assert runtime.enable_table(torch.nn.SiLU())
    runtime.transfers = LateTransfers(runtime.store, runtime.pool, runtime.cache, runtime.lock, 4,
                                      rng=random.Random(seed))
    runtime.switch_phase(runtime.phase)
    return runtime, weights


def reference(weights, hidden, ids, w):
    gate_up, down = weights
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (gate_up[e] @ hidden[t]).chunk(2)
            out[t] += w[t, k] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def check_table(runtime, settled=True):
    """settled: at a boundary, where the host knows what landed; right after a step it does not yet
    (the device table already points at what landed in it, which the data check still covers)."""
    cache, table, boundary = runtime.cache, runtime.table.slots, runtime.boundary
    # the landings the next step writes: its reservations, or with reservations ahead, once it is armed, the
    # last queued set; the sets of queued steps before it hold what those steps landed, unknown to the host yet
    sets = list(boundary.launched)
    writing = sets.pop() if boundary.ahead and boundary.armed and sets else boundary.reserved
    reserved = {s for slabs in writing.values() for s in slabs}
    unaccounted = {s for landing in sets for slabs in landing.values() for s in slabs}
    every_set = [slab for landing in [*boundary.launched, boundary.reserved, boundary.spare]
                 for slabs in landing.values() for slab in slabs]
    assert len(every_set) == len(set(every_set)), "two landing sets share a slab"
    for row, layer in enumerate(runtime.moe_layers):
        if layer in runtime.pinned:
            assert table[row, :E].tolist() == list(range(E))
            continue
        gate_up, down = block_views(runtime.store.layers[layer], I, H)
        for expert in range(E):
            slab = int(table[row, expert])
            if slab < 0:
                continue
            if settled:
                assert slab not in reserved, f"the table points at landing reservation {slab}"
            if settled and slab not in unaccounted:
                assert cache.owner[slab] == (layer, expert) and cache.state[slab] is SlabState.RESIDENT
            assert torch.equal(runtime.pool[0][slab], gate_up[expert]), f"slab {slab} does not hold {(layer, expert)}"
            assert torch.equal(runtime.pool[1][slab], down[expert])
    for slab, key in enumerate(cache.owner):  # what the host believes each resident slab holds, it holds
        if key is not None and key[1] >= 0 and cache.state[slab] is SlabState.RESIDENT:
            gate_up, _ = block_views(runtime.store.layers[key[0]], I, H)
            assert torch.equal(runtime.pool[0][slab], gate_up[key[1]]), f"slab {slab} is not {key}"
    cache.check_invariants()


def route(rng, tokens, favourites):
    ids = [rng.sample(favourites if rng.random() < 0.7 else range(E), K) for _ in range(tokens)]
    return torch.tensor(ids), torch.rand(tokens, K)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), slabs=st.integers(E, 2 * E), policy=st.sampled_from(["vismmoe", "lru"]),
       ops=st.lists(st.sampled_from(["decode", "decode", "decode", "prefill", "prefetch", "poll"]), min_size=5, max_size=30),
       lookahead=st.booleans(), ahead=st.sampled_from(["before-step", "ahead", "trial"]))
def test_table_never_points_at_a_slab_being_written(seed, slabs, policy, ops, lookahead, ahead):
    """`trial`: `reservations: auto`'s trial, never settling (it tries again every two runs, on a clock of random
    step times), so decode keeps changing ways between its steps, prefills and prefetches."""
    from vismmoe_kt.runtime.reservations import ReservationsTrial
    from vismmoe_kt.runtime.step_trial import StepTrial

    runtime, weights = make_runtime(seed, slabs, policy, lookahead, "ahead" if ahead == "ahead" else "before-step")
    assert runtime.boundary.ahead == (ahead == "ahead" and not lookahead)
    rng = random.Random(seed)
    if ahead == "trial" and not lookahead:  # (a lookahead keeps before-step: the plan never gives it the trial)
        clock = random.Random(seed + 1).random
        runtime.boundary.reservations = trial = ReservationsTrial(clock=clock)
        trial.trial = StepTrial(0, samples=1, hold=2, clock=clock, run=3)
    favourites = rng.sample(range(E), 4)
    act = torch.nn.SiLU()
    with torch.no_grad():
        for op in ops:
            if op in ("decode", "prefill"):
                tokens = 1 if op == "decode" else 3
                if op == "decode":
                    runtime.before_step()
                    check_table(runtime)
                for layer in LAYERS:
                    hidden = torch.randn(tokens, H)
                    ids, w = route(rng, tokens, favourites)
                    out = runtime.run_layer(layer, hidden, ids, w, act)
                    torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
                if op == "decode":
                    runtime.after_step()
            elif op == "prefetch":
                items = [((rng.choice(LAYERS[1:]), rng.randrange(E)), rng.random()) for _ in range(rng.randrange(1, 6))]
                runtime.prefetch(list(dict(items).items()))
            else:
                with runtime.lock:
                    runtime.transfers.poll()
            if not runtime.boundary.stale:
                check_table(runtime, settled=not runtime.table._pending)
        runtime.before_step()
        check_table(runtime)


def test_decode_misses_land_and_then_hit():
    """A miss is read from the host and written to a landing slab in the same step; the next step
    with the same routing hits it (no copy issued, the bytes were read once)."""
    runtime, weights = make_runtime(0, 2 * E, "lru")
    hidden, ids, w = torch.randn(1, H), torch.tensor([[1, 5]]), torch.rand(1, K)
    runtime.before_step()
    for layer in LAYERS:
        runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
    runtime.after_step()
    runtime.before_step()
    for layer in LAYERS:
        runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
    runtime.after_step()
    runtime.before_step()
    runtime.after_step()  # step 2 was quiet (hits only): the host accounts it once step 3 is launched
    counters = [runtime.counters["decode"][layer] for layer in LAYERS]
    assert [(c.hits, c.misses) for c in counters] == [(0 + 2, 2)] * 4  # step 1: 2 misses; step 2: 2 hits
    assert runtime.copy_counters["decode"].bytes_host_reads == 4 * 2 * runtime.store.block_bytes
    assert runtime.copy_counters["decode"].copies == 0
    assert all((layer, e) in runtime.cache.where for layer in LAYERS for e in (1, 5))


STORE_MEMORY = r"""
import psutil, torch
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_settings import OffloadSettings
process = psutil.Process()
e, h, i = 8, 1024, 1024  # 12 MiB blocks, 96 MiB layers: well above malloc's mmap threshold
settings = OffloadSettings(expert_budget=3 * e * 3 * i * h * 4, policy="lru")
runtime = OffloadRuntime(settings, [0, 1, 2], e, h, i, torch.float32, "cpu", top_k=2)
start = process.memory_info().rss
for layer in (0, 1, 2):
    runtime.load_layer(layer, torch.ones(e, 2 * i, h), torch.ones(e, h, i))
store = runtime.store.nbytes
assert store == 3 * e * 3 * i * h * 4 and all(t.untyped_storage().nbytes() == store // 3
                                               for t in runtime.store.layers.values())
grown = process.memory_info().rss - start
assert grown > 0.9 * store, (grown, store)
runtime.close()
assert runtime.store.layers == {}
left = process.memory_info().rss - start
assert left < 0.1 * store, (left, store)
print("ok")
"""


def test_store_memory_is_exact_and_returns_after_close():
    """The host store takes exactly its blocks (no rounding) and gives them back on close. In a process of its
    own: the resident memory of one that ran other tests depends on what their allocations left behind."""
    import subprocess
    import sys

    pytest.importorskip("psutil")
    done = subprocess.run([sys.executable, "-c", STORE_MEMORY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_kernels_serve_silu_gating_only():
    """What decides the Triton path: the activation's values (transformers' SiLU module included)."""
    from transformers.activations import ACT2FN

    from vismmoe_kt.runtime.kernels import bf16_gemv
    from vismmoe_kt.runtime.table_experts import is_silu, kernel_usable

    assert is_silu(ACT2FN["silu"]) and is_silu(torch.nn.SiLU()) and is_silu(torch.nn.functional.silu)
    assert not is_silu(ACT2FN["gelu"]) and not is_silu(torch.relu)
    cuda = torch.device("cuda")
    assert kernel_usable(cuda, torch.bfloat16, ACT2FN["silu"]) == bf16_gemv.available(torch.bfloat16)
    assert not kernel_usable(cuda, torch.bfloat16, ACT2FN["gelu"])
    assert not kernel_usable(torch.device("cpu"), torch.bfloat16, ACT2FN["silu"])


def test_a_pool_holding_every_expert_stops_missing_once_warm(tmp_path):
    """A slab for every offloaded expert (Q4_K slabs): once every expert has landed, decode never evicts
    and never reads the host, for one request or a batch. The decode table's landing reservations
    took slabs from a full pool, and each one evicted a resident expert, which the next step missed."""
    from vismmoe_kt import load
    from vismmoe_kt.demo.tiny import SPECS, build_tiny_model, save_tiny_model
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.engine.decoding import decode_engine
    from vismmoe_kt.operators.source_router import install_routing
    from vismmoe_kt.operators.vis_experts import VisExperts

    spec = SPECS["tiny-3x32"]
    model_dir = save_tiny_model(tmp_path / "m", spec, seed=0)
    _, processor = build_tiny_model(spec, seed=0)
    block = 3 * spec.hidden * spec.moe_intermediate // 256 * 144  # a Q4_K expert
    # the pinned layer's Q4_K blocks, and 66 slabs
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=(spec.experts + 66) * block,
                    store_dtype="q4_k", slab_format="quantized", graphs="off", pinned_layers=1,
                    generate_device="cpu", prefill_device="cpu", progress=False)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert runtime.num_slabs == 2 * spec.experts  # every offloaded expert has a slab, two to spare
    install_routing(model, "synthetic:0")  # realistic routing: decode reaches experts prefill did not
    prompts = [processor(text=[f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
               for t in ("hello there", "what is this about", "two words", "cats and dogs")]
    with torch.no_grad():
        for _ in range(3):  # warm: every expert routed to at least once lands
            generate_batch(model, [dict(p) for p in prompts], 12, max_batch=4, min_new_tokens=12)
        with runtime.lock:  # whatever is still cold, as a long image prefill would route to it
            runtime.boundary.leave()
            runtime.transfers.fetch([(l, e) for l in runtime.moe_layers if l not in runtime.pinned
                                     for e in range(runtime.num_experts) if (l, e) not in runtime.cache.where])
        before = runtime.summary()
        hits = sum(c.hits for c in runtime.counters["decode"].values())
        decode_engine(model).forget()
        generate(model, dict(prompts[0]), 12, min_new_tokens=12)
        generate_batch(model, [dict(p) for p in prompts], 12, max_batch=4, min_new_tokens=12)
        after = runtime.summary()
    assert sum(c.hits for c in runtime.counters["decode"].values()) > hits  # decode ran through the table
    assert after["decode_evictions"] == before["decode_evictions"]
    assert after["bytes_host_reads_decode"] == before["bytes_host_reads_decode"]


def test_a_prompt_on_filled_quantized_slabs_reads_no_routing_on_the_host(tmp_path):
    """Q4_K slabs with a slab for every offloaded expert: the first prompt copies every expert in (once) and
    its offloaded layers read their experts through the row maps, with no device->host read; the tokens are
    those of the same Q4_K store one slab short of every expert (the placement path: a read per layer).
    A reset empties the slabs; the next prompt fills them again."""
    from vismmoe_kt import load
    from vismmoe_kt.demo.tiny import SPECS, build_tiny_model, save_tiny_model
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.operators.vis_experts import VisExperts

    spec = SPECS["tiny-3x32"]
    model_dir = save_tiny_model(tmp_path / "m", spec, seed=0)
    _, processor = build_tiny_model(spec, seed=0)
    block = 3 * spec.hidden * spec.moe_intermediate // 256 * 144  # a Q4_K expert
    prompt = processor(text=["<|im_start|>user\nwhat is this about<|im_end|>\n<|im_start|>assistant\n"],
                       return_tensors="pt")
    runs = {}
    for slabs in (64, 63):
        model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml",
                        expert_budget=(spec.experts + slabs) * block,  # the pinned layer's blocks, and the slabs
                        store_dtype="q4_k", slab_format="quantized", graphs="off", pinned_layers=1,
                        generate_device="cpu", prefill_device="cpu", progress=False)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        assert runtime.num_slabs == slabs
        reads = []
        to_host = runtime.residency.to_host
        runtime.residency.to_host = lambda *t: (reads.append(len(t)), to_host(*t))[1]
        with torch.no_grad():
            tokens = generate(model, dict(prompt), 8, min_new_tokens=8)
        runs[slabs] = (runtime, tokens, len(reads), model)
    filled, placed = runs[64][0], runs[63][0]
    assert filled.plan.prefill == "filled-slabs" and placed.plan.prefill == "streamed"
    assert "prefill: filled-slabs" in " ".join(filled.plan.describe())
    assert torch.equal(runs[64][1], runs[63][1])
    assert runs[64][2] == 0 and runs[63][2] > 0  # the placement path read each offloaded layer's routing
    offloaded = filled.offloaded_layers()
    assert len(filled.cache.where) == len(offloaded) * filled.num_experts  # every expert in, by the first prompt
    assert filled.summary()["prefill_fetches"] == len(offloaded) * filled.num_experts
    assert filled.summary()["bytes_host_reads_decode"] == 0 and filled.summary()["decode_settled"]
    with torch.no_grad():
        filled.reset_cache()
        assert not filled.cache.where
        assert torch.equal(generate(runs[64][3], dict(prompt), 8, min_new_tokens=8), runs[64][1])
    assert len(filled.cache.where) == len(offloaded) * filled.num_experts


@pytest.mark.parametrize("policy, slabs", [("lru", E), ("vismmoe", 2 * E)])  # vismmoe: a pinned first layer (no records)
def test_a_quiet_steps_accounting_waits_for_the_next_step_and_changes_nothing(policy, slabs):
    """A step whose pairs all hit and where nothing landed leaves the reservations as they were: the
    next step runs on them (no reservation written between), and the host accounts the quiet step
    after the next one is launched (its upkeep beside the device's work). Outputs, counters, the
    cache's contents and recency equal a runtime that accounts every step before the next."""
    def run(defer):
        runtime, weights = make_runtime(3, slabs, policy)  # before-step (ahead needs no quiet steps)
        if not defer:
            runtime.table.quiet_records = lambda rows: None
        reserves, reserve = [], runtime.table.reserve
        runtime.table.reserve = lambda landing: (reserves.append(landing), reserve(landing))[1]
        rng, gen, outputs = random.Random(3), torch.Generator().manual_seed(3), []
        with torch.no_grad():
            for step in range(16):
                runtime.before_step()
                check_table(runtime)
                ids = torch.tensor([rng.sample(range(E), K)]) if step % 4 == 0 else torch.tensor([[1, 5]])
                for layer in LAYERS:
                    hidden, w = torch.randn(1, H, generator=gen), torch.rand(1, K, generator=gen)
                    out = runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
                    torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
                    outputs.append(out)
                runtime.after_step()
            with runtime.lock:
                runtime.boundary.leave()
        counters = [(layer, c.calls, c.hits, c.misses, c.late) for layer, c in sorted(runtime.counters["decode"].items())]
        cache = runtime.cache
        return outputs, counters, dict(cache.where), list(cache.last_use), len(reserves)

    deferred, each_step = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(deferred[0], each_step[0]))
    assert deferred[1:4] == each_step[1:4]
    assert sum(c[3] for c in deferred[1]) > 0 and sum(c[2] for c in deferred[1]) > 0  # steps missed and hit
    assert deferred[4] < each_step[4]  # quiet steps ran on the reservations they found


@pytest.mark.parametrize("decode_cpu", [True, False])
def test_a_plan_that_leaves_the_cpu_to_prefill_decodes_its_misses_over_the_host_reads(monkeypatch, decode_cpu):
    """miss_policy cpu: prefill's misses go to the CPU backend either way; decode's go there only where the plan's
    decode has a CPU share (a backend that cannot run inside a CUDA stream has none: forced here, on the CPU
    device, through the plan). Without it no decode step calls the backend, the quota stays zero, the step is the
    variant without the CPU's calls, and its misses are read from the host store; outputs are the reference's."""
    from dataclasses import replace

    from vismmoe_kt.runtime import offload

    resolve = offload.resolve_plan
    monkeypatch.setattr(offload, "resolve_plan", lambda *args: (lambda plan: replace(
        plan, decode_cpu=plan.decode_cpu and decode_cpu))(resolve(*args)))
    torch.manual_seed(0)
    runtime = OffloadRuntime(OffloadSettings(expert_budget=2 * E * 3 * I * H * 4, policy="lru", miss_policy="cpu"),
                             LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
    weights = {layer: (torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4) for layer in LAYERS}
    for layer in LAYERS:
        runtime.load_layer(layer, *weights[layer])
    assert runtime.enable_table(torch.nn.SiLU()) and runtime.plan.decode_cpu == decode_cpu
    assert runtime.cpu.in_caller  # the model runs on the CPU: its CPU share too, in this thread (no worker's team)
    calls = []
    submit = runtime.cpu.submit
    runtime.cpu.submit = lambda layer, *args: (calls.append((runtime.phase, layer)), submit(layer, *args))[1]
    rng, act, variants = random.Random(0), torch.nn.SiLU(), set()
    with torch.no_grad():
        for tokens in (3, 1, 1, 1, 3, 1):  # a prefill, decode steps, another prefill, a decode step
            if tokens == 1:
                runtime.before_step()
                variants.add(runtime.graph_variant())  # what the step's capture is filed under
            for layer in LAYERS:
                hidden = torch.randn(tokens, H)
                ids, w = torch.tensor([rng.sample(range(E), K) for _ in range(tokens)]), torch.rand(tokens, K)
                out = runtime.run_layer(layer, hidden, ids, w, act)
                torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
            if tokens == 1:
                runtime.after_step()
        runtime.before_step()  # the boundary accounts the last step
        runtime.after_step()
    decode = list(runtime.counters["decode"].values())
    assert any(phase == "prefill" for phase, _ in calls) and sum(c.cpu for c in runtime.counters["prefill"].values())
    assert any(phase == "decode" for phase, _ in calls) == decode_cpu
    assert (sum(c.cpu for c in decode) > 0) == decode_cpu and (sum(c.misses for c in decode) > 0) != decode_cpu
    assert (runtime.copy_counters["decode"].bytes_host_reads > 0) != decode_cpu
    assert (runtime.boundary.miss is not None) == decode_cpu and any(runtime.table.cpu_quota.tolist()) == decode_cpu
    assert variants == {"cpu pairs" if decode_cpu else ""}


def test_the_hybrids_prompt_reads_its_rows_to_the_host_only_for_a_cpu_share(monkeypatch):
    """The hybrid mode's routing read: a decode step's rows ride along (one read); a prompt's layer reads only its
    routing, and its rows and weights after that only where the placement sends experts to the CPU (a prompt's
    rows are MiBs a layer at full size, and a streamed prompt's layers rarely have a CPU share). Outputs are the
    reference's either way."""
    torch.manual_seed(0)
    runtime = OffloadRuntime(OffloadSettings(expert_budget=2 * E * 3 * I * H * 4, policy="lru", miss_policy="cpu",
                                             pinned_layers=0), LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
    weights = {layer: (torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4) for layer in LAYERS}
    for layer in LAYERS:
        runtime.load_layer(layer, *weights[layer])
    res, reads = runtime.residency, []
    to_host = res.to_host
    monkeypatch.setattr(res, "to_host", lambda *t: (reads.append(tuple(x.shape for x in t)), to_host(*t))[1])
    act = torch.nn.SiLU()

    def prompt(tokens, experts):
        reads.clear()
        for layer in LAYERS:
            hidden = torch.randn(tokens, H)
            ids, w = torch.tensor([experts[:K] for _ in range(tokens)]), torch.rand(tokens, K)
            torch.testing.assert_close(runtime.run_layer(layer, hidden, ids, w, act),
                                       reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
        return list(reads)

    with torch.no_grad():
        on_cpu = runtime.miss.on_cpu
        monkeypatch.setattr(runtime.miss, "on_cpu", lambda *args: set())  # every miss fetched: no CPU share
        assert prompt(3, [0, 1]) == [((3, K),)] * len(LAYERS)
        monkeypatch.setattr(runtime.miss, "on_cpu", on_cpu)
        assert prompt(3, [2, 3]) == [((3, K),), ((3, H), (3, K))] * len(LAYERS)  # misses on the CPU: a second read
        assert prompt(1, [4, 5]) == [((1, K), (1, H), (1, K))] * len(LAYERS)  # decode, eager: one read
    assert sum(c.cpu for c in runtime.counters["prefill"].values()) == K * len(LAYERS)


@pytest.mark.parametrize("cold,fill", [(0, True), (1, True), (1, False)])
def test_a_settled_table_skips_the_upkeep_and_counts_the_same(cold, fill):
    """Every offloaded expert in a resident slab as decode starts: no step can miss, so the boundary
    neither reads a step's records back nor writes reservations between steps (the engine may queue steps
    back to back), and the counters equal the upkeep's. One expert still cold: the plan's fill copies it in
    as decode starts (a slab for every expert); without the fill the upkeep runs as before."""
    def run(settle):
        runtime, weights = make_runtime(5, len(LAYERS) * E, "lru")
        assert runtime.plan.fill_slabs
        runtime.boundary.fill = fill
        keys = [(layer, e) for layer in LAYERS for e in range(E)][cold:]
        with runtime.lock:
            runtime.transfers.fetch(keys)
        runtime.transfers.wait_for(range(runtime.num_slabs))
        if not settle:  # the same steps through the upkeep
            enter = runtime.boundary._enter
            def unsettled(resume=False):
                enter(resume)
                runtime.table.settled = False
            runtime.boundary._enter = unsettled
        calls = {"readback": 0, "reserve": 0}
        for name in calls:
            original = getattr(runtime.table, name)
            setattr(runtime.table, name, lambda *a, _o=original, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _o(*a))[1])
        rng, gen = random.Random(5), torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _ in range(12):
                runtime.before_step()
                ids = torch.tensor([rng.sample(range(E), K)])
                for layer in LAYERS:
                    hidden, w = torch.randn(1, H, generator=gen), torch.rand(1, K, generator=gen)
                    out = runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
                    torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
                runtime.after_step()
            settled = runtime.boundary.settled  # until decode leaves (a prefill, a reset)
            with runtime.lock:
                runtime.boundary.leave()
        assert not runtime.boundary.settled
        counters = [(c.calls, c.hits, c.misses) for _, c in sorted(runtime.counters["decode"].items())]
        return settled, counters, calls, runtime.summary()["decode_evictions"], len(runtime.cache.where)

    settled, counters, calls, evictions, resident = run(True)
    _, upkeep_counters, upkeep_calls, _, _ = run(False)
    assert evictions == 0
    if not fill:  # the cold expert makes the table unsettled: the upkeep reads and reserves every step
        assert not settled and calls == upkeep_calls and calls["readback"] == 12
        return
    assert settled and resident == len(LAYERS) * E  # the cold expert was filled in
    assert calls == {"readback": 0, "reserve": 1}  # the entry's empty reservations, nothing after
    assert upkeep_calls["readback"] == 12 and upkeep_calls["reserve"] >= 1
    assert counters == upkeep_counters == [(12, 12 * K, 0)] * len(LAYERS)


def test_a_fill_waits_for_every_copy_and_refuses_more_experts_than_free_slabs():
    """`Transfers.fill` (copies that land late here): when it returns, every expert it was given is resident
    in its slab with the store's bytes; asked for more experts than free slabs, it says so and takes none."""
    runtime, weights = make_runtime(3, len(LAYERS) * E, "lru")
    keys = [(layer, e) for layer in LAYERS[:2] for e in range(E)]
    with runtime.lock:
        runtime.transfers.fill(keys)
    for layer, e in keys:
        slab = runtime.cache.where[(layer, e)]
        assert runtime.cache.state[slab] is SlabState.RESIDENT
        assert torch.equal(runtime.pool[0][slab], weights[layer][0][e]) and torch.equal(runtime.pool[1][slab], weights[layer][1][e])
    free = runtime.cache.free_slabs
    rest = [(layer, e) for layer in LAYERS[2:] for e in range(E)] + [(LAYERS[0], E)]  # one more than the free slabs
    assert len(rest) == free + 1
    with runtime.lock, pytest.raises(RuntimeError, match=f"fill: {free + 1} experts but {free} free slabs"):
        runtime.transfers.fill(rest)
    assert runtime.cache.free_slabs == free


def test_reservations_ahead_queue_each_step_without_the_records_of_the_one_before():
    """reservations ahead: a step's landings were reserved in the `after` of the step before it, so its
    `before` reads no records (the device runs step after step while the host accounts t - 1 and reserves
    t + 1, disjoint from t's set: check_table). Outputs are the reference's; every pair is counted once,
    as a hit, a miss or a late read; a decode left midway gives back both sets' placeholders."""
    def run(reservations):
        runtime, weights = make_runtime(5, E + 3, "lru", reservations=reservations)
        reads = []
        collect = runtime.table.collect
        def counted():  # which hook read a step's records
            records = collect()
            if records is not None:
                reads.append(phase[0])
            return records
        runtime.table.collect = counted
        phase, rng, gen, outputs = ["before"], random.Random(5), torch.Generator().manual_seed(5), []
        with torch.no_grad():
            for step in range(20):
                phase[0] = "before"
                runtime.before_step()
                check_table(runtime)
                ids = torch.tensor([rng.sample(range(E), K)]) if step % 3 else torch.tensor([[1, 5]])
                for layer in LAYERS:
                    hidden, w = torch.randn(1, H, generator=gen), torch.rand(1, K, generator=gen)
                    out = runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
                    torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
                    outputs.append(out)
                phase[0] = "after"
                runtime.after_step()
            phase[0] = "leave"
            with runtime.lock:
                runtime.boundary.leave()
        runtime.cache.check_invariants()
        assert not [key for key in runtime.cache.where if key[1] < 0], "a landing reservation outlived the decode"
        counters = runtime.counters["decode"].values()
        assert sum(c.calls for c in counters) == 20 * len(LAYERS)
        assert sum(c.hits + c.misses + c.late for c in counters) == 20 * len(LAYERS) * K
        return runtime, outputs, reads, sum(c.misses for c in counters)

    ahead, outputs, reads, misses = run("ahead")
    assert ahead.plan.reservations == "ahead" and ahead.boundary.ahead
    # each step's records are read behind the next step's launch; the last step's by `leave`
    assert reads == ["after"] * 19 + ["leave"]
    before, before_outputs, before_reads, before_misses = run("before-step")
    assert not before.boundary.ahead and before_reads.count("before") > 10
    assert all(torch.equal(a, b) for a, b in zip(outputs, before_outputs))
    assert misses > 0 and before_misses > 0


def test_the_plan_says_when_reservations_go_ahead():
    facts = PlanFacts(len(LAYERS), E, H, I, K, torch.float32, table_kernels=True)
    block = 3 * I * H * 4

    def plan(**kwargs):
        return resolve_plan(OffloadSettings(expert_budget=(E + 2 * E) * block, **kwargs), facts, "cpu")

    default = plan()
    assert default.reservations == "before-step" and "reservations: before-step (given)" in default.describe()
    ahead = plan(reservations="ahead")
    assert ahead.reservations == "ahead" and ahead.why["reservations"].startswith("given")
    hybrid = plan(miss_policy="cpu", reservations="ahead")  # on the CPU device decode has a CPU share
    assert hybrid.reservations == "before-step" and "CPU share" in hybrid.why["reservations"]
    ahead_settings = OffloadSettings(expert_budget=3 * E * block, reservations="ahead")
    lookahead = resolve_plan(ahead_settings, replace(facts, lookahead=True), "cpu")
    assert lookahead.reservations == "before-step" and "lookahead" in lookahead.why["reservations"]
    untabled = resolve_plan(ahead_settings, replace(facts, table_kernels=None), "cpu")
    assert untabled.reservations == "before-step" and not any("reservations" in line for line in untabled.describe())
    with pytest.raises(BudgetError, match="reservations 'later' is not one of: auto, before-step, ahead"):
        OffloadSettings(expert_budget="1GiB", reservations="later")


class FakeClock:
    now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("policy", ["lru", "vismmoe"])
def test_reservations_auto_change_ways_mid_decode_and_keep_the_faster(policy):
    """`reservations: auto` (the plan keeps it on a GPU): the trial's runs change ways between steps of one decode,
    each change giving the other way's reservations back and rebuilding the table as the decode resumes (VisMMOE's
    router averages stay); every output is the reference's, every pair is counted once, no landing reservation
    outlives the decode, and after the trial the faster way (here ahead, on a fake clock) runs for good and the stats
    say so. With `eviction: auto` too (vismmoe), the eviction's trial waits, VisMMOE's ranking untimed, until the
    reservations' has decided, and then runs its own."""
    from vismmoe_kt.runtime.eviction import EvictionTrial
    from vismmoe_kt.runtime.reservations import ReservationsTrial

    runtime, weights = make_runtime(9, E + 3, policy, reservations="auto")
    # what `auto` plans on a GPU (on the CPU, before-step: nothing runs beside the step): the trials, on a fake clock
    assert runtime.plan.reservations == "before-step" and "no accelerator" in runtime.plan.why["reservations"]
    clock = FakeClock()
    runtime.boundary.reservations = ReservationsTrial(samples=3, clock=clock)
    if policy == "vismmoe":
        runtime.boundary.eviction = EvictionTrial(samples=2, clock=clock)
    rng, gen, ways, rankings, averages, steps = random.Random(9), torch.Generator().manual_seed(9), [], [], [], 40
    with torch.no_grad():
        for step in range(steps):
            runtime.before_step()
            check_table(runtime)
            ways.append(runtime.boundary.ahead)
            rankings.append(runtime.cache.ranking.name)
            averages.append((runtime.cache.usage is not None, runtime.averages_router()))
            ids = torch.tensor([rng.sample(range(E), K)]) if step % 4 else torch.tensor([[1, 5]])
            for row, layer in enumerate(LAYERS):
                hidden, w = torch.randn(1, H, generator=gen), torch.rand(1, K, generator=gen)
                runtime.observe_router(row, torch.softmax(torch.randn(1, E, generator=gen), -1))
                out = runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
                torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
            runtime.after_step()
            clock.now += 0.007 if ways[-1] else 0.008
        # runs of three a way (the third timed), three timed a way, then ahead for good
        assert ways[:18] == ([False] * 3 + [True] * 3) * 3 and all(ways[18:])
        assert "auto: kept ahead (faster)" in runtime.summary()["reservations"]
        if policy == "vismmoe":
            assert set(rankings[:18]) == {"vismmoe"} and "lru" in rankings[18:]  # the eviction's trial waited
            assert runtime.boundary.eviction.trial.decisions  # and then decided
            assert all(kept for kept, _ in averages[1:18])  # the router averages survived every change of way
            # and once the eviction's trial keeps lru, the cache drops them (a prefetch then weighs nothing by them)
            assert all(kept == live for kept, live in averages[18:])
        with runtime.lock:
            runtime.boundary.leave()
    runtime.cache.check_invariants()
    assert not [key for key in runtime.cache.where if key[1] < 0], "a landing reservation outlived the decode"
    counters, offloaded = runtime.counters["decode"].values(), len(runtime.offloaded_layers())
    assert sum(c.calls for c in counters) == steps * offloaded
    assert sum(c.hits + c.misses + c.late for c in counters) == steps * offloaded * K
    assert sum(c.misses for c in counters) > 0  # the steps did reserve and land: the ways had something to do


def test_a_decode_left_midway_ahead_keeps_nothing_reserved_and_can_change_order():
    """leave() between a step's `before` and `after` (ahead): the step is accounted there, so its `after`
    neither reads it back again nor reserves a set for a table about to be rebuilt; the order can then
    change and a prefill follow without an expert recorded in a slab twice."""
    runtime, weights = make_runtime(25, E + 3, "lru", reservations="ahead")
    act = torch.nn.SiLU()
    with torch.no_grad():
        for _ in range(3):
            runtime.begin_step(1)
            for layer in LAYERS:
                runtime.run_layer(layer, torch.randn(1, H), torch.tensor([[0, 4]]), torch.rand(1, K), act)
            if _ == 2:
                with runtime.lock:
                    runtime.boundary.leave()
            runtime.end_step()
        assert runtime.boundary.stale and not runtime.table._pending
        assert not [key for key in runtime.cache.where if key[1] < 0], "a reservation outlived the decode"
        runtime.boundary.set_reservations(False)
        hidden, ids, w = torch.randn(3, H), torch.tensor([[0, 4]] * 3), torch.rand(3, K)
        out = runtime.run_layer(LAYERS[1], hidden, ids, w, act)  # a prefill on the placement path
    torch.testing.assert_close(out, reference(weights[LAYERS[1]], hidden, ids, w), rtol=1e-5, atol=1e-5)
    check_table(runtime, settled=False)


@pytest.mark.parametrize("reservations", ["before-step", "ahead"])
def test_a_stopped_decode_gives_unused_reservations_back_to_their_experts(reservations):
    """A landing reservation that nothing landed in still holds the bytes of the expert it was taken from:
    when decode stops, that slab holds that expert again (unless the expert landed elsewhere since) instead
    of being freed, and what the host believes each slab holds, it holds."""
    runtime, weights = make_runtime(7, E + 4, "lru", reservations=reservations)
    rng, act = random.Random(7), torch.nn.SiLU()
    with torch.no_grad():
        for _ in range(6):
            runtime.before_step()
            ids = torch.tensor([rng.sample(range(E), K)])
            for layer in LAYERS:
                runtime.run_layer(layer, torch.randn(1, H), ids, torch.rand(1, K), act)
            runtime.after_step()
        cache = runtime.cache
        held = {key for key in cache.where if key[1] >= 0}
        taken = dict(runtime.boundary.evicted)  # reservations' slabs -> the experts they displaced
        with runtime.lock:
            runtime.boundary.leave()
    assert taken and not [key for key in cache.where if key[1] < 0]
    back = {key for slab, key in taken.items() if cache.owner[slab] == key}
    assert back and set(cache.where) >= held | back  # (the last step's landings are accounted by leave too)
    check_table(runtime, settled=False)
