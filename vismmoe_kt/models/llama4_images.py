"""Llama 4's image processing over PIL and NumPy: transformers' Llama4ImageProcessor needs torchvision,
which does not import beside the CPU torch these machines run. The same pipeline (tile grids, resizing
without distortion, BF16-rounded normalisation, a global tile) and the processor that pairs it with the
tokenizer; the adapter in llama4.py builds them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.models.llama4.processing_llama4 import Llama4Processor
from transformers.processing_utils import ImagesKwargs


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """(height, width) of every tile grid of at most `max_tiles` tiles, in transformers' order
    (image_processing_llama4.find_supported_resolutions, which cannot be imported without torchvision)."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio[rows / (count // rows)].append((rows, count // rows))
    return [(rows * tile, cols * tile) for grids in by_ratio.values() for rows, cols in grids]


def best_canvas(height: int, width: int, canvases: list[tuple[int, int]], to_max: bool = False) -> tuple[int, int]:
    """transformers' get_best_fit: the canvas an image is resized into without distortion, upscaling as little
    as possible (or as much, `to_max`), downscaling as little as possible, then the smallest area."""
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [s for s in scales if s >= 1]
    chosen = (max(up) if to_max else min(up)) if up else max(s for s in scales if s < 1)
    fits = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(fits, key=lambda c: c[0] * c[1])


def fit_without_distortion(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """transformers' get_max_res_without_distortion."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_h), target_w
    return target_h, min(math.floor(width * scale_h), target_w)


class Llama4ImageProcessorKwargs(ImagesKwargs, total=False):
    max_patches: int
    resize_to_max_canvas: bool


class Llama4ImageProcessorPil(PilBackend):
    """Llama 4's image processor over PIL and NumPy (transformers' Llama4ImageProcessor needs torchvision):
    resize (bilinear) into the best grid of at most `max_patches` square tiles of `size`, without distortion,
    pad with zeros, rescale and normalise (rounded to BF16 precision as transformers' does, kept in fp32),
    split into tiles in raster order, plus a global tile of the whole picture where there is more than one;
    `pixel_values` (tiles, 3, S, S) and `aspect_ratios` (images, 2): the grid's (rows, columns)."""

    do_resize = True
    resample = PILImageResampling.BILINEAR
    size = {"height": 336, "width": 336}
    max_patches = 16
    resize_to_max_canvas = False
    do_rescale = True
    do_normalize = True
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_convert_rgb = True
    valid_kwargs = Llama4ImageProcessorKwargs
    model_input_names = ["pixel_values", "aspect_ratios"]

    def _finish(self, image: np.ndarray, do_rescale: bool, rescale_factor: float, do_normalize: bool, mean: Any,
                std: Any) -> np.ndarray:
        if do_rescale:
            image = self.rescale(image, rescale_factor)
        if do_normalize:
            image = self.normalize(image, mean, std)
        return torch.from_numpy(np.asarray(image, dtype=np.float32)).to(torch.bfloat16).float().numpy()

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size: SizeDict, resample: Any, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any, max_patches: int,
                    resize_to_max_canvas: bool, return_tensors: Any, **kwargs: Any) -> BatchFeature:
        if not do_resize:
            raise ValueError("Llama 4 resizes every image to one of its tile grids: do_resize=False is not supported")
        if size.height is None or size.height != size.width:
            raise ValueError(f"size must be square ('height' == 'width'), got {size}")
        tile = size.height
        canvases = supported_canvases(max_patches, tile)
        pixels, ratios = [], []
        for image in images:  # (C, H, W)
            height, width = image.shape[-2:]
            target = best_canvas(height, width, canvases, resize_to_max_canvas)
            if not resize_to_max_canvas:  # never upscale past one tile's size
                target_free = (min(max(height, tile), target[0]), min(max(width, tile), target[1]))
            else:
                target_free = target
            new_h, new_w = fit_without_distortion(height, width, *target_free)
            resized = self.resize(image, SizeDict(height=max(new_h, 1), width=max(new_w, 1)), resample)
            canvas = np.zeros((resized.shape[0], *target), dtype=resized.dtype)
            canvas[:, :resized.shape[1], :resized.shape[2]] = resized
            canvas = self._finish(canvas, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            rows, cols = target[0] // tile, target[1] // tile
            tiles = canvas.reshape(canvas.shape[0], rows, tile, cols, tile).transpose(1, 3, 0, 2, 4)
            tiles = tiles.reshape(rows * cols, canvas.shape[0], tile, tile)
            if rows * cols > 1:
                whole = self.resize(image, SizeDict(height=tile, width=tile), resample)
                whole = self._finish(whole, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
                tiles = np.concatenate([tiles, whole[None]])
            pixels.append(tiles)
            ratios.append([rows, cols])
        return BatchFeature(data={"pixel_values": np.concatenate(pixels), "aspect_ratios": np.array(ratios, dtype=np.int64)},
                            tensor_type=return_tensors)


class Llama4ImageTextProcessor(Llama4Processor):
    """Llama4Processor over our PIL image processor (the name the family's processor goes by here): `<|image|>`
    in the text becomes `<|image_start|>`, each tile's `<|patch|>` tokens (tile separators between them), the
    global tile's after `<|image|>`, `<|image_end|>`; text without images as it is."""
