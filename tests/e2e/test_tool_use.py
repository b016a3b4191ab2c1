"""Tool use through rollout.generate_function on the real engine: the calculator example learns,
and tools that raise or hang end their trajectories (counted) without stopping the run."""

import json
import re
import subprocess
import textwrap

import pytest

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command


def test_the_calculator_example_learns_to_call_its_tool(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    run_dir = tmp_path / "run"
    # The target is what only reading the tool's output reaches: a digit after a call scores 0.2, and a
    # model that calls and then guesses a digit scores 0.2 + 0.8 / 10 = 0.28 on average; 0.5 needs the
    # right digit on over a third of the eval prompts. (Greedy eval climbs in steps as digits are learned:
    # one sampling seed measured 0.27 at step 50, 0.51 at 90, 0.62 at 110, 0.94 at 160; another 0.24 at
    # 50 and 0.76 at 200, so 0.9 within the example's 200 steps depends on the draw.)
    result = subprocess.run(train_command("examples/calculator.yaml", tiny_model_dir, run_dir, "eval.stop_at_reward=0.5",
                                          ray_address, quickstart_engines),
                            cwd=REPO,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r]
    assert evals[0] <= 0.2, evals  # untrained: hardly ever calls, answers at chance
    assert evals[-1] >= 0.5, evals
    assert rows[0]["tool_calls_mean"] < 0.2 and rows[-1]["tool_calls_mean"] >= 0.9
    # after a call, the tool's value (4 tokens) sits between two policy tokens
    assert rows[-1]["policy_tokens_fraction"] < 0.5 and rows[-1]["turns_mean"] >= 1.9
    assert all(r["tool_errors"] == 0 for r in rows)


FAULTY_TOOLS = '''
import time

def tool(text):
    digit = int(text[0])
    if digit % 3 == 0:
        raise ArithmeticError("the tool refused " + text)
    if digit % 3 == 1:
        time.sleep(30)  # past rollout.tool_timeout_s
    return 7


async def generate(prompt, ctx):
    await ctx.generate(max_new_tokens=1)
    value = await ctx.call_tool(tool, prompt.text)
    ctx.append(str(value))
    await ctx.generate(max_new_tokens=1)
    ctx.trajectory.info["finished"] = True


def reward(prompt, response, label, metadata):
    return 1.0 if metadata.get("finished") else 0.0
'''


def test_tools_that_raise_or_hang_end_their_trajectories_and_are_counted(tmp_path, tiny_model_dir, ray_address,
                                                                         quickstart_engines):
    (tmp_path / "faulty.py").write_text(textwrap.dedent(FAULTY_TOOLS))
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command(
        "quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2", "eval.interval=100",
        f"rollout.generate_function={tmp_path / 'faulty.py'}:generate", f"reward.function={tmp_path / 'faulty.py'}:reward",
        "rollout.tool_timeout_s=1", "data.prompts_per_step=12", ray_address, quickstart_engines),
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        # prompts start with a digit: 0, 3, 6, 9 raise; 1, 4, 7 hang; 2, 5, 8 answer (which prompts a step
        # draws is fixed by the seed: data.synthetic.seed and the sampler's seed, the same on any machine)
        assert 0 < row["tool_errors"] < 12 * 8
        assert row["tool_calls_mean"] == 1.0
        # finished trajectories (reward 1) and ended ones (0), so the groups still have a spread
        assert 0 < row["reward_mean"] < 1
        assert row["reward_mean"] == pytest.approx(1 - row["tool_errors"] / (12 * 8))


SENDS_OUT_OF_VOCABULARY = '''
async def generate(prompt, ctx):
    await ctx.generate(max_new_tokens=1)
    ctx.append([len(ctx.tokenizer) + 1000])  # an id the model has no embedding row for
    await ctx.generate(max_new_tokens=1)


def reward(prompt, response, label, metadata):
    return 0.0
'''
# The same id appended after the last engine call: no engine sees it, the trainer's embedding would.
RETURNS_OUT_OF_VOCABULARY = SENDS_OUT_OF_VOCABULARY.replace(
    "    await ctx.generate(max_new_tokens=1)\n\n\ndef", "\n\ndef")


@pytest.mark.parametrize("sends", [True, False], ids=["sent-to-the-engine", "only-returned"])
def test_a_generate_function_with_an_out_of_vocabulary_id_fails_the_run_naming_it(tmp_path, tiny_model_dir,
                                                                                   ray_address, quickstart_engines,
                                                                                   sends):
    function = tmp_path / "oov.py"
    function.write_text(SENDS_OUT_OF_VOCABULARY if sends else RETURNS_OUT_OF_VOCABULARY)
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command(
        "quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2", "eval.interval=100",
        f"rollout.generate_function={function}:generate", f"reward.function={function}:reward",
        ray_address, quickstart_engines),
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, result.stderr[-3000:]
    name = f"rlsys: run failed: rollout.generate_function '{function}:generate'"
    if sends:
        assert f"{name} sent the engine input_ids it cannot take, on prompt " in result.stderr
        assert f"{function}:5 (`await ctx.generate(max_new_tokens=1)`)" in result.stderr
        assert " input_ids is outside the model's vocabulary" in result.stderr
    else:
        vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
        assert f"{name} returned a trajectory of prompt " in result.stderr
        assert re.search(r"whose response_ids hold token id \d+ at position 1 of 2, outside the model's vocabulary "
                         rf"\(ids 0\.\.{vocab_size - 1}", result.stderr), result.stderr[-2000:]
    assert "IndexError" not in result.stderr and "Traceback" not in result.stderr
    assert "restarting" not in result.stdout  # no engine ever saw the id
