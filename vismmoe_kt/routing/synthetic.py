"""A synthetic router, independent of any model weights, calibrated to a trained MoE's routing.

Benchmarks run full-size shapes with random weights, and random routers route near-uniformly (and
greedy decoding of a random model repeats one token, so consecutive tokens route identically): any
cache or prefetch figure measured that way is meaningless. This module generates routing with the
statistics public studies report for Qwen3-30B-A3B (targets.py), from seeds alone: it never looks at
the model or at the generated tokens, so the same seeds give the same routing on any machine.

Latent-factor model; t token, l layer, E experts, D latent dim:
    z_{t,l} = rho_l z_{t-1,l} + sqrt(1 - rho_l^2) eps_{t,l}   token-to-token drift of layer l's innovation;
              with probability `jump` per token every layer's z is redrawn (a topic jump); z_{0,l} = eps_{0,l}
    h_{t,0} = z_{t,0},   h_{t,l} = sqrt(c_l) h_{t,l-1} + sqrt(1 - c_l) z_{t,l}   (the residual stream)
    text:   logits = logit_scale * (W_l h / temperature_l + skew_l s_l + hot_l p_l)
    vision: logits = logit_scale * (W_l h / temperature_l + vision_l v_l)
    ids = top-k(logits); weights = softmax over the k chosen logits (Qwen3 renormalises over top-k)
Three seeds' worth of structure:
  * the model (fixed): routers W_l [E, D] (rows ~ N(0, I/D), so W_l h ~ N(0, 1)) and the vision
    preference v_l (Gumbel: long-tailed, a few experts per layer take most vision tokens, the same
    experts for every image, as the vision-MoE papers report);
  * the corpus (corpus_seed, one kind of prompt): a Gaussian skew s_l shared by its prompts, which makes
    some experts hot across the whole corpus;
  * the request (seed): its hot set p_l, a random order of the experts per layer whose first
    hot_size_l * E experts get a bonus ramping from 1 down to 0 (graded: a flat set cannot match the
    published top-16 share and reuse distances together), and all the noise.
Vision tokens ignore the prompt's hot set and the text corpus skew: image patches are not the prompt's
topic. The per-layer strengths come from the fitted calibration (calibration.py, benchmarks/fit_routing.py).

Because h_l keeps sqrt(c_l) of h_{l-1}, layer l+1's router applied to h_l predicts layer l+1's experts
with skill set by c_{l+1}: `SyntheticRouter.next_layer_logits` is that lookahead predictor.

Determinism across call patterns: the noise is drawn in fixed blocks of BLOCK tokens, each block from its
own seed, and the arithmetic is float64, so routing T tokens at once or one at a time gives the same ids:
a lazy runtime and an offline trace agree. `phase` is recorded but does not change the process: the
published per-phase figure (vision prefill) is a property of vision tokens, which `modality` covers.

`affinity` (default 0: off, the above bit for bit) adds the labelled visual-expert affinity what-if of
affinity.py: visual tokens mix toward their image's own expert preference (image_seed, default the seed).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .affinity import GAIN, check_strength, image_preference, mixing_weights
from .calibration import Knobs, resolve_knobs

BLOCK = 64  # tokens per independently seeded block of noise
PHASES = {"prefill": 0, "decode": 1}
# distinct random streams of one seed (SeedSequence entropy words): never renumber, traces would change
_NOISE, _REQUEST, _ROUTER, _SKEW, _VISION = 1, 2, 3, 4, 5
MODEL_SEED = 0  # the synthetic "model" (routers, vision experts) is one fixed draw


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(e) for e in entropy])))


def _standardise(x: np.ndarray) -> np.ndarray:
    """Zero mean, unit std per layer: a strength then means the same thing at every layer and shape."""
    return (x - x.mean(-1, keepdims=True)) / np.maximum(x.std(-1, keepdims=True), 1e-12)


def noise_block(seed: int, block: int, layers: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [block * BLOCK, (block + 1) * BLOCK) of a request: eps [BLOCK, L, D] and jump draws u [BLOCK]."""
    rng = _rng(seed, _NOISE, block)
    return rng.standard_normal((BLOCK, layers, dim)), rng.random(BLOCK)


def noise(seed: int, num_tokens: int, layers: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """eps [T, L, D] and u [T] of a request's first num_tokens tokens (what the router draws)."""
    blocks = [noise_block(seed, b, layers, dim) for b in range(-(-num_tokens // BLOCK))]
    if not blocks:
        return np.zeros((0, layers, dim)), np.zeros(0)
    return np.concatenate([b[0] for b in blocks])[:num_tokens], np.concatenate([b[1] for b in blocks])[:num_tokens]


def ar_step(z: np.ndarray | None, eps: np.ndarray, jumped: Any, rho: Any, rho_c: Any) -> np.ndarray:
    """One token of the AR(1) innovation: rho z + rho_c eps (rho_c = sqrt(1 - rho^2)), or eps where a
    jump happened (and at the first token, z None). Elementwise only: any batching is bit-identical."""
    if z is None:
        return eps.copy()
    return np.where(jumped, eps, rho * z + rho_c * eps)


def directions(layers: int, experts: int, seed: int, corpus_seed: int) -> dict[str, np.ndarray]:
    """The unit-strength preference patterns, each [L, E]: the model's "vision" preference, the corpus
    "skew", and the request's "hot_rank" (a random order of the experts per layer; the hot set is its head)."""
    return {
        "vision": _standardise(_rng(MODEL_SEED, _VISION).gumbel(size=(layers, experts))),
        "skew": _standardise(_rng(corpus_seed, _SKEW).standard_normal((layers, experts))),
        "hot_rank": np.argsort(np.argsort(_rng(seed, _REQUEST).random((layers, experts)), axis=-1), axis=-1),
    }


def hot_profile(hot_size: np.ndarray, hot_rank: np.ndarray) -> np.ndarray:
    """[..., L, E] in [0, 1]: the request's graded hot set. Its first H = hot_size_l * E experts get
    1 - rank / H (a ramp), the rest 0. Graded rather than flat because a flat set cannot give the published
    top-16 share and reuse-within-8 together (tokens cycling through a flat set reuse it too often). One
    request's profiles are nested as hot_size grows, so statistics change monotonically with it."""
    size = np.clip(hot_size * hot_rank.shape[-1], 1.0, None)[:, None]  # [L, 1]
    return np.clip(1.0 - hot_rank / size, 0.0, 1.0)


def router_matrices(layers: int, experts: int, dim: int) -> np.ndarray:
    """The model's routers W [L, E, D], rows ~ N(0, I / D): for h ~ N(0, I) every logit W_l h is ~ N(0, 1)."""
    return _rng(MODEL_SEED, _ROUTER).standard_normal((layers, experts, dim)) / np.sqrt(dim)


def biases(knobs: Knobs, dirs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(text bias, vision bias), each [L, E], before logit_scale."""
    text = knobs.skew[:, None] * dirs["skew"] + knobs.hot[:, None] * hot_profile(knobs.hot_size, dirs["hot_rank"])
    return text, knobs.vision[:, None] * dirs["vision"]


class Routing(NamedTuple):
    """One chunk of routed tokens. T tokens, L layers, k top-k, D latent dim."""
    ids: torch.Tensor      # int64 [T, L, k], highest logit first
    weights: torch.Tensor  # float32 [T, L, k], sums to 1 over k
    hidden: torch.Tensor   # float64 [T, L, D], the latent state each layer's router read


def _flags(value: Any, n: int, name: str, strings: dict[str, int] | None = None) -> np.ndarray:
    """A per-token 0/1 uint8 vector [n] from None (zeros), a bool, a string (phase) or a [T] tensor/array."""
    if value is None:
        return np.zeros(n, dtype=np.uint8)
    if isinstance(value, str):
        if strings is None or value not in strings:
            raise ValueError(f"{name} must be one of {sorted(strings or {})} or a [tokens] tensor, got {value!r}")
        return np.full(n, strings[value], dtype=np.uint8)
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return np.full(n, int(bool(value)), dtype=np.uint8)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    value = np.asarray(value).reshape(-1)
    if value.shape[0] != n:
        raise ValueError(f"{name} has {value.shape[0]} entries for {n} tokens")
    return (value != 0).astype(np.uint8)


class SyntheticRouter:
    """Stateful synthetic router of one request: route a prompt, then decode tokens one at a time.

        router = SyntheticRouter(seed=3)             # 48 layers x 128 experts, top-8: Qwen3-VL-30B-A3B
        router.prefill(modality=vision_mask)         # ids [T, L, k] of the prompt
        router.decode()                              # ids [L, k] of the next generated token
        router.ids(token, layer)                     # ids [k]; tokens not routed yet are decoded on demand

    The ids equal `synthetic_trace`'s for the same seeds, knobs and per-token modality sequence, however
    the tokens are chunked. Nothing depends on the generated tokens.
    """

    def __init__(self, layers: int = 48, experts: int = 128, top_k: int = 8, seed: int = 0, corpus_seed: int = 0,
                 calibration: Any = None, affinity: float = 0.0, image_seed: int | None = None, **knobs: Any):
        for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k)):
            if int(value) < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if top_k > experts:
            raise ValueError(f"top_k ({top_k}) cannot exceed experts ({experts})")
        if int(seed) < 0 or int(corpus_seed) < 0:
            raise ValueError("seeds must be non-negative integers")
        self.layers, self.experts, self.top_k = int(layers), int(experts), int(top_k)
        self.seed, self.corpus_seed = int(seed), int(corpus_seed)
        self.affinity = check_strength(affinity)
        self.image_seed = self.seed if image_seed is None else int(image_seed)
        if self.image_seed < 0:
            raise ValueError("seeds must be non-negative integers")
        self.knobs: Knobs = resolve_knobs(self.layers, calibration, **knobs)
        k, L = self.knobs, self.layers  # noqa: N806
        # L layers, E experts, D latent dim
        self.router_weights = router_matrices(L, self.experts, k.dim)  # [L, E, D]
        self.directions = directions(L, self.experts, self.seed, self.corpus_seed)
        text, vision = biases(k, self.directions)
        # logit_scale and 1 / temperature folded in once: W^T [L, D, E], biases [L, E]
        scale = k.logit_scale / k.temperature
        self._scaled_weights = torch.from_numpy(np.ascontiguousarray(
            self.router_weights.transpose(0, 2, 1) * scale[:, None, None]))
        self._text_bias = torch.from_numpy(text * k.logit_scale)
        self._vision_shift = torch.from_numpy((vision - text) * k.logit_scale)  # added for vision tokens
        self._rho, self._rho_c = k.rho[:, None], np.sqrt(1.0 - k.rho ** 2)[:, None]
        # the affinity what-if's target logits [L, E] (affinity.py), made only when it is on
        self._image_target = torch.from_numpy(GAIN * k.logit_scale * image_preference(
            self.image_seed, L, self.experts)) if self.affinity else None
        self._keep, self._mix = np.sqrt(k.coupling), np.sqrt(1.0 - k.coupling)
        self.tokens = 0  # tokens routed so far
        self._z: np.ndarray | None = None  # [L, D] the last token's innovation
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None
        # history buffers grow by doubling: decoding token by token stays linear in the token count
        self._ids = np.zeros((BLOCK, L, self.top_k), dtype=np.int16)
        self._weights = np.zeros((BLOCK, L, self.top_k), dtype=np.float32)
        self._modality = np.zeros(BLOCK, dtype=np.uint8)
        self._phase = np.zeros(BLOCK, dtype=np.uint8)
        self._mixing = np.zeros(BLOCK, dtype=np.float64)  # the affinity weight w_t each token routed with

    @property
    def modality(self) -> np.ndarray:
        """uint8 [T] of the tokens routed so far (1 = vision)."""
        return self._modality[:self.tokens].copy()

    @property
    def phase(self) -> np.ndarray:
        """uint8 [T] of the tokens routed so far (0 prefill, 1 decode)."""
        return self._phase[:self.tokens].copy()

    # ---- the model ---------------------------------------------------------------------------------
    def _noise(self, t: int) -> tuple[np.ndarray, float]:
        block = t // BLOCK
        if self._block is None or self._block[0] != block:
            self._block = (block, *noise_block(self.seed, block, self.layers, self.knobs.dim))
        return self._block[1][t % BLOCK], float(self._block[2][t % BLOCK])

    def _latent(self, count: int) -> np.ndarray:
        """Advance the AR(1) innovations by `count` tokens: z [T, L, D]."""
        z = np.empty((count, self.layers, self.knobs.dim))
        for i in range(count):  # sequential by nature; one [L, D] step per token is cheap
            eps, u = self._noise(self.tokens + i)
            self._z = ar_step(self._z, eps, u < self.knobs.jump, self._rho, self._rho_c)
            z[i] = self._z
        return z

    def _hidden(self, z: np.ndarray) -> np.ndarray:
        """The residual stream across layers: h [T, L, D] from z [T, L, D]."""
        h = np.empty_like(z)
        h[:, 0] = z[:, 0]
        for layer in range(1, self.layers):
            h[:, layer] = self._keep[layer] * h[:, layer - 1] + self._mix[layer] * z[:, layer]
        return h

    def logits(self, layer: int, hidden: Any, modality: Any = False, mixing: Any = None) -> torch.Tensor:
        """Layer `layer`'s router logits [..., E] (float64) for latent states hidden [..., D]; `mixing`:
        the tokens' affinity weights [...] (`mixing_history()`; None: the calibrated logits alone)."""
        h = torch.as_tensor(hidden, dtype=torch.float64)
        vision = torch.as_tensor(modality, dtype=torch.float64)[..., None]
        out = h @ self._scaled_weights[layer] + self._text_bias[layer] + vision * self._vision_shift[layer]
        if mixing is None or self._image_target is None:
            return out
        w = torch.as_tensor(mixing, dtype=torch.float64)[..., None]
        return (1 - w) * out + w * self._image_target[layer]

    def mixing_history(self) -> torch.Tensor:
        """float64 [T]: the affinity weight w_t every token routed so far was routed with (0: none)."""
        return torch.from_numpy(self._mixing[:self.tokens].copy())

    def next_layer_logits(self, hidden: Any, layer: int, modality: Any = False) -> torch.Tensor:
        """Layer layer+1's router applied to layer `layer`'s hidden state [..., D]: the lookahead predictor.
        Its skill is set by the coupling c_{layer+1} (1: exact; 0: only the static biases are known)."""
        if not 0 <= layer < self.layers - 1:
            raise ValueError(f"layer must be in [0, {self.layers - 2}] to have a next layer, got {layer}")
        return self.logits(layer + 1, hidden, modality)

    # ---- routing -----------------------------------------------------------------------------------
    def route(self, num_tokens: int | None = None, modality: Any = None, phase: Any = "decode") -> Routing:
        """Route the next tokens: num_tokens of them, or len(modality) when modality is a [T] tensor."""
        if num_tokens is None:
            if modality is None or isinstance(modality, (bool, int)):
                raise ValueError("give num_tokens, or modality as a [tokens] tensor")
            num_tokens = len(modality)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        vis = _flags(modality, num_tokens, "modality")
        ph = _flags(phase, num_tokens, "phase", PHASES)
        # T tokens, L layers, k top-k, E experts, D latent dim
        hidden = self._hidden(self._latent(num_tokens))                                 # [T, L, D]
        # one batched GEMM over layers in torch (numpy's stacked matmul does not reach BLAS here)
        h = torch.from_numpy(np.ascontiguousarray(hidden.transpose(1, 0, 2)))            # [L, T, D]
        logits = torch.baddbmm(self._text_bias[:, None, :], h, self._scaled_weights)     # [L, T, E]
        if vis.any():
            logits += torch.from_numpy(vis.astype(np.float64))[None, :, None] * self._vision_shift[:, None, :]
        mixing = np.zeros(num_tokens)
        if self._image_target is not None and vis.any():  # the what-if (affinity.py); skipped at strength 0
            mixing = mixing_weights(self.affinity, self.seed, self.tokens, vis)
            w = torch.from_numpy(mixing)[None, :, None]
            logits = (1 - w) * logits + w * self._image_target[:, None, :]
        top, ids = logits.topk(self.top_k, dim=-1)                                      # [L, T, k], sorted
        ids = ids.transpose(0, 1).contiguous()                                          # [T, L, k]
        weights = torch.softmax(top, dim=-1).float().transpose(0, 1).contiguous()        # renormalised top-k
        self._append(self.tokens, ids.numpy().astype(np.int16), weights.numpy(), vis, ph, mixing)
        self.tokens += num_tokens
        return Routing(ids, weights, torch.from_numpy(hidden))

    def prefill(self, num_tokens: int | None = None, modality: Any = None) -> torch.Tensor:
        """Route a prompt of num_tokens (or len(modality)) tokens: ids [T, L, k]."""
        return self.route(num_tokens, modality, "prefill").ids

    def decode(self, modality: Any = False) -> torch.Tensor:
        """Route one generated token: ids [L, k]."""
        return self.route(1, modality, "decode").ids[0]

    def _append(self, start: int, ids: np.ndarray, weights: np.ndarray, vis: np.ndarray, ph: np.ndarray,
                mixing: np.ndarray) -> None:
        end = start + len(ids)
        if end > len(self._ids):
            size = max(end, 2 * len(self._ids))
            for name in ("_ids", "_weights", "_modality", "_phase", "_mixing"):
                old = getattr(self, name)
                new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
                new[:start] = old[:start]
                setattr(self, name, new)
        self._ids[start:end], self._weights[start:end] = ids, weights
        self._modality[start:end], self._phase[start:end] = vis, ph
        self._mixing[start:end] = mixing

    def _ensure(self, token: int) -> None:
        if token < 0:
            raise IndexError(f"token must be non-negative, got {token}")
        if token >= self.tokens:  # lazily: tokens not routed yet are text decode tokens
            self.route(token + 1 - self.tokens, None, "decode")

    def ids(self, token: int, layer: int | None = None) -> torch.Tensor:
        """Expert ids int64 of `token` at `layer`: [k] (all layers, [L, k], when layer is None)."""
        self._ensure(token)
        row = self._ids[token] if layer is None else self._ids[token, layer]
        return torch.from_numpy(row.astype(np.int64))

    def weights(self, token: int, layer: int | None = None) -> torch.Tensor:
        """Routing weights float32 of `token` at `layer`: [k] ([L, k] when layer is None)."""
        self._ensure(token)
        return torch.from_numpy((self._weights[token] if layer is None else self._weights[token, layer]).copy())

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [T, L, k], weights float32 [T, L, k]) of every token routed so far."""
        return (torch.from_numpy(self._ids[:self.tokens].astype(np.int64)),
                torch.from_numpy(self._weights[:self.tokens].copy()))


def synthetic_routing(num_tokens: int, layers: int = 48, experts: int = 128, top_k: int = 8, phase: Any = "decode",
                      modality: Any = None, seed: int = 0, corpus_seed: int = 0, calibration: Any = None,
                      **knobs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, L, k], weights float32 [T, L, k]) of one request; arguments as `synthetic_trace`."""
    routing = SyntheticRouter(layers, experts, top_k, seed, corpus_seed, calibration, **knobs).route(
        num_tokens, modality, phase)
    return routing.ids, routing.weights


def synthetic_trace(num_tokens: int, layers: int = 48, experts: int = 128, top_k: int = 8, phase: Any = "decode",
                    modality: Any = None, seed: int = 0, corpus_seed: int = 0, calibration: Any = None,
                    **knobs: Any) -> torch.Tensor:
    """Expert ids int64 [T, L, k] of one request of num_tokens tokens.

    phase: "decode", "prefill" or a [T] 0/1 tensor (recorded only: see the module docstring).
    modality: None (all text) or a [T] bool/uint8 tensor, 1 = vision token.
    seed: the request (its hot set and noise); corpus_seed: the model and corpus (routers, skews).
    calibration: a calibration JSON path or dict (default: the packaged Qwen3-30B-A3B fit).
    knobs: overrides (rho, coupling, temperature, hot, hot_size, spread, skew, vision: a scalar or a
    per-layer sequence; jump, dim, logit_scale: scalars), and the labelled what-if `affinity` (a strength
    in [0, 1], default 0: off) with its `image_seed` (affinity.py)."""
    return synthetic_routing(num_tokens, layers, experts, top_k, phase, modality, seed, corpus_seed, calibration,
                             **knobs)[0]
