"""The visual-expert affinity what-if of the synthetic router: never its default, always labelled.

VisMMOE's premise is that a trained model's visual tokens share experts: within an image they crowd
onto a few experts of each layer, and pruning redundant tokens leaves a set whose demand is more
concentrated (the paper: +32% top-k concentration on Qwen3-VL-30B-A3B). The calibrated router
(synthetic.py) has no such term: each position routes from its own noise, so a pruned set's survivors
route exactly like any other sample of the tokens, and every image shares the model's one vision
preference. This term lets benchmarks ask "what if routing had that affinity?" at a chosen strength:

    vision logits = (1 - w_t) * calibrated vision logits + w_t * GAIN * logit_scale * u_{image, l}
    w_t = strength * c_t,    c_t ~ U(0, 1) per visual token (its coherence with the image)

u_{image, l} is the image's own expert preference (a standardised Gumbel draw per image seed, long-tailed
like the model's), so different images load different experts (the imbalance ReaLB targets under expert
parallelism). Coherent tokens (large c_t) route to the image's shared experts; the others keep their own
routing. Two effects of pruning follow. Selection: Algorithm 1 keeps tokens whose experts the salient
core already uses, the coherent ones, so its survivors concentrate beyond what the token count does.
Absorption: in a trained model the survivors attend to fewer tokens and carry the pruned ones' context,
so from the pruning layer on a survivor's coherence moves toward 1 by the share pruned:

    c'_t = c_t + (1 - c_t) * (1 - kept share of the image's tokens)        (`survivor_mixing`)

(the routing source and benchmarks/affinity_whatif.py re-route the survivors of a pruned prefill so).
Strength 0 skips the term (the calibrated router bit for bit); 1 sends a fully coherent token to the
image's top-k. The strength matching a trained model's traces, or the paper's +32%, is fitted by
benchmarks/affinity_whatif.py, which also sweeps it.
"""

from __future__ import annotations

import math

import numpy as np

GAIN = 3.0  # the image preference's scale against the calibrated logits (~N(0, 1) each): at w = 1 it decides
_COHERENCE, _IMAGE = 6, 7  # SeedSequence stream words beside synthetic.py's 1-5: never renumber
BLOCK = 64  # coherence draws per independently seeded block (synthetic.BLOCK: chunking never changes them)


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(e) for e in entropy])))


def check_strength(value) -> float:
    """The strength as a float in [0, 1]; a clear ValueError otherwise (bools and NaN included)."""
    if isinstance(value, bool):
        raise ValueError(f"affinity strength must be a number in [0, 1], got {value!r}")
    try:
        strength = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"affinity strength must be a number in [0, 1], got {value!r}") from None
    if not math.isfinite(strength) or not 0.0 <= strength <= 1.0:
        raise ValueError(f"affinity strength must be a number in [0, 1], got {value!r}")
    return strength


def label(strength: float) -> str:
    """How every figure names the routing it used: `synthetic:affinity=S` (plain `synthetic` at 0)."""
    return "synthetic" if strength == 0 else f"synthetic:affinity={strength:g}"


def image_preference(image_seed: int, layers: int, experts: int) -> np.ndarray:
    """[L, E] the image's expert preference: standardised Gumbel, one deterministic draw per image seed."""
    x = _rng(image_seed, _IMAGE).gumbel(size=(layers, experts))
    return (x - x.mean(-1, keepdims=True)) / np.maximum(x.std(-1, keepdims=True), 1e-12)


def coherence(seed: int, start: int, count: int) -> np.ndarray:
    """c_t in [0, 1) of tokens [start, start + count) of request `seed`, drawn in fixed blocks."""
    if count <= 0:
        return np.zeros(0)
    first, last = start // BLOCK, (start + count - 1) // BLOCK
    draws = np.concatenate([_rng(seed, _COHERENCE, b).random(BLOCK) for b in range(first, last + 1)])
    offset = start - first * BLOCK
    return draws[offset:offset + count]


def mixing_weights(strength: float, seed: int, start: int, vision: np.ndarray) -> np.ndarray:
    """w_t [T] float64 of the tokens [start, start + T): strength * c_t on visual tokens, 0 on text."""
    return strength * coherence(seed, start, len(vision)) * (np.asarray(vision) != 0)


def survivor_mixing(mixing: np.ndarray, vision: np.ndarray, strength: float, kept_share: float) -> np.ndarray:
    """w'_t of the tokens that survive a pruning which kept `kept_share` of the visual tokens: each visual
    token's coherence moved toward 1 by the share pruned (strength * c'_t); text tokens stay at 0."""
    if not 0 < kept_share <= 1:
        raise ValueError(f"kept_share must lie in (0, 1], got {kept_share}")
    mixing = np.asarray(mixing, dtype=np.float64)
    return np.where(np.asarray(vision) != 0, mixing + (strength - mixing) * (1.0 - kept_share), 0.0)


class Survivors:
    """One request's survivors of a pruned prefill, re-routed on demand: `rows(layer, positions)` gives the
    ids [n, k], every expert's probability [n, E] and the top-k renormalised weights [n, k] of the kept
    prompt positions at `layer`, their
    coherence raised by the share of the prompt's visual tokens pruned (`survivor_mixing`).
    router: the request's SyntheticRouter; hidden [N, L, D] its latent states; vision [N] its modality."""

    def __init__(self, router, hidden, vision):
        import torch

        self.router, self.hidden = router, hidden
        self.vision = torch.as_tensor(vision).reshape(-1).bool().cpu()
        self.mixing = router.mixing_history().numpy()
        self.visual_tokens = int(self.vision[:len(self.mixing)].sum())

    def rows(self, layer: int, positions):
        import torch

        positions = torch.as_tensor(positions).cpu()
        vision = self.vision[positions]
        share = float(vision.sum()) / max(self.visual_tokens, 1)
        mixing = survivor_mixing(self.mixing[positions.numpy()], vision.numpy(), self.router.affinity, max(share, 1e-9))
        logits = self.router.logits(layer, self.hidden[positions, layer], vision.double(), torch.from_numpy(mixing))
        top, ids = logits.topk(self.router.top_k, dim=-1)
        return ids, torch.softmax(logits, dim=-1).float(), torch.softmax(top, dim=-1).float()
