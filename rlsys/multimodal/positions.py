"""Qwen2.5-VL's multimodal rotary positions (3 rows: temporal, height, width) of one sequence.

Text tokens count up by one on all three rows. An image's tokens (one per merged patch, row-major
over its h x w grid after merging) sit at (start, start + row, start + column), and the text after it
resumes at start + max(h, w). The rule is transformers 5.19's `Qwen2_5_VLModel.get_rope_index` for
still images (models/qwen2_5_vl/modeling_qwen2_5_vl.py; its temporal interval is 1 for images) and
sglang 0.5.23's `MRotaryEmbedding.get_rope_index` (layers/rotary_embedding/mrope_rope_index.py),
which the engine applies to the same expanded ids; the trainer computes it here, once per sequence,
from the token ids and the images' patch grids alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ImageTokenMismatch(ValueError):
    """A sequence's image tokens do not match its images' patch grids."""


def image_token_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive image tokens: one per image."""
    runs, start = [], None
    for index, token in enumerate(token_ids):
        if token == image_token_id and start is None:
            start = index
        elif token != image_token_id and start is not None:
            runs.append((start, index))
            start = None
    if start is not None:
        runs.append((start, len(token_ids)))
    return runs


def multimodal_position_ids(token_ids: Sequence[int], image_grids: Sequence[Sequence[int]], image_token_id: int,
                            spatial_merge_size: int, prompt_len: int | None = None) -> torch.Tensor:
    """The (3, len(token_ids)) positions of a sequence whose i-th run of image tokens is the i-th
    image, of patch grid `image_grids[i]` = (t, h, w) before merging (the processor's image_grid_thw).
    `prompt_len`: images lie in the first prompt_len tokens only; an image token the model sampled
    after them is text to the engine (it embeds and positions it as any other token), and here too."""
    runs = image_token_runs(token_ids[:prompt_len], image_token_id)
    if len(runs) != len(image_grids):
        raise ImageTokenMismatch(f"{len(runs)} run(s) of image tokens for {len(image_grids)} image(s)")
    pieces, position, previous_end = [], 0, 0
    for (start, end), (t, h, w) in zip(runs, image_grids, strict=True):
        rows, columns = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * rows * columns:
            raise ImageTokenMismatch(f"an image of patch grid {(t, h, w)} has {t * rows * columns} tokens after "
                                     f"{spatial_merge_size} x {spatial_merge_size} merging, its run has {end - start}")
        text = start - previous_end
        pieces.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(columns),
                                                indexing="ij")
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)
        position += max(rows, columns)
        previous_end = end
    tail = len(token_ids) - previous_end
    pieces.append(torch.arange(position, position + tail).expand(3, -1))
    return torch.cat(pieces, dim=1).long()
