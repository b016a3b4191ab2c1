"""Where a vision-language batch's image features go: the image tokens of its prompts, and nowhere else.

transformers' Qwen2.5-VL puts image features on every input token equal to the image token id
(`Qwen2_5_VLModel.get_placeholder_mask`, models/qwen2_5_vl/modeling_qwen2_5_vl.py). A policy can
sample that token too (it is in the vocabulary), and the engine then treats it as text: SGLang places
features only at the prompt's image offsets it expanded (sglang/srt/managers/mm_utils.py
`embed_mm_inputs`), and a decoded token is looked up in the embedding table like any other. So
the trainer tells the model which tokens are images (`MicroBatch.image_mask`) for the length of
each forward, and the model's own placeholder mask is used only outside that (`placing(None)`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class ImagePlacement:
    """Installed on a model's inner module that owns `get_placeholder_mask` (once per model)."""

    def __init__(self, model: torch.nn.Module):
        owner = next((module for module in model.modules() if hasattr(module, "get_placeholder_mask")
                      and hasattr(module, "get_image_features")), None)
        if owner is None:
            raise ValueError(f"{type(model).__name__} has no get_placeholder_mask to place image features by")
        self._mask: torch.Tensor | None = None
        self._theirs = owner.get_placeholder_mask
        owner.get_placeholder_mask = self._placeholder_mask  # this instance only

    @contextmanager
    def placing(self, image_mask: torch.Tensor | None):
        """Image features go where `image_mask` [B, T] is true for forwards inside this block."""
        self._mask = image_mask
        try:
            yield
        finally:
            self._mask = None

    def _placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        if self._mask is None:
            return self._theirs(input_ids, inputs_embeds, image_features=image_features, video_features=video_features)
        if video_features is not None:
            raise ValueError("video inputs are not supported")
        image = self._mask.to(inputs_embeds.device)
        if image_features is not None and int(image.sum()) * inputs_embeds.shape[-1] != image_features.numel():
            raise ValueError(f"{int(image.sum())} image tokens in the prompts for "
                             f"{image_features.numel() // inputs_embeds.shape[-1]} image features")
        return image.unsqueeze(-1), torch.zeros_like(image).unsqueeze(-1)
