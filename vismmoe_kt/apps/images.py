"""Reading user images with errors that name the file and the problem."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError

MAX_IMAGE_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 64_000_000  # beyond this an image is rejected before it is decoded


def load_image(path: str | Path, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """Open, fully decode and convert an image to RGB, or raise InputError."""
    from PIL import Image, UnidentifiedImageError

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
        with Image.open(path) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise InputError(f"image {path}: {width}x{height} pixels is over the {max_pixels:,}-pixel limit")
            image.load()  # decode now: a truncated file fails here, not inside the processor
            return image.convert("RGB")
    except InputError:
        raise
    except Image.DecompressionBombError:
        raise InputError(f"image {path}: too many pixels (decompression-bomb guard)") from None
    except UnidentifiedImageError:
        raise InputError(f"image {path}: not a readable image (corrupt or unsupported format)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"image {path}: corrupt or truncated image data ({exc})") from None
