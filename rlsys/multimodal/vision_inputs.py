"""A vision-language model's inputs beside its token ids: each image's pixel patches and patch grid,
made by the model's own image processor (the one SGLang's engine runs on the same stored bytes,
sglang/srt/multimodal/processors/qwen_vl.py), so the trainer rebuilds exactly the input the engine saw.

`VisionInputs.for_model(path)` is None for a text model. Its `encode(images)` gives the patches of a
sequence's images; `placeholder_len(images)` how many tokens the engine expands them to (the driver's
context check); `dummy()` the smallest image there is, which a micro-batch without one carries so
every FSDP rank runs the vision tower in every forward and backward (its blocks' all-gathers and
reduce-scatters are collectives: a rank that skipped them would hang the others).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_CACHED_IMAGES = 4096  # encoded images kept per process (a prompt's images recur in each of its forwards)


def vision_config(model_path: str | Path) -> dict | None:
    """config.json's vision_config (with the top level's image token id); None for a text model."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    vision = raw.get("vision_config")
    if vision is None:
        return None
    return {**vision, "image_token_id": raw["image_token_id"]}


@dataclass
class EncodedImages:
    pixel_values: torch.Tensor  # [patches, channels * temporal * patch * patch], float32
    grids: list[tuple[int, int, int]]  # per image: (t, h, w) patches before merging (image_grid_thw)


class VisionInputs:
    """Images (stored bytes, rlsys/multimodal/images.py) -> the vision tower's inputs."""

    def __init__(self, model_path: str | Path, image_token_id: int, spatial_merge_size: int):
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.image_token_id = image_token_id
        self.merge = spatial_merge_size
        self._cache: OrderedDict[bytes, tuple[torch.Tensor, tuple[int, int, int]]] = OrderedDict()

    @classmethod
    def for_model(cls, model_path: str | Path) -> VisionInputs | None:
        vision = vision_config(model_path)
        if vision is None:
            return None
        return cls(model_path, int(vision["image_token_id"]), int(vision.get("spatial_merge_size", 2)))

    def _one(self, image: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        key = hashlib.blake2b(image, digest_size=16).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        from rlsys.multimodal.images import decoded

        out = self.image_processor(images=[decoded(image)], return_tensors="pt")
        encoded = (out["pixel_values"].float(), tuple(int(v) for v in out["image_grid_thw"][0]))
        self._cache[key] = encoded
        if len(self._cache) > _CACHED_IMAGES:
            self._cache.popitem(last=False)
        return encoded

    def encode(self, images: Sequence[bytes]) -> EncodedImages:
        """The patches of `images`, one after another, as the processor gives them for all at once."""
        encoded = [self._one(image) for image in images]
        if not encoded:
            return EncodedImages(torch.zeros(0, self.patch_dim), [])
        return EncodedImages(torch.cat([pixels for pixels, _ in encoded]), [grid for _, grid in encoded])

    def grid(self, image: bytes) -> tuple[int, int, int]:
        """The image's patch grid (t, h, w) before merging, as the processor makes it."""
        return self._one(image)[1]

    def tokens_of(self, grid: Sequence[int]) -> int:
        """Tokens one image of patch grid (t, h, w) takes after merging."""
        t, h, w = grid
        return t * (h // self.merge) * (w // self.merge)

    def placeholder_len(self, images: Sequence[bytes]) -> int:
        """How many tokens the engine's expansion of these images' placeholders adds (each image's
        one placeholder becomes `tokens_of` its grid)."""
        return sum(self.tokens_of(self.grid(image)) - 1 for image in images)

    @property
    def patch_dim(self) -> int:
        processor = self.image_processor
        return 3 * processor.temporal_patch_size * processor.patch_size ** 2

    def dummy(self) -> EncodedImages:
        """One image of one merged patch (zeros), for a micro-batch that has none."""
        return EncodedImages(torch.zeros(self.merge * self.merge, self.patch_dim), [(1, self.merge, self.merge)])
