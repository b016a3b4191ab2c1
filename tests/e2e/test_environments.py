"""A verifiers environment as the task (task.verifiers), on the session's chat engines: its dataset
trained on, its rubric the reward, and what rlsys logged equal to what verifiers itself computes for
the same completions (its own init_state and rubric, on the texts the run saved), single-turn and
two-turn with a tool (the environment's turn masked from the loss)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from rlsys.data.tokenizer import load_tokenizer
from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command

ENVIRONMENT = "configs/examples/verifiers_digits_env.py"
TURN = "<|im_start|>assistant\n"


def _load_environment(**args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("verifiers_digits_env_test", REPO / ENVIRONMENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_environment(**args)


def _completion(response: str, multi_turn: bool, special: list[str]) -> list:
    """The messages after the prompt, read back from the saved response text (multi-turn: with its turn
    markers; the environment's turn between the assistant's, each assistant turn read without special
    tokens, as a reward reads a response by default: reward.skip_special_tokens)."""
    import verifiers as vf

    def said(text: str) -> str:
        for token in special:
            text = text.replace(token, "")
        return text

    if not multi_turn:
        return [vf.AssistantMessage(content=response)]
    first, rest = response.split("<|im_end|>", 1)
    user, second = rest.split(TURN, 1)
    user_text = user.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return [vf.AssistantMessage(content=said(first)), vf.UserMessage(content=user_text),
            vf.AssistantMessage(content=said(second.split("<|im_end|>", 1)[0]))]


def _scored_by_verifiers(environment, rows: list[dict], multi_turn: bool, special: list[str]) -> list[dict]:
    """Each saved sample scored by verifiers itself: its own init_state of the dataset row, the completion,
    its rubric's score_group over the sample's group."""
    from verifiers.types import ClientConfig

    by_question = {dataset_row["prompt"][-1]["content"]: dataset_row for dataset_row in environment.get_dataset()}

    async def score(group: list[dict]) -> list:
        states = []
        for row in group:
            state = await environment.init_state(dict(by_question[row["prompt"]]),
                                                 ClientConfig(api_base_url="http://127.0.0.1:9/v1"), "policy")
            completion = _completion(row["response"], multi_turn, special)
            state["completion"] = completion
            turns = [message for message in completion if message.role == "assistant"]
            state["trajectory"] = [{"prompt": [], "completion": [turn], "reward": None, "advantage": None}
                                   for turn in turns]
            states.append(state)
        await environment.rubric.score_group(states)
        return [{"reward": s["reward"], **s["metrics"]} for s in states]

    groups = [rows[i:i + 8] for i in range(0, len(rows), 8)]
    return [scored for group in groups for scored in asyncio.run(score(group))]


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "two-turns-and-a-tool"])
def test_a_verifiers_environment_trains_and_its_rubric_is_the_reward(tmp_path, multi_turn, tiny_chat_model_dir,
                                                                    ray_address, chat_engines):
    run_dir = tmp_path / "run"
    args = json.dumps({"num_train": 400, "num_eval": 16, "multi_turn": multi_turn})
    command = train_command("examples/verifiers_digits.yaml", tiny_chat_model_dir, run_dir, "trainer.total_steps=2",
                            "eval.interval=100", "logging.save_rollouts=true", f"task.verifiers.args={args}",
                            ray_address, chat_engines)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1]
    environment = _load_environment(num_train=400, num_eval=16, multi_turn=multi_turn)
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    for step, row in enumerate(metrics):
        saved = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(saved) == 16 * 8 and row["reward_errors"] == 0
        by_verifiers = _scored_by_verifiers(environment, saved, multi_turn, tokenizer.all_special_tokens)
        # The same functions on the same texts: equal to the last bit.
        assert [s["reward"] for s in saved] == [v["reward"] for v in by_verifiers]
        for name in ("correct", "brief", "num_turns"):
            assert row[f"rubric_{name}"] == pytest.approx(sum(v[name] for v in by_verifiers) / len(by_verifiers),
                                                          abs=1e-12)
        if multi_turn:
            assert row["turns_mean"] == 2 and row["rubric_num_turns"] == 2
            for sample in saved:  # the environment's turn, and only it, is masked out of the loss
                mask, ids = sample["loss_mask"], sample["response_ids"]
                first, last = mask.index(0), len(mask) - mask[::-1].index(0)
                assert 0 < first and last < len(mask) and set(mask[first:last]) == {0}
                assert set(mask[:first]) == set(mask[last:]) == {1}
                injected = tokenizer.decode(ids[first:last], skip_special_tokens=False)
                assert "<|im_start|>user\nheard " in injected and injected.endswith("again><|im_end|>\n" + TURN)
                assert 1 <= first <= 2 and 1 <= len(mask) - last <= 2  # each turn: the engine's tokens (max_new_tokens 2)


def test_an_openenv_environments_reward_trains_a_run_and_every_episode_is_logged(tmp_path, tiny_model_dir, ray_address,
                                                                                 quickstart_engines):
    """configs/examples/openenv_echo.yaml: rlsys starts the echo server on loopback, plays one episode per
    sample (reset, step with the answer), trains on the episodes' rewards and stops the server."""
    import psutil

    run_dir = tmp_path / "run"
    command = train_command("examples/openenv_echo.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2",
                            "eval.interval=100", ray_address, quickstart_engines)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1] and all(row["reward_errors"] == 0 for row in metrics)
    special = load_tokenizer(tiny_model_dir).all_special_tokens
    for step, row in enumerate(metrics):
        saved = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(saved) == 16 * 8
        for sample in saved:
            episode = sample["info"]["openenv_episode"]
            assert episode["reset"] == {"echoed_message": ""} and episode["error"] is None
            [step_record] = episode["steps"]
            said = sample["response"]  # a trajectory's text keeps special tokens; the action is sent without them
            for token in special:
                said = said.replace(token, "")
            assert step_record["action"] == {"message": said}
            assert step_record["observation"] == {"echoed_message": said} and step_record["done"]
            right = len(said.strip()) == 1 and said.strip().isdigit()
            assert sample["reward"] == step_record["reward"] == episode["reward"] == (1.0 if right else 0.0)
        assert row["reward_mean"] == pytest.approx(sum(s["reward"] for s in saved) / len(saved), abs=1e-12)
    servers = [p for p in psutil.process_iter(["cmdline"]) if "openenv_echo_server.py" in " ".join(p.info["cmdline"] or [])]
    assert servers == []  # stopped with the run
