"""`rlsys runs` and `rlsys compare` over run directories as `rlsys train` leaves them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.cli import main
from rlsys.observability.metrics import MetricsLog
from rlsys.observability.runs import compare_rows
from tests.helpers import refused_by_cli, write_config


def _fake_run(root, name, state, rewards, evals_every=10, total=None, started=1_800_000_000.0):
    run = root / name
    run.mkdir(parents=True)
    log = MetricsLog(run / "metrics.jsonl")
    for step, reward in enumerate(rewards):
        row = {"step": step, "reward_mean": reward, "response_len_mean": 1.0, "timestamp": started + 2.0 * (step + 1)}
        if step % evals_every == 0 or step == len(rewards) - 1:
            row["eval_reward_mean"] = min(1.0, reward * 2)
        log.append(row)
    (run / "status.json").write_text(json.dumps({
        "state": state, "total_steps": total or len(rewards), "started_at": started,
        "finished_at": started + 2.0 * len(rewards) if state == "finished" else None}))
    return run


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    _fake_run(root, "baseline", "finished", [i / 40 for i in range(30)])
    _fake_run(root, "dapo", "running", [i / 20 for i in range(12)], total=30, started=1_800_000_500.0)
    (root / "not-a-run").mkdir()
    return root


def test_runs_lists_every_run_with_state_steps_and_last_rewards(runs_root, capsys):
    assert main(["runs", str(runs_root)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert set(lines) == {"baseline", "dapo"}
    baseline = [cell.strip() for cell in lines["baseline"].split("│")[1:-1]]
    assert baseline[:5] == ["baseline", "finished", "30 / 30", "0.725", "1"]
    assert baseline[5] == "60 s"  # 30 steps of 2 s
    dapo = [cell.strip() for cell in lines["dapo"].split("│")[1:-1]]
    assert dapo[:5] == ["dapo", "running", "12 / 30", "0.55", "1"]
    assert out.index("baseline") < out.index("dapo")  # oldest first


def test_runs_of_an_empty_or_missing_directory(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().out
    assert main(["runs", str(tmp_path / "missing")]) == 2


def test_compare_shows_both_curves_at_the_eval_steps_and_the_last(runs_root, capsys):
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"),
                 "--metrics", "reward_mean,eval_reward_mean"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if "│" in line and line.split("│")[1].strip().isdigit()}
    # eval steps of either run, and the last; numbered as the console counts (metrics.jsonl's step + 1)
    assert sorted(rows, key=int) == ["1", "11", "12", "21", "30"]
    assert rows["11"] == ["0.25 / 0.5", "0.5 / 1"]
    assert rows["30"] == ["0.725 / -", "1 / -"]  # the shorter run has no row there


def test_compare_takes_a_sweep_of_runs(runs_root, tmp_path, capsys):
    _fake_run(runs_root, "lr-3", "finished", [i / 80 for i in range(20)], started=1_800_001_000.0)
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"), str(runs_root / "lr-3"),
                 "--metrics", "reward_mean", "--plot", str(tmp_path / "sweep.png")]) == 0
    out = capsys.readouterr().out
    assert "baseline (A) vs dapo (B) vs lr-3 (C)" in " ".join(out.split())
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if "│" in line and line.split("│")[1].strip().isdigit()}
    assert rows["1"] == ["0 / 0 / 0"] and rows["30"] == ["0.725 / - / -"]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "needs two runs or more" in refused_by_cli("compare", str(runs_root / "baseline"))


def test_compare_writes_a_png_plot(runs_root, tmp_path, capsys):
    out_png = tmp_path / "plots" / "cmp.png"
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"), "--plot", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_compare_refuses_a_plot_path_under_a_file_as_a_usage_error(runs_root, tmp_path):
    (tmp_path / "afile").write_text("keep me")
    out_png = tmp_path / "afile" / "x.png"
    stderr = refused_by_cli("compare", str(runs_root / "baseline"), str(runs_root / "dapo"), "--plot", str(out_png))
    assert f"--plot {out_png}: cannot write the plot there ({tmp_path / 'afile'} is a file, not a directory)" in stderr
    assert (tmp_path / "afile").read_text() == "keep me"


def test_compare_names_what_is_wrong(runs_root, capsys):
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "not-a-run")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"), "--metrics", "rewrd_mean"]) == 2
    err = capsys.readouterr().err
    assert "no run logged rewrd_mean" in err and "reward_mean" in err


def test_compare_rows_thin_out_long_runs():
    rows = [{"step": s} for s in range(200)]
    steps = compare_rows([rows, rows], ("reward_mean",), max_rows=25)
    assert len(steps) <= 26 and steps[0] == 0 and steps[-1] == 199


ENTRY = """
import atexit, sys
from rlsys import cli
atexit.register(lambda: print("atexit handler ran"))
sys.argv = ["rlsys", "compare", *sys.argv[1:]]
print("a line printed without flushing", end="")
cli.entry()
"""


def test_the_command_skips_only_the_teardown_atexit_handlers_output_and_exit_code_stay(runs_root):
    ok = subprocess.run([sys.executable, "-c", ENTRY, str(runs_root / "baseline"), str(runs_root / "baseline")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("a line printed without flushing") and "eval_reward_mean" in ok.stdout
    assert ok.stdout.rstrip().endswith("atexit handler ran")
    bad = subprocess.run([sys.executable, "-c", ENTRY, str(runs_root / "baseline"), str(runs_root / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not a run directory" in bad.stderr
    assert "atexit handler ran" in bad.stdout


def test_status_of_something_that_is_not_a_url_is_a_usage_error():
    for url in ("not-a-url", "http://127.0.0.1:99999"):
        assert f"{url!r} is not the http:// URL of a status server" in refused_by_cli("status", url)


def test_serve_refuses_a_port_out_of_range(runs_root):
    stderr = refused_by_cli("serve", str(runs_root / "baseline"), "--port", "99999")
    assert "--port must be a TCP port, 0-65535 (0 picks a free one), got 99999" in stderr


def test_serve_on_a_port_in_use_or_an_address_not_of_this_machine_is_a_usage_error(runs_root):
    import socket

    run_dir = str(runs_root / "baseline")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        stderr = refused_by_cli("serve", run_dir, "--port", str(port))
    assert f"--port {port} on 127.0.0.1 is in use; pick another --port, or --port 0 for a free one" in stderr
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no machine's address
    stderr = refused_by_cli("serve", run_dir, "--host", "192.0.2.1", "--port", "0", "--allow-unauthenticated-read")
    assert "--host 192.0.2.1 is not an address of this machine" in stderr


def test_make_tiny_model_refuses_a_file_in_the_way_and_impossible_sizes(tmp_path):
    a_file = tmp_path / "model"
    a_file.write_text("keep me")
    assert f"cannot write to {a_file}: {a_file} is a file, not a directory" in refused_by_cli("make-tiny-model", str(a_file))
    assert a_file.read_text() == "keep me"
    for flags, message in [(["--hidden-size", "-4"], "--hidden-size must be a positive multiple of 8"),
                           (["--hidden-size", "12"], "--hidden-size must be a positive multiple of 8"),
                           (["--num-layers", "0"], "--num-layers must be at least 1, got 0"),
                           (["--init-std", "nan"], "--init-std must be a finite number >= 0, got nan"),
                           (["--init-std", "-0.1"], "--init-std must be a finite number >= 0, got -0.1")]:
        assert message in refused_by_cli("make-tiny-model", str(tmp_path / "new"), *flags)
        assert not (tmp_path / "new").exists()


def test_make_tiny_model_prints_its_one_line_and_no_library_progress_bar(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlsys.cli", "make-tiny-model", str(tmp_path / "model")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Writing model shards" not in result.stdout + result.stderr  # transformers' save_pretrained bar
    assert f"tiny model written to {tmp_path / 'model'}" in result.stdout


def _checkpointed_run(run_dir, model_dir, steps):
    """A run directory as `rlsys train` leaves it: config.yaml and a real trainer checkpoint (DCP
    shards, rank state, coordinator.json) after each of `steps`, the weights changed between them;
    returns each checkpoint's model weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlsys.actors.checkpoint import save_trainer_checkpoint
    from rlsys.run.checkpointing import CheckpointStore, CoordinatorState

    run_dir.mkdir()
    write_config(run_dir / "config.yaml", model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    store, weights = CheckpointStore(run_dir), {}
    for step in steps:
        model(torch.tensor([[4, 5, 6, 7]]), labels=torch.tensor([[4, 5, 6, 7]])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        store.save(step, lambda directory: save_trainer_checkpoint(Path(directory), model, optimizer, scheduler, 0),
                   CoordinatorState(step, step, 0, 0))
        weights[step] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return weights


def test_export_passes_over_a_truncated_checkpoint_and_refuses_a_file_as_output(tmp_path, tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    weights = _checkpointed_run(run_dir, tiny_model_dir, steps=[1, 2])
    shard = run_dir / "checkpoints" / "step_00000002" / "dcp" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # a copy cut short

    stderr = refused_by_cli("export", str(run_dir), str(tmp_path / "out"), "--step", "2")
    assert (f"step_00000002 is incomplete: dcp/__0_0.distcp is truncated ({size // 2} of {size} bytes); "
            "export another with --step N, one of [1]") in stderr
    a_file = tmp_path / "out.safetensors"
    a_file.write_text("keep me")
    assert f"cannot export to {a_file}: {a_file} is a file, not a directory" in refused_by_cli(
        "export", str(run_dir), str(a_file))
    assert a_file.read_text() == "keep me"

    result = subprocess.run([sys.executable, "-m", "rlsys.cli", "export", str(run_dir), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step_00000002 is incomplete (dcp/__0_0.distcp is truncated" in result.stderr
    assert "exporting step_00000001, the latest complete checkpoint" in result.stderr
    # only rlsys's own lines: no library progress bars or warnings in the command's output
    assert all(line.startswith("rlsys: ") for line in (result.stdout + result.stderr).splitlines()), result.stderr
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == weights[1].keys()
    assert all(torch.equal(exported[name], weights[1][name]) for name in exported)
    assert not all(torch.equal(weights[1][name], weights[2][name]) for name in exported)  # step 1 it is

    # a second export into the same directory is refused, naming what is there; --overwrite replaces it
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert f"cannot export to {tmp_path / 'out'}: it holds files already (config.json, " in refused_by_cli(
        "export", str(run_dir), str(tmp_path / "out"), "--step", "1")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--step", "1", "--overwrite"]) == 0
    assert not (tmp_path / "out" / "notes.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_mixture_of_experts_run_exports_one_tensor_per_expert_that_transformers_reads_back_equal(tmp_path):
    """The trainer holds each layer's experts stacked ([E, 2I, H]); the export writes the
    checkpoint's own per-expert tensors, the layout the base model came in and engines load."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", TinyModelSpec(arch="qwen3_moe", num_experts=4))
    run_dir, out = tmp_path / "run", tmp_path / "out"
    weights = _checkpointed_run(run_dir, model_dir, steps=[1])[1]
    assert main(["export", str(run_dir), str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as exported, \
            safe_open(str(model_dir / "model.safetensors"), "pt") as base:
        assert set(exported.keys()) == set(base.keys())
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in exported.keys()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[name], weights[name]) for name in loaded)


def test_resume_passes_over_a_truncated_checkpoint_naming_it_and_the_one_it_resumes_from(tmp_path, tiny_model_dir,
                                                                                         capsys):
    import shutil

    from rlsys.config import ConfigError
    from rlsys.run.checkpointing import STATE_FILE, CheckpointStore, checkpoint_to_resume

    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, tiny_model_dir, steps=[1, 2])
    store = CheckpointStore(run_dir)
    assert checkpoint_to_resume(store) == store.path_for(2) and "rlsys: " not in "".join(capsys.readouterr())
    # a save that did not finish (no coordinator.json, written last) is no checkpoint: passed over unsaid
    unfinished = shutil.copytree(store.path_for(2), store.path_for(3))
    (unfinished / STATE_FILE).unlink()
    assert checkpoint_to_resume(store) == store.path_for(2) and "rlsys: " not in "".join(capsys.readouterr())

    shard = store.path_for(2) / "dcp" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # a copy cut short
    assert checkpoint_to_resume(store) == store.path_for(1)
    assert capsys.readouterr().err == (  # a warning
        f"rlsys: {store.path_for(2)} is incomplete (dcp/__0_0.distcp is truncated ({size // 2} of {size} bytes)); "
        "resuming from step_00000001, the latest complete checkpoint\n")
    (store.path_for(1) / "dcp" / ".metadata").unlink()
    with pytest.raises(ConfigError, match=f"no checkpoint in {store.root} can be resumed: {store.path_for(2)} is "
                       r"incomplete \(dcp/__0_0.distcp is truncated .*; .*step_00000001 is incomplete \(its index"):
        checkpoint_to_resume(store)


def test_runs_compare_and_serve_read_a_run_whose_last_metrics_line_is_cut_off(runs_root, capsys):
    from rlsys.observability.status.state import RunStatus

    metrics = runs_root / "dapo" / "metrics.jsonl"
    with metrics.open("a") as handle:
        handle.write('{"step": 12, "reward_m')  # the driver was killed in the middle of an append
    assert main(["runs", str(runs_root)]) == 0
    captured = capsys.readouterr()
    dapo = next(line for line in captured.out.splitlines() if "dapo" in line)
    assert [cell.strip() for cell in dapo.split("│")[1:4]] == ["dapo", "running", "12 / 30"]
    assert f"rlsys: warning: {metrics}:13: the last line is cut off" in captured.err
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo")]) == 0
    assert RunStatus.from_run_dir(runs_root / "dapo").step == 12  # what `rlsys serve` shows


def test_runs_compare_and_serve_name_the_file_and_line_of_any_other_bad_metrics_line(runs_root, capsys):
    metrics = runs_root / "dapo" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:4]) + "garbage\n" + "".join(lines[4:]))
    for command in (["runs", str(runs_root)], ["compare", str(runs_root / "baseline"), str(runs_root / "dapo")],
                    ["serve", str(runs_root / "dapo"), "--port", "0"]):
        assert main(command) == 2
        assert capsys.readouterr().err.startswith(f"rlsys: error: {metrics}:5: not a JSON object")


def test_a_resumed_runs_wall_time_counts_every_process_it_ran_in(tmp_path):
    """A run stopped after 100 s and resumed for 25 s more shows 125 s in `rlsys runs`, not 25 (the
    resumed process's own)."""
    from rlsys.observability.runs import RunSummary
    from rlsys.observability.status.state import RunStatus

    first = RunStatus(run_id="r", total_steps=10, run_dir=str(tmp_path), started_at=1000.0)
    first.set_state("stopped")
    first.finished_at = 1100.0
    first.save_snapshot()
    assert RunStatus.seconds_run_so_far(tmp_path) == 100.0
    resumed = RunStatus(run_id="r", total_steps=10, run_dir=str(tmp_path), started_at=5000.0,
                        earlier_s=RunStatus.seconds_run_so_far(tmp_path))
    resumed.set_state("finished")
    resumed.finished_at = 5025.0
    resumed.save_snapshot()
    assert RunSummary.read(tmp_path).wall_s == 125.0
    assert RunStatus.from_run_dir(tmp_path).earlier_s == 100.0
    assert RunStatus.seconds_run_so_far(tmp_path / "nothing-here") == 0.0


def test_a_resumed_run_is_listed_as_started_when_its_first_process_started(tmp_path, capsys):
    """`rlsys runs` showed the resume's time as "started" and so sorted a resumed run last."""
    from rlsys.cli import main
    from rlsys.observability.runs import RunSummary, find_runs
    from rlsys.observability.status.state import RunStatus

    older, newer = tmp_path / "older", tmp_path / "newer"
    older.mkdir()
    newer.mkdir()
    first = RunStatus(run_id="o", total_steps=10, run_dir=str(older), started_at=1_800_000_000.0)
    first.set_state("stopped")
    first.save_snapshot()
    RunStatus(run_id="n", total_steps=10, run_dir=str(newer), started_at=1_800_001_000.0).save_snapshot()
    assert RunStatus.first_start(older) == 1_800_000_000.0 and RunStatus.first_start(tmp_path / "none") is None
    resumed = RunStatus(run_id="o", total_steps=10, run_dir=str(older), started_at=1_800_002_000.0,
                        first_started_at=RunStatus.first_start(older))
    resumed.save_snapshot()
    resumed_again = RunStatus(run_id="o", total_steps=10, run_dir=str(older), started_at=1_800_003_000.0,
                              first_started_at=RunStatus.first_start(older))
    resumed_again.save_snapshot()
    assert RunSummary.read(older).started_at == 1_800_000_000.0  # the first process's, through two resumes
    assert [run.name for run in find_runs(tmp_path)] == ["older", "newer"]
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("older") < out.index("newer")


def test_an_export_whose_tokenizer_autotokenizer_would_rebuild_differently_is_said_and_the_tiny_models_is_not(
        tmp_path, tiny_model_dir):
    """A word-level tokenizer saved as PreTrainedTokenizerFast beside a qwen2 model: rlsys runs it as
    saved, AutoTokenizer (transformers 5) rebuilds a Qwen2Tokenizer that gives other ids. The export
    says so and how to load it as the run did; the tiny model's tokenizer round-trips."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlsys.tools.export import auto_tokenizer_problem

    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        str(tmp_path))
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    problem = auto_tokenizer_problem(tmp_path, tmp_path)
    assert problem is not None and "as Qwen2Tokenizer, which tokenizes differently from the run's" in problem
    assert f"PreTrainedTokenizerFast.from_pretrained({str(tmp_path)!r})" in problem
    assert auto_tokenizer_problem(Path(tiny_model_dir), Path(tiny_model_dir)) is None
