"""Eval sets (eval.datasets): pass@k, each set's metrics, and bad sets refused before anything starts."""

import itertools
import json

import pytest

from rlsys.config import ConfigError, load_config
from rlsys.records import Generation
from rlsys.run.evaluation import EvalSet, pass_at_k, set_metrics
from tests.helpers import write_config


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_of_the_n_answers_hold_a_success(n):
    """Against the definition: over every way of picking k of the n answers, the share that holds
    at least one solved answer (exact rationals, so equal to fp64 rounding)."""
    for correct, k in itertools.product(range(n + 1), range(1, n + 1)):
        answers = [True] * correct + [False] * (n - correct)
        picks = list(itertools.combinations(answers, k))
        assert pass_at_k(n, correct, k) == pytest.approx(sum(any(p) for p in picks) / len(picks), abs=1e-12)


def test_pass_at_k_refuses_k_past_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def _answer(tokens: int, finish: str) -> Generation:
    return Generation(prompt_ids=[1], response_ids=[5] * tokens, logprobs=[0.0] * tokens, finish_reason=finish,
                      weight_version=0)


def test_a_sets_metrics_average_its_n_answers_per_prompt_under_its_own_names():
    from rlsys.records import SamplingParams

    eval_set = EvalSet("math", prompts=[], sampling=SamplingParams(), n_samples=4, interval=5, pass_k=(1, 2, 4),
                       success_threshold=1.0)
    # prompt 1: one answer of 4 right; prompt 2: none (a 0.5 is partial credit, not a success)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    answers = [_answer(2, "stop")] * 6 + [_answer(8, "length")] * 2
    metrics = set_metrics(eval_set, answers, rewards, errors=1)
    assert metrics == pytest.approx({
        "eval_math_reward_mean": 1.5 / 8, "eval_math_reward_errors": 1,
        "eval_math_response_len_mean": (6 * 2 + 2 * 8) / 8, "eval_math_truncated_fraction": 2 / 8,
        "eval_math_pass_at_1": (0.25 + 0) / 2, "eval_math_pass_at_2": (0.5 + 0) / 2, "eval_math_pass_at_4": 0.5,
    })
    default = EvalSet(None, prompts=[], sampling=SamplingParams(), n_samples=1, interval=5)
    assert set(set_metrics(default, answers[:2], [1.0, 0.0], 0)) == {
        "eval_reward_mean", "eval_reward_errors", "eval_response_len_mean", "eval_truncated_fraction"}


def test_metrics_are_grouped_by_the_set_with_the_longest_matching_name():
    from rlsys.run.evaluation import metrics_by_set

    metrics = {"eval_reward_mean": 0.5, "eval_a_reward_mean": 0.1, "eval_a_b_reward_mean": 0.2,
               "eval_a_b_pass_at_4": 0.7, "eval_a_pass_at_2": 0.3}
    assert metrics_by_set(metrics, ["a", "a_b"]) == {
        None: {"reward_mean": 0.5}, "a": {"reward_mean": 0.1, "pass_at_2": 0.3},
        "a_b": {"reward_mean": 0.2, "pass_at_4": 0.7}}


def test_a_set_is_due_every_its_interval_and_at_the_last_step():
    from rlsys.records import EncodedPrompt, PromptRecord, SamplingParams

    prompt = EncodedPrompt(PromptRecord("p", "l"), [3])
    eval_set = EvalSet("s", [prompt], SamplingParams(), 1, interval=4)
    assert [step for step in range(10) if eval_set.due(step, last_step=9)] == [0, 4, 8, 9]
    assert not EvalSet("s", [], SamplingParams(), 1, interval=4).due(0, last_step=9)


def _config(tmp_path, model_dir, *sets: dict):
    return write_config(tmp_path / "c.yaml", model_dir, eval={"datasets": list(sets)})


def test_eval_sets_are_read_in_any_data_format_with_their_own_columns(tmp_path, tiny_model_dir):
    from rlsys.run.assets import load_assets

    rows = [{"question": f"{a} {b} {c}>", "answer": str(c)} for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9)]]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "set.csv").write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    config = load_config(_config(tmp_path, tiny_model_dir,
                                 {"name": "lines", "path": str(tmp_path / "set.jsonl"), "prompt_key": "question",
                                  "label_key": "answer", "n_samples": 2, "pass_k": [2]},
                                 {"name": "table", "path": str(tmp_path / "set.csv"), "prompt_key": "question",
                                  "label_key": "answer", "max_prompts": 2}))
    assets = load_assets(config)
    assert [(s.config.name, [p.record.label for p in s.prompts]) for s in assets.eval_sets] == [
        ("lines", ["3", "6", "9"]), ("table", ["3", "6"])]


def test_an_eval_set_names_its_own_metadata_columns(tmp_path, tiny_model_dir):
    """eval.datasets[].metadata_keys (default: data.metadata_keys): the set's reward reads them."""
    from rlsys.run.assets import load_assets

    rows = [{"prompt": "1 2 3>", "label": "3", "difficulty": 1}, {"prompt": "4 5 6>", "label": "6", "difficulty": 2}]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(_config(tmp_path, tiny_model_dir, {"name": "graded", "path": str(tmp_path / "set.jsonl"),
                                                            "metadata_keys": ["difficulty"]}))
    (graded,) = load_assets(config).eval_sets
    assert [p.record.metadata for p in graded.prompts] == [{"difficulty": 1}, {"difficulty": 2}]


def test_bad_eval_sets_are_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from rlsys.run.assets import load_assets

    missing = load_config(_config(tmp_path, tiny_model_dir, {"name": "gone", "path": str(tmp_path / "gone.jsonl")}))
    with pytest.raises(ConfigError, match=r"eval set 'gone': .*gone.jsonl does not exist"):
        load_assets(missing)
    (tmp_path / "set.jsonl").write_text('{"prompt": "1 2>", "label": "2"}\n')
    with pytest.raises(ConfigError, match=r"eval set 'k': pass_k \[8\] must lie in 1..n_samples \(4\)"):
        load_config(_config(tmp_path, tiny_model_dir, {"name": "k", "path": str(tmp_path / "set.jsonl"),
                                                       "n_samples": 4, "pass_k": [8]}))
    with pytest.raises(ConfigError, match="each set needs a name of its own"):
        load_config(_config(tmp_path, tiny_model_dir, *[{"name": "twice", "path": str(tmp_path / "set.jsonl")}] * 2))
    with pytest.raises(ConfigError, match="name"):
        load_config(_config(tmp_path, tiny_model_dir, {"name": "Has Space", "path": str(tmp_path / "set.jsonl")}))
    bad_reward = load_config(_config(tmp_path, tiny_model_dir, {"name": "r", "path": str(tmp_path / "set.jsonl"),
                                                                "reward_function": "no_such_module:fn"}))
    from rlsys.plugins import PluginError

    with pytest.raises(PluginError,
                       match=r"^eval.datasets\[r\].reward_function: cannot import module 'no_such_module'"):
        load_assets(bad_reward)
    missing_file = load_config(_config(tmp_path, tiny_model_dir, {"name": "f", "path": str(tmp_path / "set.jsonl"),
                                                                  "reward_function": str(tmp_path / "gone.py") + ":fn"}))
    with pytest.raises(PluginError, match=r"^eval.datasets\[f\].reward_function: .*gone.py"):
        load_assets(missing_file)


def test_train_refuses_a_missing_eval_set_file_in_one_line(tmp_path, tiny_model_dir, capsys):
    from rlsys.cli import main

    config = _config(tmp_path, tiny_model_dir, {"name": "gone", "path": str(tmp_path / "gone.jsonl")})
    assert main(["train", str(config), f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "rlsys: error: invalid config: eval set 'gone'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_eval_command_refuses_a_path_that_is_no_checkpoint_or_model(tmp_path, tiny_model_dir, capsys):
    from rlsys.cli import main

    config = write_config(tmp_path / "c.yaml", tiny_model_dir)
    (tmp_path / "not-a-checkpoint").mkdir()
    for args, message in [
        (["--checkpoint", str(tmp_path / "nowhere")], "no such directory"),
        (["--checkpoint", str(tmp_path / "not-a-checkpoint")], "is not a checkpoint directory"),
        (["--model", str(tmp_path)], "is not a Hugging Face model directory (no config.json)"),
    ]:
        assert main(["eval", str(config), *args]) == 2
        err = capsys.readouterr().err
        assert f"rlsys: error: {args[0]} " in err and message in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as neither:
        main(["eval", str(config)])
    assert neither.value.code == 2
    assert "one of the arguments --checkpoint --model is required" in capsys.readouterr().err


def test_eval_refuses_a_model_transformers_cannot_build_before_any_engine(tmp_path, tiny_model_dir, capsys):
    """The driver's input check reads config.json alone (a run's trainer rank 0 checks the rest); `rlsys
    eval` starts no trainer rank, so it asks transformers itself, before it starts an engine."""
    import json
    import shutil

    from rlsys.cli import main

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "model_type": "foonet"}))
    config = write_config(tmp_path / "c.yaml", tiny_model_dir)
    assert main(["eval", str(config), "--model", str(model), "placement.ray_address=127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "model type 'foonet'" in err and "transformers cannot read its config.json" in err, err
    assert "Traceback" not in err


def test_an_answer_exactly_max_new_tokens_long_that_ended_by_its_own_rule_is_not_counted_at_the_limit():
    """truncated_fraction counts answers SGLang cut at max_new_tokens ("length": no EOS or stop
    string came first); one that ends with EOS on its last allowed token finished ("stop"). rlsys
    eval's table names the column for what it counts and says so under it."""
    from rich.console import Console

    from rlsys.algorithms.samples import truncated_fraction
    from rlsys.cli import eval_table

    assert truncated_fraction([_answer(4, "stop"), _answer(4, "length")]) == 0.5  # both 4 = max_new_tokens long
    console = Console(record=True, width=200)
    console.print(eval_table({"eval_reward_mean": 0.5, "eval_truncated_fraction": 1.0}, [], "rlsys eval of m"))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "at max_new_tokens" in text and "truncated" not in text
    assert "reached the length limit without EOS or a stop string" in text


def test_rlsys_evals_table_lists_pass_at_k_by_k_and_its_headers_whole():
    """The columns came out pass@1 | pass@4 | pass@2 (the order the samples finished in)."""
    from rich.console import Console

    from rlsys.cli import eval_table

    metrics = {"eval_held_out_reward_mean": 0.5, "eval_held_out_pass_at_1": 0.5, "eval_held_out_pass_at_4": 0.9,
               "eval_held_out_pass_at_2": 0.7, "eval_held_out_response_len_mean": 3.0}
    table = eval_table(metrics, ["held_out"], "rlsys eval of m")
    assert [column.header for column in table.columns] == ["eval set", "reward", "pass@1", "pass@2", "pass@4", "length"]
    console = Console(record=True, width=24 + 14 * len(table.columns))  # the width `rlsys eval` gives it
    console.print(table)
    assert "pass@4" in console.export_text() and "…" not in console.export_text()
