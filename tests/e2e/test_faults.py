"""Fault injection: an engine that dies mid-run (colocated: IPC transport; disaggregated: one of two
engines in the broadcast group) stops the run with a clear message, cleanly."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, standing_rollout, started_run, train_command


@pytest.mark.own_engines
@pytest.mark.parametrize(("config", "engines"), [("quickstart.yaml", 1)])
def test_engine_killed_with_no_restarts_left_fails_the_run_with_a_clear_message(leftovers, tmp_path, tiny_model_dir,
                                                                                 config, engines):
    run_dir = tmp_path / "run"
    with started_run(config, tiny_model_dir, run_dir, "trainer.total_steps=2000", "rollout.engine.max_restarts=0") as run:
        _wait_for_steps(run, run_dir, 3)
        servers = _engine_servers(leftovers, tiny_model_dir)
        assert len(servers) == engines
        os.kill(servers[-1].pid, signal.SIGKILL)  # an engine's server dies without warning
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1
    assert "rlsys: run failed: a trainer rank or rollout engine failed" in stderr
    assert "SGLang server" in stderr and "restarts (rollout.engine.max_restarts) are used up" in stderr
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    time.sleep(2)
    assert leftovers.processes() == []
    assert leftovers.shm_files() == []


BAD_REWARDS = '''
import time

def hangs_or_lies(prompt, response, label, metadata):
    if label == "7":
        time.sleep(60)  # hangs: stopped at reward.timeout_s
    if label == "3":
        return "1.0"  # not a number
    if label == "1":
        return 1e300  # a number, too large to take
    return float(response.strip() == label)
'''


def test_hanging_and_non_number_rewards_are_counted_and_the_run_finishes(tmp_path, tiny_model_dir, ray_address,
                                                                         quickstart_engines):
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    run_dir = tmp_path / "run"
    # The hanging call sleeps 60 s a time (several per step): the run finishing within the
    # subprocess timeout at all needs every such call stopped at reward.timeout_s.
    result = subprocess.run(
        train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=3", "eval.interval=2",
                      "reward.function=bad_rewards.py:hangs_or_lies", "reward.timeout_s=0.2", ray_address,
                      quickstart_engines),
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # last_digit prompts end in 7, 3 or 1 about three times in ten: their groups are dropped, each counted
    assert all(r["reward_errors"] > 0 and r["reward_errors"] == 8 * r["dropped_groups"] for r in rows)
    evals = [r for r in rows if "eval_reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval_reward_errors"] > 0 for r in evals)
    # and shown: the run's first failure once on the terminal, each step's first in the run directory
    (said,) = [line for line in result.stderr.splitlines() if "reward call(s) failed; the first, on prompt" in line]
    assert "step 1: " in said and str(run_dir / "logs" / "reward_errors.jsonl") in said
    kept = [json.loads(line) for line in (run_dir / "logs" / "reward_errors.jsonl").read_text().splitlines()]
    assert [e["step"] for e in kept] == [0, 1, 2] and [e["reward_errors"] for e in kept] == \
        [r["reward_errors"] for r in rows]
    assert all(e["prompt"].endswith(">") and e["first_error"] for e in kept)
    shown = " ".join(e["first_error"] for e in kept)
    assert any(why in shown for why in ("1e+300", "'1.0'", "did not return")), shown


def test_steps_whose_loss_is_not_finite_are_said_counted_and_stop_the_run(tmp_path, tiny_model_dir, ray_address,
                                                                          quickstart_engines):
    """An entropy bonus of 1e38 (finite, so the config takes it) times an entropy of ~4 overflows
    float32: every step's loss is -inf and its update is skipped. Such a run used to log `loss: null`
    for every step and end "finished" with exit 0, having learned nothing."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=10", "eval.interval=100",
                      "algorithm.entropy_coef=1e38", "trainer.max_nonfinite_steps=2", ray_address, quickstart_engines),
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps_in_a_row"] for r in rows] == [1, 2]  # recorded, then the run stopped
    assert "step 0: loss " in result.stderr and "its optimizer update was skipped, the weights are unchanged " \
        "(1 in a row; the run stops at 2, trainer.max_nonfinite_steps)" in result.stderr
    assert "rlsys: run failed: step 1: " in result.stderr and "2 steps in a row had a loss or gradient norm that is " \
        "not finite (trainer.max_nonfinite_steps)" in result.stderr
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"


def _wait_for_steps(run: subprocess.Popen, run_dir, steps: int, timeout_s: float = 600,
                    rows_after_restart: bool = False) -> None:
    """Until metrics.jsonl holds `steps` rows (with rows_after_restart: `steps` rows written after the
    trainers' last restart, whose replay rewrites the rows after its checkpoint)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps
               and (not rows_after_restart or json.loads(metrics.read_text().splitlines()[-1]).get("trainer_restarts"))):
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
        time.sleep(0.3)


@pytest.mark.own_engines
def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resume_continues(leftovers, tmp_path, tiny_model_dir,
                                                                           ray_address, quickstart_engines):
    """Ctrl-C in a terminal: SIGINT to the run's whole process group, the local Ray cluster's
    processes and the reward workers included (SIGTERM to the driver alone takes the same path:
    tests/e2e/test_stop_signals.py). Its subject is the cleanup of everything the run started, its
    engine among them (own_engines); the resumed run attaches to the session's engines."""
    run_dir = tmp_path / "run"
    with started_run("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2000",
                     own_process_group=True) as run:
        _wait_for_steps(run, run_dir, 3)
        # a second run on the same directory is refused while the first lives
        second = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, "--resume"),
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and f"is in use by pid {run.pid}" in second.stderr
        os.killpg(run.pid, signal.SIGINT)
        stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "SIGINT (Ctrl-C): stopping after this step, with a checkpoint" in stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints[-1] == f"step_{len(steps):08d}"  # the last finished step is saved
    assert not (run_dir / "rlsys.lock").exists()
    assert leftovers.processes() == [] and leftovers.shm_files() == []

    resumed = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir,
                                           f"trainer.total_steps={len(steps) + 2}", ray_address, quickstart_engines,
                                           "--resume"),
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(steps) + 2))  # no step missing or repeated
    assert [r["weight_version"] for r in rows] == list(range(len(steps) + 2))


def _engine_servers(leftovers, model_dir) -> list:
    return [p for p in leftovers.new_pids("sglang.launch_server") if str(model_dir) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.own_engines
def test_a_silent_engine_in_the_broadcast_group_is_restarted_and_the_run_goes_on(leftovers, tmp_path, tiny_model_dir):
    """One of two engines in the broadcast group, alive but silent past rollout.engine.health_timeout_s."""
    run_dir = tmp_path / "run"
    total = 8
    with started_run("quickstart_disaggregated.yaml", tiny_model_dir, run_dir, f"trainer.total_steps={total}",
                     "eval.interval=20", "rollout.engine.health_timeout_s=5") as run:
        _wait_for_steps(run, run_dir, 3)
        silent = _engine_servers(leftovers, tiny_model_dir)[-1]
        os.kill(silent.pid, signal.SIGSTOP)
        stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    assert "died; restarting it (1 of 3)" in stderr  # a warning
    rows = _check_every_step_once(run_dir, total)
    assert rows[-1]["engine_restarts"] >= 1
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3  # the new engine computes the trainer's policy
    # Before it was stopped, the silent server's process tree left its stacks (its scheduler and
    # detokenizer are its children), the server itself read as stopped where it stood.
    (dump,) = [d for d in (run_dir / "hangs").iterdir() if d.name.startswith("engine-")]
    summary = {entry["pid"]: entry for entry in json.loads((dump / "summary.json").read_text())}
    assert summary[silent.pid]["state"] == "stopped" and "Thread" in (dump / f"{summary[silent.pid]['role']}-"
                                                                        f"{silent.pid}.txt").read_text()
    assert any("scheduler" in entry["name"] for entry in summary.values()), summary
    # the restart says so, and the other processes' stacks were read then (the driver's, the ranks')
    assert f"stopped after no answer for 5s (rollout.engine.health_timeout_s); its processes' stacks are in {dump}" \
        in stderr
    (others,) = [d for d in (run_dir / "hangs").iterdir() if (d / "what.txt").exists()
                 and (d / "what.txt").read_text().startswith(("engine-0 stopped after", "engine-1 stopped after"))]
    roles = {entry["role"] for entry in json.loads((others / "summary.json").read_text())}
    assert {"driver", "trainer rank 0", "trainer rank 1"} <= roles
    time.sleep(2)
    assert leftovers.processes() == [] and leftovers.shm_files() == []


@pytest.mark.own_engines
def test_a_killed_engine_then_a_killed_trainer_rank_are_recovered_and_the_run_goes_on(leftovers, tmp_path, tiny_model_dir):
    """Colocated (IPC transport), in one run: the engine's server is killed, restarted and brought up to
    date; later a trainer rank is killed and the trainers restart from the latest checkpoint, the
    steps after it trained again. The restarted engine serves the trainer's policy from then on
    (logprob_mismatch on every later step); that the run then learns is test_quickstart's."""
    run_dir = tmp_path / "run"
    total = 22
    with started_run("quickstart.yaml", tiny_model_dir, run_dir, f"trainer.total_steps={total}", "eval.interval=100",
                     "rollout.engine.health_timeout_s=5", "checkpoint.interval=3", "checkpoint.max_auto_resumes=2",
                     f"trainer.call_timeout_s={CALL_TIMEOUT_S}") as run:
        _wait_for_steps(run, run_dir, 3)
        os.kill(_engine_servers(leftovers, tiny_model_dir)[-1].pid, signal.SIGKILL)
        _wait_for_steps(run, run_dir, 8)  # the engine is back, a checkpoint at step 6 exists, and steps past it
        ranks = leftovers.new_pids("ray::TrainerWorker")
        assert ranks, "no trainer rank process found"
        os.kill(ranks[-1].pid, signal.SIGKILL)
        _wait_for_steps(run, run_dir, 14, rows_after_restart=True)  # the trainers are back, and past step 12
        ranks = [p for p in leftovers.new_pids("ray::TrainerWorker") if p.is_running()]
        stopped = ranks[-1].pid
        os.kill(stopped, signal.SIGSTOP)  # a rank that hangs: the others wait for it in their next collective
        stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    assert "died; restarting it (1 of 3)" in stderr  # warnings
    assert "a trainer rank died" in stderr and "restarting the trainers from" in stderr
    rows = _check_every_step_once(run_dir, total)  # replayed steps replaced, none missing
    assert rows[-1]["engine_restarts"] >= 1 and rows[-1]["trainer_restarts"] == 2
    # the stopped rank: past trainer.call_timeout_s every process's stacks were kept, the line named it
    (hang,) = [line for line in stderr.splitlines() if f"within {CALL_TIMEOUT_S} s (trainer.call_timeout_s)" in line]
    assert f"(pid {stopped} on " in hang and "stopped (SIGSTOP?)" in hang.split(f"(pid {stopped} on ")[1], hang
    (dump,) = [d for d in (run_dir / "hangs").iterdir()
               if (d / "what.txt").exists() and "did not finish" in (d / "what.txt").read_text()]
    assert str(dump) in hang and "restarting the trainers from" in hang
    roles = {entry["role"] for entry in json.loads((dump / "summary.json").read_text())}
    assert {"driver", "trainer rank 0", "trainer rank 1", "engine-0"} <= roles
    assert any(role.startswith("engine-0 sglang") for role in roles), roles  # the server's children too
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3
    time.sleep(2)
    assert leftovers.processes() == [] and leftovers.shm_files() == []


CALL_TIMEOUT_S = 20  # a train call of this tiny model takes well under a second, even on a loaded machine


def _check_every_step_once(run_dir, total: int) -> list[dict]:
    """The run's metrics: every step once, none lost or trained twice, and the engines got every
    step's weights (restarted ones included)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(total))
    assert [r["weight_version"] for r in rows] == list(range(total))
    return rows


@pytest.mark.own_engines
def test_a_request_that_kills_its_freshly_restarted_engine_is_not_sent_again(quickstart_engines, tmp_path):
    """One engine (the session's quickstart set: its restarts take the set's slot) and a request that
    crashes it (an id past the embedding: the driver's vocabulary check is widened so the id reaches
    the engine). The engine is restarted once and the request sent again; the fresh engine dies of it
    too, so the request is blamed and the rest of rollout.engine.max_restarts (3) is kept."""
    from rlsys.records import SamplingParams
    from rlsys.rollout.manager import PoisonRequest

    with standing_rollout("quickstart", tmp_path) as rollout:
        assert rollout.fleet.max_restarts == 3
        # SGLang pads its embedding to a multiple of 64 rows: an id past the padding too
        past_the_embedding = rollout.vocab_size + 500
        rollout.vocab_size += 1000
        with pytest.raises(PoisonRequest) as error:
            rollout.generate([[5, 9, past_the_embedding]], SamplingParams(max_new_tokens=2), n=1)
        assert rollout.fleet.restarts == 1
        message = str(error.value)
        assert message.startswith("engine-0 died again just after its restart, with prompts 0..0 of the batch (the "
                                  f"first's token ids begin [5, 9, {past_the_embedding}]) in flight both times: that "
                                  "request, not the engine, is taken to be the cause, and it is not sent again "
                                  "(restarts used: 1 of 3)")
        assert "IndexError" in (Path(rollout.fleet.standing.log_dir) / "engine_0.log").read_text()  # what killed it


@pytest.mark.own_engines
def test_a_replacement_engine_lost_before_it_is_up_is_launched_again_in_the_same_restart(quickstart_engines, tmp_path,
                                                                                         monkeypatch):
    """A node that is lost takes its engine at once, but Ray declares the node dead only after its
    missed heartbeats: the first replacement may land on it and be cancelled before it runs (CI saw
    "The actor never ran - it was cancelled before it started running"). Here the first replacement
    is killed before it is up; the restart launches another and the engine is back, one restart."""
    import ray

    from rlsys.records import SamplingParams

    with standing_rollout("quickstart", tmp_path) as rollout:  # the set's slot takes the replacements
        launch, launched = rollout.fleet._launch, []

        def first_one_lost(index):
            actor = launch(index)
            launched.append(actor)
            if len(launched) == 1:
                ray.kill(actor)  # gone before its start() answers, as on a node being declared dead
            return actor

        monkeypatch.setattr(rollout.fleet, "_launch", first_one_lost)
        ray.kill(rollout.fleet.engines[0])
        rollout.fleet.restart(0, "its node was lost")
        assert len(launched) == 2 and rollout.fleet.restarts == 1
        generations = rollout.generate([[5, 9, 14]], SamplingParams(max_new_tokens=2, ignore_eos=True), n=2)
        assert [len(g.response_ids) for g in generations] == [2, 2]
