"""What rlsys prints: "rlsys: ..." lines through logging (rlsys.observability.logs), INFO on
stdout, warnings and errors on stderr; -q/--quiet keeps only the latter, -v/--verbose adds debug lines."""

import logging
import subprocess
import sys

from tests.helpers import refused_by_cli


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m rlsys.cli ARGS`, as a user runs it (the module is __main__ there)."""
    return subprocess.run([sys.executable, "-m", "rlsys.cli", *args], capture_output=True, text=True, timeout=120)


def _torn_run(root):
    """A run directory whose metrics.jsonl ends in a line a kill cut off: `rlsys runs` warns about it."""
    run = root / "killed"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n{"step": 1, "rew')
    return run / "metrics.jsonl"


def test_default_output_is_the_rlsys_lines_on_stdout_and_the_errors_on_stderr(tmp_path):
    listed = _cli("runs", str(tmp_path))
    assert (listed.returncode, listed.stdout, listed.stderr) == (
        0, f"rlsys: no runs under {tmp_path} (a run directory holds metrics.jsonl or status.json)\n", "")
    missing = _cli("runs", str(tmp_path / "missing"))
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2, "", f"rlsys: error: no directory {tmp_path / 'missing'}\n")


def test_quiet_hides_the_info_lines_but_keeps_warnings_and_errors(tmp_path):
    for args in (["--quiet", "runs"], ["runs", "-q"]):  # before or after the command
        quiet = _cli(*args, str(tmp_path))
        assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    metrics = _torn_run(tmp_path)
    listed = _cli("-q", "runs", str(tmp_path))
    assert listed.returncode == 0 and "killed" in listed.stdout  # the table is the command's output, not a log line
    assert listed.stderr == (f"rlsys: warning: {metrics}:2: the last line is cut off (an append interrupted by a kill "
                             "or a full disk); it is dropped\n")
    refused_by_cli("--quiet", "status", "not-a-url")  # exit 2 with its `rlsys: error:` line


def test_verbose_adds_debug_lines(tmp_path):
    (tmp_path / "notes").mkdir()
    _torn_run(tmp_path)
    said = f"rlsys: {tmp_path / 'notes'} is not a run directory (no metrics.jsonl or status.json); not listed"
    assert said not in _cli("runs", str(tmp_path)).stdout
    verbose = _cli("runs", "--verbose", str(tmp_path))
    assert verbose.returncode == 0 and said in verbose.stdout.splitlines()
    assert "the last line is cut off" in verbose.stderr


def test_a_line_logged_under_a_progress_bar_is_written_on_a_cleared_row_and_the_bar_redrawn(capsys):
    from tqdm import tqdm

    bar = tqdm(range(3), desc="GRPO", file=sys.stderr, bar_format="{desc} {n}/{total}")
    for step in bar:
        logging.getLogger("rlsys.run.coordinator").warning("engine-0 died at step %d", step)
    bar.close()
    rows = capsys.readouterr().err.split("\n")
    said = [row for row in rows if "rlsys: " in row]
    assert len(said) == 3
    for step, row in enumerate(said):
        # The bar's text is wiped ("\r" + spaces + "\r") before the line, never left in front of it.
        *before, line = row.split("\r")
        assert line == f"rlsys: engine-0 died at step {step}" and before[-1].strip() == "", repr(row)
    assert all(row.startswith("\rGRPO") for row in rows[rows.index(said[0]) + 1:-1])  # and drawn again below


def test_the_debug_line_of_a_step_gives_each_phase_in_order():
    from rlsys.run.coordinator import _phase_seconds

    row = {"step": 3, "time_generate_s": 0.081, "reward_mean": 0.5, "time_train_s": 0.06, "time_sync_s": 0.0349,
           "time_step_s": 0.19, "timestamp": 1.8e9}
    assert _phase_seconds(row) == "generate 0.08 s, train 0.06 s, sync 0.03 s"


def test_quiet_also_hides_the_progress_bar():
    from rlsys.cli import build_parser, train_overrides

    for argv in (["-q", "train", "c.yaml", "trainer.lr=0.1"], ["train", "c.yaml", "--quiet"]):
        assert train_overrides(build_parser().parse_args(argv))[-1] == "logging.progress_bar=false"
    assert "logging.progress_bar=false" not in train_overrides(build_parser().parse_args(["train", "c.yaml"]))
    assert train_overrides(build_parser().parse_args(["train", "c.yaml", "--resume", "-v"])) == [
        "checkpoint.resume=auto"]


def test_eval_and_export_hide_library_warnings_and_bars_unless_verbose_and_restore_them_after():
    """A command whose output is its result: transformers' logger warnings (not only Python's
    warnings) and progress bars are off inside, as they were after; -v shows everything."""
    import warnings

    from transformers.utils import logging as transformers_logging

    from rlsys.cli.common import library_output_hidden

    before = transformers_logging.get_verbosity()
    with library_output_hidden(logging.INFO):
        assert transformers_logging.get_verbosity() == transformers_logging.ERROR
        assert not transformers_logging.is_progress_bar_enabled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("noise", UserWarning, stacklevel=1)
        assert caught == []  # ignored
    assert transformers_logging.get_verbosity() == before and transformers_logging.is_progress_bar_enabled()
    with library_output_hidden(logging.DEBUG):
        assert transformers_logging.get_verbosity() == before
