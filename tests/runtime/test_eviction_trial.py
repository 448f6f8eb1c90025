"""The eviction ranking decode runs: `eviction: auto` times lru against VisMMOE's ranking over the first
decode steps and keeps the faster for good (a tie: lru); the choice is in the plan and the stats; the
tokens do not depend on it. A fake clock stands in for the steps (no timing of this machine).

Also the prefetch admission rule (issue item 5) on constructed cache states: a prefetch takes a slab
only from an expert worth less than itself, and only while no urgent copy holds the link."""

import random
import threading

import numpy as np
import pytest
import torch

from vismmoe_kt.core.stats import format_stats
from vismmoe_kt.runtime.budget import BudgetError
from vismmoe_kt.runtime.eviction import LRU, VISMMOE, EvictionTrial, FixedEviction
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_plan import PlanFacts, resolve_plan
from vismmoe_kt.runtime.offload_settings import OffloadSettings
from vismmoe_kt.runtime.slab_cache import SlabCache
from vismmoe_kt.runtime.transfers import Transfers

E, H, I, K = 8, 16, 8, 2
LAYERS = [0, 1, 2, 3]
BLOCK = 3 * I * H * 4  # one float32 expert


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_trial(lru_s: float, vismmoe_s: float, steps: int, samples: int = 3):
    clock = Clock()
    trial = EvictionTrial(samples=samples, clock=clock)
    names = []
    for _ in range(steps):
        ranking = trial.for_step()
        names.append(ranking.name)
        clock.now += lru_s if ranking.name == "lru" else vismmoe_s
    return trial, names


@pytest.mark.parametrize("lru_s,vismmoe_s,kept", [(0.020, 0.022, "lru"), (0.024, 0.021, "vismmoe"),
                                                  (0.020, 0.020, "lru"), (0.0201, 0.0200, "lru")])
def test_the_faster_ranking_is_kept_for_good_and_a_tie_keeps_lru(lru_s, vismmoe_s, kept):
    trial, names = run_trial(lru_s, vismmoe_s, steps=200)
    # runs of two steps, the second of each timed: three runs per arm, then the decision
    assert names[:12] == ["lru", "lru", "vismmoe", "vismmoe"] * 3
    assert set(names[12:]) == {kept} and len(trial.trial.decisions) == 1  # decided once, never tried again
    lru, vismmoe, arm = trial.trial.decisions[0]
    assert (lru, vismmoe) == pytest.approx((lru_s, vismmoe_s)) and (LRU, VISMMOE)[kept == "vismmoe"] == arm
    text = trial.describe()
    assert f"kept {kept}" in text and ("a tie keeps the simpler" in text) == (abs(lru_s - vismmoe_s) < 0.001)


def test_an_interruption_is_not_timed():
    clock = Clock()
    trial = EvictionTrial(samples=2, clock=clock)
    for step in range(10):
        ranking = trial.for_step()
        clock.now += 0.010 if ranking.name == "lru" else 0.020
        if step == 2:  # a prefill between two steps: a minute that is no step's
            clock.now += 60.0
            trial.interrupt()
    assert trial.trial.decisions and max(trial.trial.decisions[0][:2]) < 1.0
    assert "trying" in EvictionTrial().describe()  # before any decision the stats say it is still trying


def plan_for(budget_slabs: int, table: bool, device: str = "cuda", **kwargs):
    facts = PlanFacts(len(LAYERS), E, H, I, K, torch.bfloat16, table_kernels=True if table else None)
    settings = OffloadSettings(expert_budget=(E + budget_slabs) * BLOCK // 2, pinned_layers=1, **kwargs)
    return resolve_plan(settings, facts, device)


def test_the_plan_resolves_eviction_and_says_why():
    assert plan_for(2 * E, True).eviction == "vismmoe"  # no key: the policy's, as before the key existed
    assert plan_for(2 * E, True, policy="lru").eviction == "lru"
    assert plan_for(2 * E, True, eviction="lru").eviction == "lru"
    auto = plan_for(2 * E, True, eviction="auto")
    assert auto.eviction == "auto" and "eviction: auto (auto: the first decode steps time" in auto.describe()[-1]
    assert plan_for(2 * E, False, eviction="auto").eviction == "vismmoe"  # no table decode: nothing timed
    assert plan_for(2 * E, True, "cpu", eviction="auto").eviction == "vismmoe"  # no accelerator: all host work
    every = plan_for(3 * E, True, eviction="auto")  # a slab for every offloaded expert: nothing to rank
    assert every.eviction == "lru" and "nothing to rank" in every.why["eviction"]
    with pytest.raises(BudgetError, match="eviction 'fifo' is not one of: auto, lru, vismmoe"):
        OffloadSettings(expert_budget="1GiB", eviction="fifo")
    # on the CPU `auto` is VisMMOE's before the table is enabled (no table decode) and after (no accelerator):
    # the runtime's stats give the reason of the plan in force, as the plan's lines do
    runtime = make_runtime("auto")
    assert runtime.plan.eviction == "vismmoe" and "no accelerator" in runtime.plan.why["eviction"]
    assert runtime.summary()["eviction"] == f"vismmoe ({runtime.plan.why['eviction']})"


def make_runtime(eviction: str, seed: int = 0) -> OffloadRuntime:
    torch.manual_seed(seed)
    settings = OffloadSettings(expert_budget=(E + E + 4) * BLOCK, pinned_layers=1, eviction=eviction)
    runtime = OffloadRuntime(settings, LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
    for layer in LAYERS:
        runtime.load_layer(layer, torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4)
    assert runtime.enable_table(torch.nn.SiLU())
    return runtime


def decode(runtime: OffloadRuntime, steps: int, clock: Clock | None = None, slow: str = "vismmoe"):
    """`steps` decode steps of seeded routing and router probabilities; the outputs, and each step's ranking."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    favourites = rng.sample(range(E), 5)
    outputs, rankings = [], []
    with torch.no_grad():
        for _ in range(steps):
            runtime.before_step()
            rankings.append(runtime.cache.ranking.name)
            for row, layer in enumerate(LAYERS):
                hidden = torch.randn(1, H, generator=gen)
                runtime.observe_router(row, torch.softmax(torch.randn(1, E, generator=gen), -1))
                ids = torch.tensor([rng.sample(favourites if rng.random() < 0.6 else range(E), K)])
                outputs.append(runtime.run_layer(layer, hidden, ids, torch.rand(1, K, generator=gen), torch.nn.SiLU()))
            runtime.after_step()
            if clock is not None:
                clock.now += 0.030 if rankings[-1] == slow else 0.020
            if len(rankings) == 5:  # a prefill of three tokens on the placement path between two decode steps
                for layer in LAYERS:
                    ids = torch.tensor([rng.sample(range(E), K) for _ in range(3)])
                    outputs.append(runtime.run_layer(layer, torch.randn(3, H, generator=gen), ids,
                                                     torch.rand(3, K, generator=gen), torch.nn.SiLU()))
                runtime.cache.check_invariants()
    return outputs, rankings


def test_tokens_are_the_same_whichever_ranking_runs_and_the_choice_is_reported():
    by_lru, by_router = make_runtime("lru"), make_runtime("vismmoe")
    lru, _ = decode(by_lru, 24)
    vismmoe, _ = decode(by_router, 24)

    def hits(runtime):
        return [c.hits for _, c in sorted(runtime.counters["decode"].items())]
    assert hits(by_lru) != hits(by_router)  # the rankings kept different experts: the equality below means something
    runtime, clock = make_runtime("vismmoe"), Clock()
    # what `auto` plans on a GPU (on the CPU it is VisMMOE's): the trial, here on a fake clock
    runtime.boundary.eviction = EvictionTrial(samples=2, clock=clock)
    assert runtime.router_sink() is not None  # the trial's VisMMOE steps rank by the router's averages
    auto, rankings = decode(runtime, 24, clock, slow="vismmoe")
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(lru, vismmoe, auto))
    # both rankings ran during the trial (each step's reservations under the arm's ranking), then lru for good
    # the prefill after the fifth step interrupts the trial: lru's run there is cut short, a new one starts
    assert rankings[:9] == ["lru", "lru", "vismmoe", "vismmoe", "lru", "lru", "lru", "vismmoe", "vismmoe"]
    assert set(rankings[9:]) == {"lru"}
    summary = runtime.summary()
    assert summary["eviction"].startswith("auto: kept lru (faster): 20.00 ms per decode step with lru, 30.00")
    entry = {"count": 4, "pinned_layers": 1, "slabs": runtime.num_slabs, "fetches": 0, "evictions": 0,
             "eviction": summary["eviction"]}
    assert "eviction in decode: auto: kept lru" in format_stats({"torch_threads": 1, "operators": {"V": entry}})
    runtime.reset_cache()  # a cold cache keeps the ranking chosen
    assert runtime.cache.ranking.name == "lru"
    fixed = make_runtime("vismmoe")
    assert isinstance(fixed.boundary.eviction, FixedEviction) and fixed.summary()["eviction"] == "vismmoe (given)"
    assert make_runtime("lru").router_sink() is None  # recency alone: no router averages computed


@pytest.mark.parametrize("slow,averaged", [("vismmoe", False), ("lru", True)])
def test_router_averages_stop_once_the_trial_keeps_lru(slow, averaged):
    """Once `auto` keeps lru the router's averages are never read again: decode stops updating them (a lerp
    a layer) and files its capture under another variant; kept VisMMOE, they go on, the variant unchanged."""
    runtime, clock = make_runtime("vismmoe"), Clock()
    runtime.boundary.eviction = EvictionTrial(samples=2, clock=clock)
    variants = []
    before = runtime.before_step
    runtime.before_step = lambda: (before(), variants.append(runtime.graph_variant()))[0]
    decode(runtime, 12, clock, slow=slow)
    assert runtime.boundary.eviction.trial.outcome() is not None  # decided within the twelve steps
    usage = runtime.table.usage.clone()
    decode(runtime, 3, clock, slow=slow)
    assert torch.equal(runtime.table.usage, usage) != averaged
    assert variants[0] == "" and (variants[-1] == " without router averages") != averaged
    assert runtime.boundary.eviction.reads_usage == averaged
    # what a prefetch's admission weighs a held expert by: the live averages, or nothing (lru's file), never frozen ones
    assert (runtime.cache.usage is not None) == averaged
    with runtime.lock:  # the decode stops (a prefill next, whose prefetches weigh held experts): its last step accounted
        runtime.boundary.leave()
    assert (runtime.cache.usage is not None) == averaged
    held = next(slab for slab, key in enumerate(runtime.cache.owner) if key is not None)
    assert averaged or runtime.cache.classify(held) == "speculative" or runtime.cache.worth(held) == 0.0
    assert not FixedEviction("lru", "given").reads_usage and FixedEviction("vismmoe", "given").reads_usage


def test_no_router_averages_where_nothing_can_be_evicted():
    """Slabs for every offloaded expert (the plan fills them): VisMMOE's ranking never chooses a victim,
    so decode computes no router probabilities for it; one slab short, it does."""
    def runtime_with(slabs):
        settings = OffloadSettings(expert_budget=(E + slabs) * BLOCK, pinned_layers=1, eviction="vismmoe")
        runtime = OffloadRuntime(settings, LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
        assert runtime.enable_table(torch.nn.SiLU())
        return runtime
    every = (len(LAYERS) - 1) * E
    full, short = runtime_with(every), runtime_with(every - 1)
    assert full.plan.fill_slabs and full.router_sink() is None
    assert not short.plan.fill_slabs and short.router_sink() is not None


# --- prefetch admission (item 5) ----------------------------------------------------------------------

def expired_cache(ranking: str) -> SlabCache:
    """Two slabs, both Expired (layer 0 ran in this step), router averages 0.6 for (0, 0) and 0.1 for (0, 1)."""
    cache = SlabCache(2, [0, 1], ranking)
    for slab in cache.assign_many([(0, 0), (0, 1)], urgent=True):
        cache.complete(slab)
    cache.begin_layer(0, [0, 1])
    cache.end_layer(0)
    usage = np.zeros((2, 4))
    usage[0, :2] = (0.6, 0.1)
    cache.set_usage([0, 1], usage)
    return cache


@pytest.mark.parametrize("ranking", ["vismmoe", "lru"])
def test_a_prefetch_never_evicts_a_more_probable_expert(ranking):
    cache = expired_cache(ranking)
    if ranking == "vismmoe":  # the router's least favoured goes first: 0.1 < 0.5, admitted
        assert cache.assign((1, 2), priority=0.5) == cache.where[(1, 2)] and (0, 1) not in cache.where
        assert cache.assign((1, 3), priority=0.5) is None and (0, 0) in cache.where  # 0.6 >= 0.5: refused
    else:  # recency's victim is (0, 0), worth 0.6: a prefetch of 0.5 may not take it, one of 0.7 may
        assert cache.assign((1, 2), priority=0.5) is None and cache.where.keys() == {(0, 0), (0, 1)}
        assert cache.assign((1, 2), priority=0.7) is not None and (0, 0) not in cache.where
    cache.check_invariants()


@pytest.mark.parametrize("ranking", ["vismmoe", "lru"])
def test_a_speculative_expert_is_evicted_only_by_a_more_probable_prefetch(ranking):
    cache = SlabCache(1, [0, 1], ranking)
    cache.complete(cache.assign((1, 0), priority=0.8))  # prefetched for layer 1, which has not run: Speculative
    assert cache.assign((1, 1), priority=0.5) is None and cache.assign((1, 1), priority=0.8) is None
    assert cache.assign((1, 1), priority=0.9) == 0 and cache.owner[0] == (1, 1)
    assert cache.counters.prefetch_wasted == 1  # the evicted prefetch was never used
    cache.complete(0)
    assert cache.assign((1, 2), urgent=True) == 0  # an urgent fetch (a layer waits) takes any unused slab


def test_a_prefetch_waits_while_an_urgent_copy_holds_the_link():
    store_cache = SlabCache(4, [0, 1], "vismmoe")

    class Store:  # only what `_copy` reads: one float expert per key
        quantized, block_bytes = False, 4

        def block_bytes_of(self, layer):
            return 4

        def block_parts(self, layer, expert):
            return torch.full((1,), float(expert)), torch.full((1,), float(expert))

    pool = (torch.zeros(5, 1), torch.zeros(5, 1))
    transfers = Transfers(Store(), pool, store_cache, threading.RLock())
    transfers.urgent.add(3)  # a miss's copy in flight (on CUDA): the link is busy
    transfers.prefetch([((1, 2), 0.9)])
    assert (1, 2) not in store_cache.where and transfers.queue  # queued, not issued
    transfers.urgent.clear()  # it landed: the link is idle
    transfers.prefetch([((1, 2), 0.9)])
    assert (1, 2) in store_cache.where and not transfers.queue
    assert float(pool[0][store_cache.where[(1, 2)]]) == 2.0
