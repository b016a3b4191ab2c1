"""A dataset row's images, read into the encoded bytes they were stored as (PNG, JPEG, ...).

A row's image field (`data.image_key`) holds one image or a list of them, each:
- a path, relative to the data file's folder (a saved `datasets` directory: that directory) or absolute;
- the image file's bytes (Parquet binary, a saved dataset's `Image` column: {"bytes": ..., "path": ...});
- a `data:image/...;base64,...` URI, or a bare base64 string;
- a PIL image (what `datasets` decodes an `Image` column to), encoded as PNG.
Every image is opened and checked by PIL here, so an unreadable one is a bad row that names its row
and field (and is skipped with `data.skip_invalid_rows`), never a failure in an engine mid-run. The
bytes are kept as stored: the engine and the trainer's processor decode the same bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path


class ImageError(ValueError):
    """Why one image of a row cannot be used (the caller names the row and field)."""


def read_images(value, base_dir: Path | None) -> tuple[bytes, ...]:
    """The row's images (none for a missing or null field), each checked by PIL; ImageError names
    the image's index and why it cannot be read."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    images = []
    for index, item in enumerate(items):
        try:
            images.append(_checked(_image_bytes(item, base_dir)))
        except ImageError as error:
            raise ImageError(f"[{index}]: {error}") from None
    return tuple(images)


def _image_bytes(item, base_dir: Path | None) -> bytes:
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, dict):  # datasets' Image feature, read as Arrow
        if item.get("bytes"):
            return bytes(item["bytes"])
        if item.get("path"):
            return _image_bytes(str(item["path"]), base_dir)
        raise ImageError("an image object needs 'bytes' or 'path'")
    if isinstance(item, str):
        return _from_text(item, base_dir)
    if type(item).__module__.startswith("PIL."):
        out = io.BytesIO()
        item.save(out, format="PNG")
        return out.getvalue()
    raise ImageError(f"an image must be a path, bytes, a base64 string or a data: URI, got {type(item).__name__}")


def _from_text(text: str, base_dir: Path | None) -> bytes:
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header:
            raise ImageError("a data: URI must be base64 (data:image/png;base64,...)")
        return _base64(payload)
    path = Path(text)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        if path.is_file():
            return path.read_bytes()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL byte: not a file
        pass
    try:
        return _base64(text)
    except ImageError:
        raise ImageError(f"{text[:80]!r} is neither an image file (looked for {path}) nor base64") from None


def _base64(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"not valid base64 ({error})") from None


def _checked(data: bytes) -> bytes:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"not an image PIL can read ({error})") from None
    return data


def decoded(data: bytes):
    """The RGB image (PIL) of stored bytes, as the processor takes it."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


THUMBNAIL_SIDE = 64  # pixels: the dashboard's sample table shows each image at most this large


def thumbnail_uri(data: bytes, side: int = THUMBNAIL_SIDE) -> str:
    """A small PNG of the image (its longer side at most `side`), as a data: URI the dashboard shows."""
    from PIL import Image

    image = decoded(data)
    image.thumbnail((side, side), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
