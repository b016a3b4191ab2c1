"""Standing engines (rlsys engines up, rollout.attach): a run attached to the session's quickstart set
gets the model's weights at start whatever the last run left, survives its engine being killed,
leaves the engines up and free on Ctrl-C; a second run while one holds the lease, and a run of
another shape, are refused before anything trains."""

import json
import os
import signal
import subprocess

import psutil
import pytest
import ray

from tests.e2e.test_faults import _wait_for_steps
from tests.helpers import server_listening_on, set_engine, started_run, train_command


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lease(name: str = "quickstart"):
    from rlsys.rollout.standing import service

    return ray.get(service(name).lease.remote())


def _kept_rank_pids(name: str = "quickstart") -> list[int]:
    """The processes of the trainer ranks standing set `name` keeps, by rank."""
    from rlsys.actors.warm_ranks import rank_name
    from rlsys.rollout.standing import SERVICE_NAMESPACE

    pids = []
    for rank in range(2):
        try:
            pids.append(ray.get(ray.get_actor(rank_name(name, rank), namespace=SERVICE_NAMESPACE).process.remote())[0])
        except ValueError:
            break
    return pids


def _someone_elses(shm_file: str) -> bool:
    """Whether a live process made or holds this /dev/shm file (once the set's processes are gone)."""
    from rlsys.system.shm_sweep import creator_pid, holders

    creator = creator_pid(shm_file)
    if creator is not None:
        return psutil.pid_exists(creator)
    return bool(holders().get(f"/dev/shm/{shm_file}"))


def test_a_second_run_starts_from_the_model_whatever_the_first_left(tmp_path, tiny_model_dir, ray_address,
                                                                   quickstart_engines):
    """Two runs in a row on the same engines: the first trains them far from the model (a large
    learning rate, profiling steps 1-2); the second's step-0 eval (greedy, before it trains) equals the first's step-0
    eval, its step-0 samples are the first's (same seed: the engine's random stream restarts at the
    run's seed, it does not go on from where the first run left it), and its weight versions are its
    own from 0, with verify on (engine == trainer).

    The set keeps the trainer ranks between runs (actors/warm_ranks.py): the first run starts them
    (none are kept when it starts), the second builds its model in the same processes, and the bits
    equal above say they hold nothing of the first run's (weights, optimizer, RNG, profiler)."""
    from rlsys.actors.warm_ranks import stop_warm_ranks

    stop_warm_ranks("quickstart")
    first, second = tmp_path / "first", tmp_path / "second"
    kept = []
    for run_dir, steps, lr, profile in ((first, 4, "0.01", "[1, 2]"), (second, 1, "0.0005", "null")):
        result = subprocess.run(
            train_command("quickstart.yaml", tiny_model_dir, run_dir, f"trainer.total_steps={steps}",
                          "eval.interval=3", f"trainer.lr={lr}", "weight_sync.verify=true", f"profile.steps={profile}",
                          ray_address, quickstart_engines),
            capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "attached to standing engines 'quickstart'" in result.stdout
        kept.append(_kept_rank_pids())
        took_warm = "trainer: the 2 warm rank(s) standing engines 'quickstart' keep take this run's model"
        assert (took_warm in result.stdout) == (run_dir == second), result.stdout[-3000:]
    assert len(kept[0]) == 2 and kept[1] == kept[0]  # the second run's ranks are the first's processes
    rows_first, rows_second = _rows(first), _rows(second)
    evals_first = [r["eval_reward_mean"] for r in rows_first if "eval_reward_mean" in r]
    assert len(evals_first) == 2 and evals_first[1] != evals_first[0]  # the first run left other weights
    assert rows_second[0]["eval_reward_mean"] == evals_first[0]
    # Same prompts, weights and seed: the same 256 samples, so the same rewards, and the same entropy
    # and gradient (computed before the first update, whatever the learning rate) to the last bit.
    for key in ("reward_mean", "entropy", "grad_norm"):
        assert rows_second[0][key] == rows_first[0][key], key
    assert [r["weight_version"] for r in rows_second] == [0]
    assert set_engine()["weight_version"] == 1 and _lease() is None
    # The first run profiled steps 1-2 (profile.steps): each rank's trace holds its phases (train step,
    # backward, optimizer, weight sync) and their ops and collectives, the driver's timeline each phase
    # of those steps; the second run wrote none.
    profile = first / "profile"
    for rank in (0, 1):
        names = {e.get("name", "") for e in json.loads((profile / f"trainer-rank{rank}.json").read_text())["traceEvents"]}
        assert any("Backward" in name for name in names) and any(name.startswith("c10d::") for name in names), rank
        assert {"rlsys.train_step", "rlsys.backward", "rlsys.optimizer", "rlsys.sync_weights"} <= names, rank
        assert "aten::" in (profile / f"trainer-rank{rank}-ops.txt").read_text()
    timeline = json.loads((profile / "driver-timeline.json").read_text())["traceEvents"]
    phases = {(e["args"]["step"], e["name"]) for e in timeline if e["ph"] == "X"}
    assert {(s, p) for s in (1, 2) for p in ("generate", "train", "sync")} <= phases
    assert {step for step, _ in phases} == {1, 2}
    assert not (second / "profile").exists()


@pytest.mark.own_engines
def test_an_attached_run_survives_its_engine_killed_and_ctrl_c_leaves_the_engines_up(tmp_path, tiny_model_dir,
                                                                                    ray_address, quickstart_engines):
    run_dir = tmp_path / "run"
    before = set_engine()
    with started_run("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2000", "eval.interval=1000",
                     "checkpoint.interval=1000", ray_address, quickstart_engines) as run:
        _wait_for_steps(run, run_dir, 2)
        assert _lease()["holder"]["run_dir"] == str(run_dir)
        server_listening_on(before["url"]).kill()  # the standing engine's server dies without warning
        _wait_for_steps(run, run_dir, len(_rows(run_dir)) + 3)
        run.send_signal(signal.SIGINT)  # Ctrl-C: stop after the step, with a checkpoint
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    rows = _rows(run_dir)
    assert rows[-1]["engine_restarts"] == 1
    assert [r["weight_version"] for r in rows] == list(range(len(rows)))  # nothing trained twice or skipped
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    assert (run_dir / "checkpoints" / f"step_{len(rows):08d}").is_dir()
    after = set_engine()  # restarted by the run in the set's slot, left running, awake and free
    assert after["alive"] and after["url"] != before["url"]
    assert after["weight_version"] == len(rows)
    assert _lease() is None


def test_a_run_is_refused_while_another_holds_the_lease_and_when_it_does_not_match(tmp_path, tiny_model_dir,
                                                                                  ray_address, quickstart_engines):
    from rlsys.rollout.standing import Lease

    held = Lease.take("quickstart", "train", "/elsewhere/run")
    try:
        result = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, tmp_path / "second", ray_address,
                                              quickstart_engines), capture_output=True, text=True, timeout=300)
    finally:
        held.release()
    assert result.returncode == 1
    assert "standing engines 'quickstart' are in use by `rlsys train` pid" in result.stderr
    assert "(run_dir /elsewhere/run)" in result.stderr
    assert not (tmp_path / "second" / "metrics.jsonl").exists() or not _rows(tmp_path / "second")

    result = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, tmp_path / "other", ray_address,
                                          quickstart_engines, "rollout.engine.context_length=128",
                                          "trainer.num_ranks=1"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "the standing engines do not match this run" in result.stderr
    assert "rollout.engine.context_length: the engines' 64, the run's 128" in result.stderr
    assert "trainer.num_ranks (the trainer bundles of the engines' placement): the engines' 2, the run's 1" \
        in result.stderr
    assert _lease() is None and set_engine()["alive"]


@pytest.mark.own_engines
def test_engines_down_leaves_no_process_and_no_shared_memory_file(tmp_path, tiny_model_dir, ray_cluster, ray_address):
    """`rlsys engines up` then `down` on a set of its own: refused while a run holds it, then with
    --force under that run, which fails at once naming why (status failed); nothing of the set is left."""
    import time

    from rlsys.config import load_config
    from rlsys.engines.standing_set import engines_down, engines_status, engines_up
    from rlsys.rollout.standing import StandingEnginesError
    from tests.helpers import REPO

    shm_before = set(os.listdir("/dev/shm"))
    shape = ["trainer.num_ranks=1", "rollout.num_engines=1", "rollout.engine.context_length=96"]
    engines_up(load_config(REPO / "configs" / "quickstart_disaggregated.yaml", [f"model.path={tiny_model_dir}", *shape]),
               "down-test", tmp_path / "logs")
    report = next(r for r in engines_status() if r["name"] == "down-test")
    server = server_listening_on(report["engines"][0]["url"])
    tree = [server, *server.children(recursive=True)]
    run_dir = tmp_path / "run"
    with started_run("quickstart_disaggregated.yaml", tiny_model_dir, run_dir, *shape, "trainer.total_steps=2000",
                     "eval.interval=1000", "rollout.attach=down-test", ray_address) as run:
        _wait_for_steps(run, run_dir, 2)
        with pytest.raises(StandingEnginesError, match="'down-test' are in use by `rlsys train` pid"):
            engines_down("down-test")
        forced_at = time.monotonic()
        assert engines_down("down-test", force=True) == ["down-test"]
        stdout, stderr = run.communicate(timeout=300)
        print(f"the attached run ended {time.monotonic() - forced_at:.1f} s after the forced down")
    assert run.returncode == 1, stderr[-3000:]
    failure = [line for line in stderr.splitlines() if line.startswith("rlsys: run failed: ")]
    assert len(failure) == 1 and "the standing engines 'down-test' this run is attached to were stopped" in failure[0]
    assert "could not renew the lease" not in stderr and "Traceback" not in stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "were stopped" in status["error"]
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []
    assert "down-test" not in [r["name"] for r in engines_status()]
    # a file another process still holds is not the set's (make test runs another pytest beside this one)
    assert [name for name in set(os.listdir("/dev/shm")) - shm_before if not _someone_elses(name)] == []
