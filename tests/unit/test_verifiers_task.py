"""task.verifiers without engines: the config's rules, the environment's rows as records, its rubric as
the scorer (equal to verifiers' own init_state + score_group; errors follow the reward's policy), and a
MultiTurnEnv's turns as token ids (the environment's turn is the chat template's text, masked)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from rlsys.config import RunConfig, VerifiersTaskConfig
from rlsys.environments.verifiers_task import VerifiersTask, VerifiersTaskError
from rlsys.plugins import PluginError
from rlsys.records import EncodedPrompt, Generation, RewardCall, SamplingParams
from rlsys.rollout.trajectory import RolloutContext
from tests.helpers import REPO

EXAMPLE = str(REPO / "configs/examples/verifiers_digits_env.py")


def _config(**sections) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": "m"}, **sections})


@pytest.mark.parametrize("sections, refused", [
    ({"data": {"train_path": "x.jsonl"}}, "brings its own dataset"),
    ({"reward": {"function": "my.mod:fn"}}, "leave reward.function"),
    ({"reward": {"url": "http://localhost:1"}}, "leave reward.function, reward.url"),
    ({"rollout": {"generate_function": "my.mod:gen"}}, "leave rollout.generate_function"),
    ({"data": {"eval_fraction": 0.1}}, "eval_dataset"),
])
def test_a_verifiers_task_is_the_one_source_of_prompts_reward_and_turns(sections, refused):
    with pytest.raises(ValueError, match=refused):
        _config(task={"verifiers": {"module": EXAMPLE}}, **sections)


def test_a_run_without_data_or_task_is_refused():
    with pytest.raises(ValueError, match="data.train_path, data.synthetic or task.verifiers"):
        _config()


def test_the_environments_rows_are_the_prompts_and_the_eval_split():
    task = VerifiersTask.load(VerifiersTaskConfig(module=EXAMPLE, args={"num_train": 30, "num_eval": 6}, num_train=20))
    splits = task.splits()
    assert (len(splits.train), len(splits.eval)) == (20, 6)
    record = splits.train[3]
    row = task.rows["train"][3]
    assert record.messages == ({"role": "user", "content": row["question"]},)
    assert record.prompt == row["question"] and record.label == row["answer"]
    assert task.row_of(record.metadata)["info"] == row["info"]
    assert not task.multi_turn and task.generate_function() is None


def _verifiers_scores(environment, row: dict, responses: list[str]) -> list[tuple[float, dict]]:
    import verifiers as vf
    from verifiers.types import ClientConfig

    async def score():
        states = []
        for response in responses:
            state = await environment.init_state(dict(row), ClientConfig(api_base_url="http://127.0.0.1:9/v1"), "m")
            state["completion"] = [vf.AssistantMessage(content=response)]
            state["trajectory"] = [{"prompt": [], "completion": state["completion"], "reward": None, "advantage": None}]
            states.append(state)
        await environment.rubric.score_group(states)
        return [(s["reward"], s["metrics"]) for s in states]

    return asyncio.run(score())


def test_the_rubric_scores_as_verifiers_does_with_each_function_a_part():
    task = VerifiersTask.load(VerifiersTaskConfig(module=EXAMPLE, args={"num_train": 8, "brevity_weight": 0.25}))
    record = task.splits().train[0]
    responses = [record.label, "x", record.label + "1", "", str((int(record.label) + 1) % 10)]
    scorer = task.scorer(timeout_s=30)
    scorer.start()
    try:
        outcomes = scorer.score([RewardCall(record.prompt, r, record.label, record.metadata) for r in responses])
    finally:
        scorer.close()
    expected = _verifiers_scores(task.environment, task.rows["train"][0], responses)
    assert [o.value for o in outcomes] == [reward for reward, _ in expected] == [1.25, 0.0, 0.0, 0.0, 0.25]
    assert [o.parts for o in outcomes] == [metrics for _, metrics in expected]


def _environment_file(tmp_path, body: str) -> str:
    path = tmp_path / f"env_{abs(hash(body)):x}.py"  # a file of its own: plugins load each file once
    path.write_text(textwrap.dedent('''
        import verifiers as vf
        from datasets import Dataset

        rows = Dataset.from_list([{"question": f"q{i}", "answer": str(i)} for i in range(4)])
    ''') + textwrap.dedent(body))
    return str(path)


def test_group_rewards_see_the_group_and_a_raising_rubric_fails_only_its_group(tmp_path):
    module = _environment_file(tmp_path, '''
        def ranked(completions, answers) -> list[float]:  # group-level: one value per sample of the group
            if any(c[-1].content == "boom" for c in completions):
                raise RuntimeError("a rubric's own failure")
            return [float(len(completions))] * len(completions)

        def load_environment():
            return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[ranked]))
    ''')
    task = VerifiersTask.load(VerifiersTaskConfig(module=module))
    first, second = task.splits().train[:2]
    calls = [RewardCall(first.prompt, r, first.label, first.metadata) for r in ("a", "b", "c")]
    calls += [RewardCall(second.prompt, r, second.label, second.metadata) for r in ("d", "boom")]
    scorer = task.scorer(timeout_s=30)
    scorer.start()
    try:
        outcomes = scorer.score(calls)
    finally:
        scorer.close()
    assert [o.value for o in outcomes[:3]] == [3.0, 3.0, 3.0]
    # verifiers' rubric logs a group function's exception and scores the group 0, as its own rollouts do
    assert [o.value for o in outcomes[3:]] == [0.0, 0.0]


def test_a_rubric_past_the_timeout_is_an_error_of_its_group(tmp_path):
    module = _environment_file(tmp_path, '''
        import asyncio

        async def slow(completion) -> float:
            await asyncio.sleep(30)
            return 1.0

        def load_environment():
            return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[slow]))
    ''')
    task = VerifiersTask.load(VerifiersTaskConfig(module=module))
    record = task.splits().train[0]
    scorer = task.scorer(timeout_s=0.2)
    scorer.start()
    try:
        outcomes = scorer.score([RewardCall(record.prompt, "a", record.label, record.metadata)] * 2)
    finally:
        scorer.close()
    assert all(o.value is None and "reward.timeout_s" in o.error for o in outcomes)


def test_a_module_that_is_no_environment_is_refused_clearly(tmp_path):
    with pytest.raises(PluginError, match="no callable 'load_environment'"):
        VerifiersTask.load(VerifiersTaskConfig(module=_environment_file(tmp_path, "x = 1\n")))
    with pytest.raises(VerifiersTaskError, match="returned dict, not a verifiers Environment"):
        VerifiersTask.load(VerifiersTaskConfig(module=_environment_file(tmp_path, '''
            def load_environment():
                return {}
        ''')))
    with pytest.raises(VerifiersTaskError, match="does not take the arguments"):
        VerifiersTask.load(VerifiersTaskConfig(module=EXAMPLE, args={"no_such_argument": 1}))


def test_a_multi_turn_environments_turn_is_the_templates_text_injected_and_masked():
    from rlsys.tools.tiny_parts import build_tokenizer

    tokenizer = build_tokenizer(chat=True)
    task = VerifiersTask.load(VerifiersTaskConfig(module=EXAMPLE, args={"num_train": 4, "multi_turn": True}))
    record = task.splits().train[0]
    prompt_text = tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True, tokenize=False)
    prompt = EncodedPrompt(record, tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    answers = iter([tokenizer("7", add_special_tokens=False)["input_ids"],  # cut at max_new_tokens: no end token
                    tokenizer("3<|im_end|>", add_special_tokens=False)["input_ids"]])

    async def engine(input_ids, params):  # a stand-in engine: the trajectory's token arithmetic is the subject
        ids = next(answers)
        return Generation(list(input_ids), ids, [-0.5] * len(ids), "length" if len(ids) == 1 else "stop", 0)

    ctx = RolloutContext(prompt, engine, tokenizer, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2), 5.0)
    trajectory = asyncio.run(task.generate_function()(prompt, ctx))
    injected = "<|im_end|>\n<|im_start|>user\nheard 7 again><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(trajectory.response_ids, skip_special_tokens=False) == "7" + injected + "3<|im_end|>"
    assert trajectory.loss_mask == [1] + [0] * len(tokenizer(injected, add_special_tokens=False)["input_ids"]) + [1, 1]
    assert trajectory.turns == 2
    state = task.states[trajectory.info["verifiers_state"]]
    assert [m.content for m in state["completion"]] == ["7", "heard '7'; again>", "3"]


def test_a_turns_tool_call_blocks_become_the_tool_calls_a_tool_env_runs(tmp_path):
    """Qwen's (and Hermes') <tool_call> form, parsed into vf tool calls that a ToolEnv's env_response runs; a
    block that is not a call stays in the text."""
    from rlsys.environments.verifiers_turns import parse_assistant_turn

    module = _environment_file(tmp_path, '''
        def lookup(key: str) -> str:
            """The value stored under key."""
            return {"a": "41", "b": "42"}[key]

        def load_environment():
            return vf.ToolEnv(dataset=rows, tools=[lookup], max_turns=3)
    ''')
    task = VerifiersTask.load(VerifiersTaskConfig(module=module))
    assert task.multi_turn and task.splits().train[0].tools[0]["function"]["name"] == "lookup"
    turn = parse_assistant_turn('Let me look. <tool_call>\n{"name": "lookup", "arguments": {"key": "b"}}\n</tool_call>'
                                '<tool_call>not json</tool_call>')
    assert turn.content == "Let me look. <tool_call>not json</tool_call>"
    [call] = turn.tool_calls
    assert (call.name, call.arguments) == ("lookup", '{"key": "b"}')
    state = task.new_state(task.row_of(task.splits().train[0].metadata))
    [answer] = asyncio.run(task.environment.env_response([*state["prompt"], turn], state))
    assert (answer.role, answer.content, answer.tool_call_id) == ("tool", "42", call.id)
    assert parse_assistant_turn("7").tool_calls is None
