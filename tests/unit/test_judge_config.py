"""reward.judge's bad input, refused before anything starts with a message naming the field."""

from __future__ import annotations

import pytest

from rlsys.config import JudgeConfig
from rlsys.rewards.judge import JudgeError, JudgeScorer


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from rlsys.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("judge"))  # its weights do not matter here


def test_a_judge_prompt_names_only_the_samples_fields():
    with pytest.raises(ValueError, match=r"names \['answer'\]"):
        JudgeConfig(model="m", prompt="{response} vs {answer}")
    with pytest.raises(ValueError, match="must differ"):
        JudgeConfig(model="m", prompt="{response}", yes="y", no="y")


def test_a_judge_model_that_is_no_model_directory_is_refused(tmp_path):
    with pytest.raises(JudgeError, match=r"reward.judge.model .*\(no config.json or tokenizer_config.json\)"):
        JudgeScorer(JudgeConfig(model=str(tmp_path), prompt="{response}"), tmp_path)


def test_answers_that_are_not_one_token_and_a_missing_chat_template_are_refused(judge_dir, tmp_path):
    with pytest.raises(JudgeError, match="reward.judge.yes 'yes' is 3 tokens"):
        JudgeScorer(JudgeConfig(model=str(judge_dir), prompt="{response}"), tmp_path)
    with pytest.raises(JudgeError, match="no chat template"):
        JudgeScorer(JudgeConfig(model=str(judge_dir), prompt="{response}", yes="y", no="n", chat_template=True),
                    tmp_path)
    scorer = JudgeScorer(JudgeConfig(model=str(judge_dir), prompt="{response}={label}?", yes="y", no="n"), tmp_path)
    assert scorer.answers == tuple(scorer.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in "yn")
