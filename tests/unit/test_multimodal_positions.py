"""rlsys's multimodal rotary positions equal transformers' `get_rope_index` for Qwen2.5-VL on
sequences of text and images of many patch grids (rlsys/multimodal/positions.py)."""

import random

import pytest
import torch

from rlsys.multimodal.positions import ImageTokenMismatch, multimodal_position_ids

IMAGE = 85


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' Qwen2_5_VLModel of the tiny VLM's config, on the meta device (get_rope_index reads
    only the config)."""
    from transformers import Qwen2_5_VLModel

    from rlsys.tools.tiny_model import TinyModelSpec
    from rlsys.tools.tiny_vlm import build_vlm_tokenizer, vlm_config

    config = vlm_config(TinyModelSpec(arch="qwen2_5_vl"), build_vlm_tokenizer())
    assert config.image_token_id == IMAGE
    with torch.device("meta"):
        return Qwen2_5_VLModel(config)


def _sequence(rng: random.Random, images: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    ids, grids = [rng.randrange(3, 80) for _ in range(rng.randint(0, 5))], []
    for _ in range(images):
        grid = (1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 4))
        grids.append(grid)
        ids += [81] + [IMAGE] * (grid[1] * grid[2] // 4) + [82] + [rng.randrange(3, 80) for _ in range(rng.randint(0, 6))]
    return ids + [rng.randrange(3, 80) for _ in range(rng.randint(1, 8))], grids


@pytest.mark.parametrize("seed", range(6))
def test_positions_equal_transformers_get_rope_index(reference, seed):
    rng = random.Random(seed)
    ids, grids = _sequence(rng, images=seed % 3 + 1)
    input_ids = torch.tensor([ids])
    expected, _ = reference.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                                           image_grid_thw=torch.tensor(grids))
    assert torch.equal(multimodal_position_ids(ids, grids, IMAGE, 2), expected[:, 0])


def test_text_alone_counts_up_on_every_row():
    assert torch.equal(multimodal_position_ids([5, 6, 7], [], IMAGE, 2), torch.arange(3).expand(3, -1))


def test_image_tokens_that_do_not_match_the_grids_are_refused():
    with pytest.raises(ImageTokenMismatch, match="2 run\\(s\\) of image tokens for 1 image"):
        multimodal_position_ids([IMAGE, 5, IMAGE], [(1, 2, 2)], IMAGE, 2)
    with pytest.raises(ImageTokenMismatch, match="has 4 tokens after 2 x 2 merging, its run has 3"):
        multimodal_position_ids([5, IMAGE, IMAGE, IMAGE], [(1, 4, 4)], IMAGE, 2)
