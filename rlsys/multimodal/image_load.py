"""How much of a trainer micro-batch a dataset's images can take, for the memory plan: the vision
tower runs on every patch of every image in a micro-batch (rlsys/plan/gpu_terms.py
`vision_terms`), so its activations follow the image tokens a micro-batch can hold, not the
micro-batch's token budget alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlsys.records import EncodedPrompt

if TYPE_CHECKING:  # (it imports torch and transformers: the plan reads ImageLoad without them)
    from rlsys.multimodal.vision_inputs import VisionInputs


@dataclass(frozen=True)
class ImageLoad:
    # At most this share of a micro-batch's tokens are image tokens: the largest share in one
    # training sequence (its prompt's image tokens over its expanded prompt and at least one response
    # token), which bounds any packing of them.
    token_share: float
    max_patches: int  # of the largest image, before merging: its vision attention is the largest
    images: int  # training prompts' images (what the bound was read from)


def image_load(prompts: Sequence[EncodedPrompt], vision: VisionInputs) -> ImageLoad | None:
    """The load of these (training) prompts' images; None when they hold none."""
    share, largest, count = 0.0, 0, 0
    for prompt in prompts:
        if not prompt.record.images:
            continue
        grids = [vision.grid(image) for image in prompt.record.images]
        image_tokens = sum(vision.tokens_of(grid) for grid in grids)
        expanded = len(prompt.token_ids) + image_tokens - len(grids)  # each placeholder becomes its tokens
        share = max(share, image_tokens / (expanded + 1))
        largest = max(largest, *(math.prod(grid) for grid in grids))
        count += len(grids)
    return ImageLoad(share, largest, count) if count else None
