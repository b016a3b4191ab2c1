"""The square-colour task (configs/quickstart_vlm.yaml), its prompts as the run encodes them, and
what a vision-language run refuses before anything starts."""

import io

import pytest

from rlsys.config import ConfigError, SyntheticTaskConfig, load_config
from tests.helpers import REPO, write_config


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vlm"), TinyModelSpec(arch="qwen2_5_vl"))


def _pixels(data: bytes) -> set:
    from PIL import Image

    return set(Image.open(io.BytesIO(data)).convert("RGB").getdata())


def test_the_labels_are_balanced_the_images_distinct_and_blank_images_hold_no_square():
    from rlsys.data.tasks import generate_task

    train, eval_ = generate_task(SyntheticTaskConfig(task="square_color", num_train=40, num_eval=20))
    for split in (train, eval_):
        assert sorted(e.label for e in split) == sorted("rgby" * (len(split) // 4))  # chance is 1 in 4 exactly
        assert {e.prompt for e in split} == {"color?"} and all(len(e.images) == 1 for e in split)
    assert len({e.images[0] for e in train + eval_}) == 60  # no image in both splits
    red = next(e for e in train if e.label == "r")
    assert any(r > 150 and g < 80 and b < 80 for r, g, b in _pixels(red.images[0]))
    blank, _ = generate_task(SyntheticTaskConfig(task="square_color", num_train=8, num_eval=4, blank_images=True))
    assert all(len({r for r, _, _ in _pixels(e.images[0])}) == 1 and len(_pixels(e.images[0])) == 1 for e in blank)


def test_prompts_hold_one_placeholder_per_image_and_are_fitted_by_their_expanded_length(tmp_path, vlm_dir):
    """Without a chat template: vision start, image pad, vision end before the prompt's ids; the
    engine expands the pad to 1-4 tokens here, which the context check counts."""
    from rlsys.run.assets import load_assets

    config = load_config(REPO / "configs" / "quickstart_vlm.yaml", [f"model.path={vlm_dir}",
                                                                    "data.synthetic.num_train=40"])
    assets = load_assets(config)
    ids = assets.train[0].token_ids
    assert ids[:3] == [config_value(vlm_dir, "vision_start_token_id"), config_value(vlm_dir, "image_token_id"),
                       config_value(vlm_dir, "vision_end_token_id")]
    assert assets.tokenizer.decode(ids[3:]) == "color?"
    # a budget of 10 tokens holds images of 1 and 2 tokens (9 and 10), not of 4 (12): those are counted out
    tight = load_config(REPO / "configs" / "quickstart_vlm.yaml",
                        [f"model.path={vlm_dir}", "data.synthetic.num_train=40", "rollout.engine.context_length=16",
                         "rollout.max_new_tokens=6"])
    fitted = load_assets(tight)
    assert 0 < fitted.too_long_prompts < 40 + 64 and all(len(p.token_ids) == 9 for p in fitted.train)


def config_value(model_dir, key):
    import json

    return json.loads((model_dir / "config.json").read_text())[key]


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.context_parallel_size=2"], "context_parallel_size=2 with a vision-language model"),
    (["rollout.mode=partial"], "rollout.mode partial with images"),
    (["rollout.generate_function=rlsys.rewards:exact_match"], "generate_function with images"),
])
def test_what_a_vision_language_run_does_not_support_yet_is_refused_naming_it(vlm_dir, overrides, message):
    from rlsys.run.assets import load_assets

    with pytest.raises(ConfigError, match=message):
        load_assets(load_config(REPO / "configs" / "quickstart_vlm.yaml", [f"model.path={vlm_dir}", *overrides]))


def test_freeze_vision_on_a_text_model_and_the_image_task_on_a_text_model_are_refused(tmp_path, tiny_model_dir):
    from rlsys.run.assets import load_assets

    config = load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), ["model.freeze_vision=true"])
    with pytest.raises(ConfigError, match="model.freeze_vision is set but model.path .* has no vision tower"):
        load_assets(config)
    config = load_config(write_config(tmp_path / "d.yaml", tiny_model_dir), ["data.synthetic.task=square_color"])
    with pytest.raises(ConfigError, match="data.synthetic.task=square_color gives each prompt images"):
        load_assets(config)
