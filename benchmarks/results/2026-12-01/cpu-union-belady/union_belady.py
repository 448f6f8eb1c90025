"""Misses per generated token of N requests decoded together under an offloaded layer's cache of CAP
slabs, LRU against Belady (the offline optimum), on synthetic routing as decode_bench --routing synthetic
makes it (request i from seed i, 236-token prompts with 180 visual tokens, 32 decode tokens; each layer
its own cache, warmed by the prompts' experts; steps 8-31 counted). A step needs the union of its rows'
experts at once, so no policy may evict one of them. (CPU; BENCHMARKS.md, 2026-12-01.)

    PYTHONPATH=. python3 benchmarks/results/2026-12-01/cpu-union-belady/union_belady.py > union_belady.txt
"""
import torch, numpy as np, sys
from collections import OrderedDict
from vismmoe_kt.routing import SyntheticRouter
L, E, K, T, P = 48, 128, 8, 32, 236
def req(seed):
    r = SyntheticRouter(L, E, K, seed=seed)
    visual = torch.zeros(P, dtype=torch.uint8); visual[20:200] = 1
    pre = r.route(P, visual, "prefill"); dec = r.route(T, None, "decode")
    return pre.ids.numpy(), dec.ids.numpy()
reqs = [req(s) for s in range(8)]
def belady(steps, cap, count_from):
    misses = 0
    for l in range(L):
        seq = [steps[t][l] for t in range(len(steps))]
        cache = set()
        for t, need in enumerate(seq):
            for e in need:
                if e not in cache:
                    if t >= count_from: misses += 1
                    cache.add(e)
            if len(cache) > cap:
                # evict those needed furthest in future, never the current set
                def next_use(e):
                    for u in range(t + 1, len(seq)):
                        if e in seq[u]: return u
                    return 10**9
                cands = sorted((c for c in cache if c not in need), key=next_use, reverse=True)
                for c in cands[:len(cache) - max(cap, len(need))]:
                    cache.discard(c)
    return misses
def lru(steps, cap, count_from):
    misses = 0
    for l in range(L):
        c = OrderedDict()
        for t, step in enumerate(steps):
            need = step[l]
            for e in need:
                if e in c: c.move_to_end(e)
                else:
                    if t >= count_from: misses += 1
                    c[e] = 1
            while len(c) > max(cap, len(need)):
                for k in c:
                    if k not in need: del c[k]; break
    return misses
for cap in (36, 80):
    for B in (1, 8):
        uni = [[set(np.concatenate([reqs[b][1][t, l] for b in range(B)]).tolist()) for l in range(L)] for t in range(T)]
        # prefill warm: each request's prompt experts first (not counted), then decode steps
        warm = [[set(np.unique(np.concatenate([reqs[b][0][:, l].reshape(-1) for b in range(B)])).tolist()) for l in range(L)]]
        steps = warm + uni
        n = B * (T - 8)
        print(f"cap {cap} B={B}: misses per generated token (steps 8-31): lru {lru(steps, cap, 9)/n:.1f}, belady {belady(steps, cap, 9)/n:.1f}", flush=True)
