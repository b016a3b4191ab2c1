"""Without a progress bar a run still says how it goes: a line per eval, and step summaries."""

import logging

from rlsys.run.reporting import ProgressLines


def _row(step: int, **fields) -> dict:
    return {"step": step, "reward_mean": 0.25, "loss": 0.01, "kl": 0.0, "response_len_mean": 3.0, "time_step_s": 0.5,
            **fields}


def test_each_eval_gets_a_line_and_summaries_come_at_most_every_interval(caplog):
    clock = iter([0.0, 1.0, 2.0, 31.0, 32.0])
    lines = ProgressLines(total_steps=5, progress_bar=False, interval_s=30.0, clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="rlsys.run.reporting"):
        lines.step(_row(0, eval_reward_mean=0.1), last_step=False)
        lines.step(_row(1), last_step=False)
        lines.step(_row(2, eval_reward_mean=0.4, eval_gsm_reward_mean=0.5, eval_gsm_pass_at_4=0.75), last_step=False)
        lines.step(_row(3), last_step=False)  # 31 s after the last summary
        lines.step(_row(4, reward_mean=None), last_step=True)
    assert [record.getMessage() for record in caplog.records] == [
        "step 1/5: eval_reward_mean 0.100",
        "step 1/5: reward 0.25, loss 0.01, kl 0, response_len 3; 0.50 s",
        "step 3/5: eval_reward_mean 0.400, eval_gsm_reward_mean 0.500, eval_gsm_pass_at_4 0.750",
        "step 4/5: reward 0.25, loss 0.01, kl 0, response_len 3; 0.50 s",
        "step 5/5: loss 0.01, kl 0, response_len 3; 0.50 s",
    ]
    assert all(record.levelno == logging.INFO for record in caplog.records)


def test_with_the_progress_bar_on_they_are_debug_lines(caplog):
    lines = ProgressLines(total_steps=5, progress_bar=True, interval_s=30.0)
    with caplog.at_level(logging.DEBUG, logger="rlsys.run.reporting"):
        lines.step(_row(0, eval_reward_mean=0.1), last_step=False)
    assert {record.levelno for record in caplog.records} == {logging.DEBUG}


def test_a_run_whose_stderr_is_not_a_terminal_prints_lines_instead_of_a_bar():
    """A `ray job submit` or CI log with logging.progress_bar at its default: the bar's redraws
    would be all it shows, so the run prints its eval and summary lines (at INFO) instead."""
    import io

    from rlsys.run.reporting import shows_progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert shows_progress_bar(True, Terminal()) and not shows_progress_bar(False, Terminal())
    assert not shows_progress_bar(True, io.StringIO())  # a log file or a pipe
    assert ProgressLines(5, shows_progress_bar(True, io.StringIO()), 30.0).level == logging.INFO
