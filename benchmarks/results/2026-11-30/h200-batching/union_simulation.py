"""How many distinct experts N requests name together, and an LRU cache per layer under their union
(CPU, synthetic routing as decode_bench --routing synthetic makes it: request i from seed i, 236-token
prompts with 180 visual tokens, 32 decode tokens). Usage: python union_simulation.py SLABS_PER_LAYER
Output: union-simulation.txt (BENCHMARKS.md, continuous batching on the H200)."""
import torch, numpy as np
from collections import OrderedDict
from vismmoe_kt.routing import SyntheticRouter
L, E, K, T, P = 48, 128, 8, 32, 236
def req(seed):
    r = SyntheticRouter(L, E, K, seed=seed)
    visual = torch.zeros(P, dtype=torch.uint8); visual[20:200] = 1
    pre = r.route(P, visual, "prefill"); dec = r.route(T, None, "decode")
    return pre.ids.numpy(), dec.ids.numpy()
reqs = [req(s) for s in range(8)]
def lru_misses(steps_sets, cap):  # steps_sets: list over steps of per-layer sets
    caches = [OrderedDict() for _ in range(L)]
    misses = 0
    for t, sets in enumerate(steps_sets):
        for l in range(L):
            c = caches[l]
            for e in sets[l]:
                if e in c: c.move_to_end(e)
                else:
                    if t >= 0: misses += 1
                    c[e] = 1
            while len(c) > max(cap, len(sets[l])):
                # evict lru not in current set
                for k in c:
                    if k not in sets[l]: del c[k]; break
    return misses
import sys; cap = int(sys.argv[1])
for B in (1, 2, 4, 8):
    # warm: prefill sets of each request (union over prompt), then decode steps union over B requests
    uni = []
    for t in range(T):
        uni.append([set(np.concatenate([reqs[b][1][t, l] for b in range(B)]).tolist()) for l in range(L)])
    # warm-up with the first 8 decode steps not counted: simulate twice
    m_all = lru_misses(uni, cap)
    m_warm = lru_misses(uni[:8], cap)
    avg_union = np.mean([len(s) for step in uni for s in step])
    print(f"B={B}: unique experts per layer per step {avg_union:.1f} of {B*K}; misses per token (steps 8-31) {(m_all-m_warm)/(B*(T-8))*1:.2f} per all layers -> {(m_all-m_warm)/(B*(T-8))*9.4:.0f} MB")
