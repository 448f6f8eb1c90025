"""Reading user images, the one way the CLI and the server both read them: the checks a vision processor
would fail on later (size, aspect ratio), done from the header with errors that name the image, and the
conversion of every PIL mode to 8-bit RGB that keeps what the image shows.

`convert("RGB")` alone is not that: it clips 16- and 32-bit greyscale (`I;16`, `I`) and float (`F`)
images to 255, so a mid-grey 16-bit PNG arrives as pure white, and it drops alpha, so the colour under
transparent pixels (often black or arbitrary) shows. `to_rgb` scales deep images by their bit depth and
composites transparency on a fixed background.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InputError

MAX_IMAGE_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 64_000_000  # beyond this an image is rejected before it is decoded
# Qwen2/3-VL's and GLM-4V's processors (smart_resize) raise past 200:1; a strip that thin shows nothing anyway
MAX_ASPECT_RATIO = 200
BACKGROUND = (255, 255, 255)  # transparent pixels show as on a white page, as image viewers draw them


def check_size(width: int, height: int, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """InputError (without the image's name: the caller adds it) for a size no processor should get."""
    if width < 1 or height < 1:
        raise InputError(f"{width}x{height} pixels: the image is empty")
    if width * height > max_pixels:
        raise InputError(f"{width}x{height} pixels is over the {max_pixels:,}-pixel limit")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise InputError(f"{width}x{height} pixels: its aspect ratio {ratio:g}:1 is over the {MAX_ASPECT_RATIO}:1 "
                         f"that vision models' processors take (crop or pad it)")


def _scaled_to_8bit(image):
    """An `I;16*`, `I` or `F` image -> `L`, the value range mapped by bit depth (so mean brightness, as a
    fraction of full scale, stays): 16-bit data (PIL reads 16-bit PNGs and TIFFs as `I;16` or `I`) is
    divided by 257, floats in [0, 1] multiplied by 255, 8-bit range values kept; anything else (negative
    or beyond 16 bits) is stretched from its minimum to its maximum."""
    import numpy as np
    from PIL import Image

    values = np.asarray(image, dtype=np.float64)
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    floats = image.mode == "F"
    if image.mode.startswith("I;16"):
        full = 65535.0
    elif floats and low >= 0 and high <= 1:
        full = 1.0
    elif floats and low >= 0 and high <= 255:
        full = 255.0
    elif low >= 0 and high <= 65535:  # `I` (or `F`) holding 16-bit data
        full = 65535.0
    else:
        values, full = values - low, max(high - low, 1e-12)
    return Image.fromarray(np.clip(np.rint(values * (255.0 / full)), 0, 255).astype(np.uint8), mode="L")


def to_rgb(image):
    """Any decoded PIL image -> 8-bit RGB showing what the image shows (see the module's docstring)."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I") or mode == "F":
        return _scaled_to_8bit(image).convert("RGB")
    if mode == "P" and "transparency" in image.info:
        image, mode = image.convert("RGBA"), "RGBA"
    if mode in ("LA", "La", "PA", "RGBA", "RGBa"):
        rgba = image.convert("RGBA")  # premultiplied modes are un-multiplied here
        page = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(page, rgba).convert("RGB")
    try:
        return image.convert("RGB")  # 1, L, P, CMYK, YCbCr, HSV: PIL's conversions keep the picture
    except ValueError:  # e.g. LAB, which PIL does not convert to RGB
        raise InputError(f"colour mode {mode} is not supported (save it as RGB or greyscale)") from None


def decode(source: str | Path | BinaryIO, max_pixels: int = MAX_IMAGE_PIXELS):
    """A file's name or bytes -> RGB image; InputError without the image's name (the caller adds it, as
    `image PATH: ...` in the CLI or the request field in the server). The size is checked from the
    header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as image:
            check_size(*image.size, max_pixels=max_pixels)
            image.load()  # decode now: a truncated file fails here, not inside the processor
            return to_rgb(image)
    except InputError:
        raise
    except Image.DecompressionBombError:
        raise InputError("too many pixels (decompression-bomb guard)") from None
    except UnidentifiedImageError:
        raise InputError("not a readable image (corrupt or unsupported format)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"corrupt or truncated image data ({exc})") from None


def load_image(path: str | Path, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Open, check, fully decode and convert an image file to RGB, or raise InputError naming the file."""
    path = Path(path)
    try:
        if not path.exists():
            raise InputError(f"image {path}: no such file")
        if not path.is_file():
            raise InputError(f"image {path}: not a regular file")
        size = path.stat().st_size
    except OSError as exc:  # e.g. a name longer than the system allows (a typed line taken for a path)
        raise InputError(f"image {path}: {exc.strerror or exc}") from None
    if size > max_bytes:
        raise InputError(f"image {path}: {size / 2**20:.1f} MiB is over the {max_bytes / 2**20:.0f} MiB limit")
    try:
        return decode(path, max_pixels)
    except InputError as exc:
        raise InputError(f"image {path}: {exc}") from None
