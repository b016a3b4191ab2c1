"""Datasets, splits, the synthetic task and reward functions."""

import json
import sys

import pytest

from rlsys.algorithms.samples import response_text, score_groups
from rlsys.config import ConfigError, DataConfig, SyntheticTaskConfig
from rlsys.data.datasets import DatasetError, PromptSampler, load_splits, read_jsonl, repeated_prompts_note
from rlsys.data.tasks import generate_task
from rlsys.data.tokenizer import load_tokenizer
from rlsys.plugins import PluginError
from rlsys.records import EncodedPrompt, Generation, PromptRecord, RewardCall
from rlsys.rewards.builtin import exact_match, last_number_match
from rlsys.rewards.loading import load_reward_function
from rlsys.rewards.pool import score_calls


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_row_names_file_line_and_reason(tmp_path):
    path = _write(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "1+1=", "label": "2"}),
        json.dumps({"prompt": "", "label": "3"}),
    ])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: 'prompt' must be a non-empty string"):
        read_jsonl(path)


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not valid JSON"),
    ('["a", "b"]', "must be a JSON object"),
    ('{"prompt": "x"}', "missing 'label'"),
    ('{"prompt": "x", "label": [1]}', "'label' must be a string or a number"),
    ('{"prompt": "x", "label": "1", "metadata": 3}', "'metadata' must be an object"),
    ('{"prompt": "x", "label": "1", "answer": "1"}', "unknown field"),
])
def test_each_kind_of_bad_row_is_explained(tmp_path, line, reason):
    with pytest.raises(DatasetError, match=reason):
        read_jsonl(_write(tmp_path / "d.jsonl", [line]))


def test_a_non_utf8_byte_names_its_line_and_can_be_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n{"prompt": "b", "label": "3"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        read_jsonl(path)
    records, skipped = read_jsonl(path, skip_invalid=True)
    assert [r.label for r in records] == ["1", "3"] and skipped == 1


def test_invalid_rows_can_be_skipped_and_counted(tmp_path):
    path = _write(tmp_path / "d.jsonl", ['{"prompt": "a", "label": 1}', "{bad", '{"prompt": "b", "label": "2"}'])
    records, skipped = read_jsonl(path, skip_invalid=True)
    assert [r.label for r in records] == ["1", "2"] and skipped == 1


def test_assets_count_skipped_rows_and_prompts_too_long_for_the_context(tmp_path, tiny_model_dir):
    from rlsys.config import RunConfig
    from rlsys.run.assets import load_assets

    path = _write(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "1 2>", "label": "2"}),
        "{not json",
        json.dumps({"prompt": "3 4>", "label": "4"}),
        json.dumps({"prompt": "5 " * 40 + ">", "label": "5"}),  # ~80 tokens: no room in a 64-token context
    ])
    config = RunConfig.model_validate({
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(path), "skip_invalid_rows": True},
        "rollout": {"max_new_tokens": 4, "engine": {"context_length": 64}},
    })
    assets = load_assets(config)
    assert [p.record.label for p in assets.train] == ["2", "4"]
    assert (assets.skipped_rows, assets.too_long_prompts) == (1, 1)


def test_eval_split_is_never_in_train(tmp_path):
    rows = [json.dumps({"prompt": f"p{i % 30}", "label": str(i)}) for i in range(60)]
    path = _write(tmp_path / "d.jsonl", rows)
    splits = load_splits(DataConfig(train_path=str(path), eval_fraction=0.2), seed=0)
    assert splits.eval
    assert not {r.prompt for r in splits.eval} & {r.prompt for r in splits.train}


def test_synthetic_task_is_disjoint_and_correct():
    train, eval_ = generate_task(SyntheticTaskConfig(task="max_digit", num_digits=3, num_train=300, num_eval=50))
    assert len(train) == 300 and len(eval_) == 50
    assert not {r.prompt for r in train} & {r.prompt for r in eval_}
    for record in train[:20]:
        digits = [int(c) for c in record.prompt.rstrip(">").split()]
        assert record.label == str(max(digits))


def test_synthetic_task_too_large_for_its_digit_space_is_rejected():
    with pytest.raises(ConfigError, match="distinct prompts"):  # a clear error, exit code 2
        generate_task(SyntheticTaskConfig(num_digits=1, num_train=10, num_eval=5))


def test_sampler_is_deterministic_and_covers_an_epoch_once():
    records = [EncodedPrompt(PromptRecord(f"p{i}", "l"), [i]) for i in range(10)]
    a, b = PromptSampler(records, 5, seed=3), PromptSampler(records, 5, seed=3)
    first = a.next_batch() + a.next_batch()
    assert first == b.next_batch() + b.next_batch()
    assert sorted(p.token_ids for p in first) == [r.token_ids for r in records]


def test_tokenizer_round_trips_text(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "4 7 2>9 (a+b)=c?"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_response_is_cut_at_eos_and_read_without_special_tokens_unless_asked(tiny_model_dir):
    """reward.skip_special_tokens: by default the reward reads what TRL's reward functions read (a
    stray <pad> dropped); false keeps it. Either way nothing after the first EOS."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer("7")["input_ids"] + [tokenizer.pad_token_id, tokenizer.eos_token_id] + tokenizer("3")["input_ids"]
    assert response_text(tokenizer, ids) == "7"
    assert response_text(tokenizer, ids, skip_special_tokens=False) == "7<pad>"
    assert tokenizer.batch_decode([ids[: ids.index(tokenizer.eos_token_id) + 1]], skip_special_tokens=True) == ["7"]


def test_reward_function_paths_are_checked():
    assert load_reward_function("rlsys.rewards:exact_match") is exact_match
    with pytest.raises(PluginError, match="package.module:function"):
        load_reward_function("rlsys.rewards.exact_match")
    with pytest.raises(PluginError, match="cannot import module"):
        load_reward_function("no_such_module:f")
    with pytest.raises(PluginError, match="no callable"):
        load_reward_function("rlsys.rewards:nothing")
    with pytest.raises(PluginError, match="must accept"):
        load_reward_function("math:sqrt")


def test_reward_function_from_a_file_or_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "user_reward_mod.py").write_text(
        "def score(prompt, response, label, metadata):\n    return float(response == label)\n"
    )
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('bad import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    by_file = load_reward_function("./user_reward_mod.py:score")
    assert by_file("p", "7", "7", {}) == 1.0
    by_name = load_reward_function("user_reward_mod:score")  # the `rlsys` script's cwd is not on sys.path
    assert by_name("p", "7", "8", {}) == 0.0
    with pytest.raises(PluginError, match="no such file"):
        load_reward_function("missing.py:score")
    with pytest.raises(PluginError, match="bad import"):
        load_reward_function("broken_reward.py:score")


def test_a_reward_file_named_like_a_standard_library_module_is_refused_at_load(tmp_path, monkeypatch):
    """Its folder goes first on the import path: `string.py` would stand in for `string` in the
    reward worker, which breaks while starting."""
    (tmp_path / "string.py").write_text("def score(prompt, response, label, metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(PluginError, match="reward.function: the file 'string.py' has the name of Python's "
                                                  "standard-library module 'string', which it would hide; rename"):
        load_reward_function("string.py:score")
    assert str(tmp_path) not in sys.path  # refused before its folder went on the import path


def test_a_reward_file_imports_modules_beside_it(tmp_path, monkeypatch):
    """Named by path from another working directory, at load time and inside the call."""
    task = tmp_path / "my_task"
    task.mkdir()
    (task / "grading_helpers.py").write_text("def normalise(text):\n    return text.strip().lower()\n")
    (task / "answers_table.py").write_text("ALIASES = {'seven': '7'}\n")
    (task / "my_reward.py").write_text(
        "from grading_helpers import normalise\n\n"
        "def score(prompt, response, label, metadata):\n"
        "    from answers_table import ALIASES  # imported lazily, in the reward worker\n"
        "    return float(ALIASES.get(normalise(response), normalise(response)) == label)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    function = load_reward_function("my_task/my_reward.py:score")
    assert function("p", " SEVEN ", "7", {}) == 1.0
    assert score_calls(function, [RewardCall("p", "eight", "7", {})], timeout_s=10)[0].value == 0.0


def test_builtin_rewards():
    assert exact_match("p", " 7 ", "7", {}) == 1.0
    assert exact_match("p", "77", "7", {}) == 0.0
    assert last_number_match("p", "so 3 + 4 = 7.0", "7", {}) == 1.0
    assert last_number_match("p", "no idea", "7", {}) == 0.0


def test_raising_reward_drops_its_group_and_is_counted(tiny_model_dir):
    from rlsys.records import PromptRecord

    tokenizer = load_tokenizer(tiny_model_dir)
    seven = tokenizer("7")["input_ids"]

    def flaky(prompt, response, label, metadata):
        if prompt == "bad":
            raise KeyError("boom")
        return 1.0

    records = [PromptRecord("good", "7"), PromptRecord("bad", "7")]
    generations = [Generation([1], seven, [0.0], "stop", 0) for _ in range(4)]
    batch = score_groups(records, generations, 2, tokenizer, lambda calls: score_calls(flaky, calls, timeout_s=10))
    assert batch.reward_errors == 2 and batch.dropped_groups == 1
    assert [s.record.prompt for s in batch.samples] == ["good", "good"]
    assert "KeyError" in batch.first_error
    assert batch.first_error_sample == {"prompt": "bad", "response": "7"}


def test_a_failed_reward_is_shown_once_and_each_steps_first_is_kept_in_the_run_directory(tmp_path, caplog):
    """A reward the run refuses (1e300 here) was a count in reward_errors and nothing more."""
    import json

    from rlsys.algorithms.samples import ScoredBatch
    from rlsys.run.reward_errors import RewardErrorLog

    log = RewardErrorLog(tmp_path)
    failed = ScoredBatch(samples=[], reward_errors=8, first_error="Traceback (most recent call last):\n  File "
                         '"x.py", line 1\nValueError: reward function returned 1e+300: larger in magnitude than 1e+30',
                         first_error_sample={"prompt": "4 7 1>", "response": "1"})
    with caplog.at_level("WARNING"):
        log.note(0, ScoredBatch(samples=[]))  # nothing failed: nothing written
        log.note(3, failed)
        log.note(5, failed)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("step 4: 8 reward call(s) failed; the first, on prompt '4 7 1>' and "
                                                 "response '1': ValueError: reward function returned 1e+300")
    assert "\n" not in said[0] and str(tmp_path / "logs" / "reward_errors.jsonl") in said[0]
    lines = [json.loads(line) for line in (tmp_path / "logs" / "reward_errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["reward_errors"], e["prompt"], e["response"]) for e in lines] == \
        [(3, 8, "4 7 1>", "1"), (5, 8, "4 7 1>", "1")]
    assert all(e["first_error"].startswith("Traceback") and "1e+300" in e["first_error"] for e in lines)  # in full


def test_more_prompts_per_step_than_train_prompts_is_said_at_start():
    """The sampler goes round the data within a step; the start-up note says so, with the numbers."""
    records = [EncodedPrompt(PromptRecord(f"p{i}", "0"), [i]) for i in range(3)]
    batch = PromptSampler(records, batch_size=7, seed=0).next_batch()
    assert len(batch) == 7 and len({r.text for r in batch}) == 3  # the same prompts, several times
    assert repeated_prompts_note(7, 3) == (
        "data.prompts_per_step (7) is more than the 3 train prompts: each step trains each prompt 2.3 times on "
        "average (lower data.prompts_per_step to at most 3 to see each prompt at most once per step)")
    assert repeated_prompts_note(3, 3) is None


def test_every_input_error_is_a_user_error_the_cli_prints_in_one_line_and_a_generate_function_has_its_own():
    """One root: what the user can fix is a UserError (the CLI catches that base, exit 2), a stopped
    run a RunFailed; a bad rollout.generate_function is a PluginError naming its field, not a reward error."""
    from rlsys.config import ConfigError
    from rlsys.data.datasets import DatasetError
    from rlsys.errors import RlsysError, RunFailed, UsageError, UserError
    from rlsys.observability.metrics import MetricsFileError
    from rlsys.rewards.loading import RewardFunctionError
    from rlsys.run.generation import load_generate_function
    from rlsys.system.node_checks import NodeCheckFailed
    from rlsys.system.run_lock import RunDirInUse

    for error in (ConfigError, DatasetError, MetricsFileError, UsageError, PluginError, RewardFunctionError,
                  NodeCheckFailed, RunDirInUse):
        assert issubclass(error, UserError) and issubclass(error, ValueError), error
    assert issubclass(RunFailed, RlsysError) and not issubclass(RunFailed, UserError)
    with pytest.raises(PluginError, match="rollout.generate_function 'rlsys.rewards:exact_match' must be an async") \
            as refused:
        load_generate_function("rlsys.rewards:exact_match")
    assert not isinstance(refused.value, RewardFunctionError)
