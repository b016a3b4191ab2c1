"""Chat models on an engine: one that runs with its own tokenizer (a Qwen-style chat template in
its tokenizer_config), where multi-token stop strings work. (The template and the prompts wrapped
in it: tests/unit/test_chat_models.py.)"""

import pytest

from rlsys.data.tokenizer import load_tokenizer
from rlsys.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat-model"), chat=True)


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
