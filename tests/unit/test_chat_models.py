"""Chat models: a tokenizer with a Qwen-style Jinja chat template in its tokenizer_config, and
prompts wrapped in it (with a system turn). (An engine that runs with its own tokenizer, where
multi-token stop strings work: tests/e2e/test_chat_models.py.)"""

import pytest

from rlsys.config import ConfigError, load_config
from rlsys.data.tokenizer import load_tokenizer
from rlsys.tools.tiny_model import make_tiny_model
from tests.helpers import write_config


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat-model"), chat=True)


def test_the_template_lives_in_tokenizer_config_as_in_qwen_releases(chat_model_dir):
    import json

    config = json.loads((chat_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and not (chat_model_dir / "chat_template.jinja").exists()
    tokenizer = load_tokenizer(chat_model_dir)
    assert tokenizer.eos_token == "<|im_end|>"


def test_prompts_are_wrapped_in_the_chat_template_with_the_system_turn(tmp_path, chat_model_dir):
    from rlsys.run.assets import load_assets

    path = write_config(tmp_path / "c.yaml", chat_model_dir)
    config = load_config(path, ["data.apply_chat_template=true", "data.system_prompt=Answer with one digit.",
                                "rollout.engine.context_length=128"])
    assets = load_assets(config)
    tokenizer = load_tokenizer(chat_model_dir)
    first = assets.train[0]
    expected = (f"<|im_start|>system\nAnswer with one digit.<|im_end|>\n<|im_start|>user\n{first.record.prompt}"
                "<|im_end|>\n<|im_start|>assistant\n")
    assert first.token_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(first.token_ids) == expected  # every character is a token, newlines included
    without_system = load_assets(load_config(path, ["data.apply_chat_template=true",
                                                    "rollout.engine.context_length=128"]))
    assert tokenizer.decode(without_system.train[0].token_ids).startswith("<|im_start|>user\n")


def test_chat_options_that_cannot_work_are_refused(tmp_path, tiny_model_dir, chat_model_dir):
    from rlsys.run.assets import load_assets

    with pytest.raises(ConfigError, match="system_prompt needs data.apply_chat_template"):
        load_config(write_config(tmp_path / "a.yaml", chat_model_dir), ["data.system_prompt=hi"])
    plain = load_config(write_config(tmp_path / "b.yaml", tiny_model_dir), ["data.apply_chat_template=true"])
    with pytest.raises(ConfigError, match="has no chat template"):
        load_assets(plain)
