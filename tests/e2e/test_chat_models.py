"""Chat models: a tokenizer with a Qwen-style Jinja chat template in its tokenizer_config, prompts
wrapped in it (with a system turn), and an engine that runs with its own tokenizer, where
multi-token stop strings work."""

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


@pytest.mark.slow
def test_an_engine_with_its_own_tokenizer_stops_on_a_multi_token_string(tmp_path, chat_model_dir):
    from rlsys.config import EngineConfig, ModelConfig
    from rlsys.records import SamplingParams
    from rlsys.rollout.engine import RolloutEngine
    from rlsys.rollout.sglang.server import ServerSpec

    tokenizer = load_tokenizer(chat_model_dir)
    model = ModelConfig(path=str(chat_model_dir), tokenizer_path=str(chat_model_dir / "tokenizer"))
    engine = RolloutEngine(ServerSpec(model, EngineConfig(context_length=128, max_total_tokens=4096)), "chat",
                           str(tmp_path / "engine.log"))
    engine.start(timeout_s=300)
    try:
        prompt = tokenizer("<|im_start|>user\n4 7 2><|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)["input_ids"]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        free = engine.generate([prompt], greedy)[0]
        pieces = tokenizer.convert_ids_to_tokens(free.response_ids)
        # A two-token stop string that first occurs at token `at` of the greedy response.
        at = next(i for i in range(1, 10) if all(len(p) == 1 for p in pieces[i:i + 2])
                  and "".join(pieces).find("".join(pieces[i:i + 2])) == sum(len(p) for p in pieces[:i]))
        stop = "".join(pieces[at:at + 2])
        stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                                                           stop=[stop]))[0]
        assert stopped.finish_reason == "stop", (pieces, stop)
        # the same greedy tokens up to and including the stop string, then nothing
        assert stopped.response_ids == free.response_ids[:at + 2]
        assert tokenizer.decode(stopped.response_ids).endswith(stop)
    finally:
        engine.shutdown()
