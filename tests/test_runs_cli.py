"""`rlsys runs` and `rlsys compare` over run directories as `rlsys train` leaves them."""

import json
import subprocess
import sys

import pytest

from rlsys.cli import main
from rlsys.metrics import MetricsLog
from rlsys.runs import compare_rows


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
    assert sorted(rows, key=int) == ["0", "10", "11", "20", "29"]  # eval steps of either run, and the last
    assert rows["10"] == ["0.25 / 0.5", "0.5 / 1"]
    assert rows["29"] == ["0.725 / -", "1 / -"]  # the shorter run has no row there


def test_compare_writes_a_png_plot(runs_root, tmp_path, capsys):
    out_png = tmp_path / "plots" / "cmp.png"
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"), "--plot", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_compare_names_what_is_wrong(runs_root, capsys):
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "not-a-run")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["compare", str(runs_root / "baseline"), str(runs_root / "dapo"), "--metrics", "rewrd_mean"]) == 2
    err = capsys.readouterr().err
    assert "neither run logged rewrd_mean" in err and "reward_mean" in err


def test_compare_rows_thin_out_long_runs():
    rows = [{"step": s} for s in range(200)]
    steps = compare_rows(rows, rows, ("reward_mean",), max_rows=25)
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
