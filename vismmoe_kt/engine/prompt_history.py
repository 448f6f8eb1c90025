"""What a KV slot holds after its request finished, so a conversation's next turn prefills only what follows.

A finished request's slot keeps its KV until another request needs it: which token ids and which images
(by content) it holds, the M-RoPE delta of its positions, and where pruning left visual tokens out of
its later layers. When the next request starts with the same tokens and the same images (a chat's next
turn re-sends the history), only the tokens after the common prefix are prefilled on top of it
(runner.py). The images the slot holds must all lie inside the reused prefix (their M-RoPE offsets
then hold; positions of the new part come from the whole prompt). Under visual-token pruning a turn
that adds an image is prefilled whole (pruning picks among all visual tokens at once), and the kept
prefix is cut per layer, counting the pruned positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageKey:
    grid: tuple[int, int, int]  # (t, h, w) patches
    digest: bytes               # of its pixel rows: two images of one size give the same tokens

    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def image_keys(inputs: dict[str, torch.Tensor]) -> list[ImageKey]:
    """One key per image of a processed request, in prompt order."""
    grids = inputs.get("image_grid_thw")
    if grids is None:
        return _whole_request_key(inputs)
    pixels = inputs["pixel_values"].detach().cpu().contiguous()
    keys, start = [], 0
    for grid in grids.tolist():
        rows = grid[0] * grid[1] * grid[2]
        digest = hashlib.blake2b(pixels[start:start + rows].numpy().tobytes(), digest_size=16).digest()
        keys.append(ImageKey(tuple(grid), digest))
        start += rows
    return keys


def _whole_request_key(inputs: dict[str, torch.Tensor]) -> list[ImageKey]:
    """Images without per-image grids (DeepSeek-OCR-2: global views and local tiles, fixed token counts):
    one key for all of the request's pixels, with no patches. A cache then keeps a prefix only for the
    very same images and no new ones (another image, or one more, prefills the whole prompt)."""
    tensors = [inputs[name] for name in ("pixel_values", "pixel_values_local") if inputs.get(name) is not None]
    if not tensors:
        return []
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return [ImageKey((0, 0, 0), digest.digest())]


def reusable_prefix(held: list[int], held_images: list[ImageKey], ids: list[int], images: list[ImageKey],
                    image_token_id: int | None, tokens_per_patch: float, new_images_ok: bool) -> int:
    """How many leading tokens of a request (`ids`, `images`) a cache holding `held` (with
    `held_images`) can keep (0: prefill everything)."""
    if not held or images[:len(held_images)] != held_images:
        return 0  # another image where one was: same tokens, different keys and values
    common = _shared_tokens(held, ids)
    if image_token_id is None:
        return common
    if image_token_id in held[common:]:
        return 0  # a held image would be cut: its M-RoPE offsets would go stale
    new = images[len(held_images):]
    if new and not new_images_ok:
        return 0
    # the new part must hold exactly the new images, whole
    if ids[common:].count(image_token_id) != round(sum(k.patches() for k in new) * tokens_per_patch):
        return 0
    return common


class ImageKeys:
    """A request's image keys (image_keys), hashed on first use: hashing copies the pixels
    to the host, several milliseconds an image, which a finishing request would otherwise add to the
    step every running stream waits for."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        self._inputs: dict[str, torch.Tensor] | None = inputs
        self._keys: list[ImageKey] | None = None

    def count(self) -> int:
        """How many images (from their grids: nothing hashed)."""
        if self._keys is not None:
            return len(self._keys)
        grids = self._inputs.get("image_grid_thw")
        return 0 if grids is None else int(grids.shape[0])

    def get(self) -> list[ImageKey]:
        if self._keys is None:
            self._keys, self._inputs = image_keys(self._inputs), None
        return self._keys


def may_continue(held: list[int], ids: list[int], image_token: int | None) -> bool:
    """Whether a slot holding `held` could keep a prefix of `ids`, judged by the tokens alone (reusable_prefix
    decides, hashing the images, only where this says yes): they share a first token, and no held image
    lies past the shared tokens (one would be cut)."""
    common = _shared_tokens(held, ids)
    return common > 0 and (image_token is None or image_token not in held[common:])


def _shared_tokens(held: list[int], ids: list[int]) -> int:
    """Leading tokens `held` and `ids` share, leaving at least one of `ids` to prefill (it gives the
    next logits)."""
    common = 0
    for a, b in zip(held, ids):
        if a != b:
            break
        common += 1
    return min(common, len(ids) - 1)


@dataclass
class SlotHistory:
    """What a free slot holds: token ids with KV in it, their images, the M-RoPE delta of its positions, and
    the positions pruning left out of layers >= `pruned_from` (None: every layer holds every position)."""
    ids: list[int]
    images: ImageKeys
    rope_delta: int
    pruned: list[int] = field(default_factory=list)
    pruned_from: int | None = None

    def layer_lengths(self, tokens: int, layers: int) -> list[int]:
        """Positions each layer holds of the first `tokens` ids."""
        left_out = sum(1 for p in self.pruned if p < tokens)
        return [tokens - left_out if self.pruned_from is not None and layer >= self.pruned_from else tokens
                for layer in range(layers)]
