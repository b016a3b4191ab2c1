"""logging.save_rollouts: each step's trained samples as the trainer got them, one file a step."""

import json

import pytest

from rlsys.observability.rollouts import RolloutDump, read_rollouts, rollout_file
from rlsys.records import Generation, PromptRecord, Sample, TrainSequence


def _sample(prompt: str, response_ids: list[int], reward: float, finish: str = "stop") -> tuple[Sample, TrainSequence]:
    generation = Generation(prompt_ids=[5, 6], response_ids=response_ids, logprobs=[-0.5] * len(response_ids),
                            finish_reason=finish, weight_version=3)
    sample = Sample(PromptRecord(prompt, "7"), generation, "7", reward=reward, shaping=-0.25, advantage=0.5)
    sequence = TrainSequence([5, 6, *response_ids], 2, advantage=0.5, engine_logprobs=generation.logprobs,
                             loss_mask=[1] * len(response_ids) if finish == "stop" else [0] * len(response_ids))
    return sample, sequence


def test_a_step_is_saved_whole_with_what_the_trainer_got(tmp_path):
    dump = RolloutDump(tmp_path, enabled=True)
    pairs = [_sample("1 2 7>", [9, 1], 1.0), _sample("1 2 7>", [9, 9, 9], 0.0, finish="length")]
    dump.save(4, [s for s, _ in pairs], [q for _, q in pairs])

    rows = [json.loads(line) for line in rollout_file(tmp_path, 4).read_text().splitlines()]
    assert rollout_file(tmp_path, 4).name == "step_000004.jsonl"
    assert rows[0] == {"prompt": "1 2 7>", "label": "7", "response": "7", "prompt_ids": [5, 6], "response_ids": [9, 1],
                       "engine_logprobs": [-0.5, -0.5], "loss_mask": [1, 1], "reward": 1.0, "score": 0.75,
                       "advantage": 0.5, "finish_reason": "stop", "weight_version": 3}
    assert rows[1]["loss_mask"] == [0, 0, 0] and rows[1]["finish_reason"] == "length"
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_step_run_again_replaces_its_file_and_steps_read_back_in_order(tmp_path):
    dump = RolloutDump(tmp_path, enabled=True)
    for step, reward in ((1, 0.0), (0, 0.0), (1, 1.0)):  # step 1 again, as a resumed run runs it
        sample, sequence = _sample("p", [9], reward)
        dump.save(step, [sample], [sequence])
    steps = read_rollouts(tmp_path / "rollouts")
    assert [[row["reward"] for row in rows] for rows in steps] == [[0.0], [1.0]]


def test_off_by_default_nothing_is_written(tmp_path):
    sample, sequence = _sample("p", [9], 1.0)
    RolloutDump(tmp_path, enabled=False).save(0, [sample], [sequence])
    assert not (tmp_path / "rollouts").exists()
    with pytest.raises(FileNotFoundError, match="logging.save_rollouts"):
        read_rollouts(tmp_path / "rollouts")
