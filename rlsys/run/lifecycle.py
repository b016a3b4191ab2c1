"""A run's life: `run(config)` checks its inputs, prepares the run directory, starts the Ray
cluster, the status server, the reward workers and the components (rlsys/run/components.py),
restores a checkpoint, hands the loop (rlsys/run/coordinator.py `train_loop`) its `Run`, restarts
the trainers when a rank dies, turns signals into a stop after the step and any failure into a
`failed` status with one line, and stops everything whatever happens.
"""

from __future__ import annotations

import itertools
import logging
import random
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ray.exceptions import RayError

from rlsys.actors.group import TrainerHang
from rlsys.config import RunConfig, dump_config
from rlsys.data.datasets import PromptSampler, repeated_prompts_note
from rlsys.errors import RunFailed
from rlsys.observability.metrics import MetricsLog
from rlsys.observability.status.state import RunStatus
from rlsys.observability.tracking import Trackers, check_backends_installed
from rlsys.rewards.pool import make_run_scorer
from rlsys.rollout.fleet import EngineRestartLimit
from rlsys.run.absolute_paths import default_run_dir, with_absolute_paths
from rlsys.run.assets import RunAssets, load_assets, refuse_incompatible_checkpoint
from rlsys.run.checkpointing import Checkpointer, CheckpointStore, CoordinatorState, checkpoint_to_resume, disk_full_failure
from rlsys.run.components import (
    Components,
    bring_engines_up_to_date,
    restart_trainers,
    start_components,
)
from rlsys.run.coordinator import train_loop
from rlsys.run.evaluation import Evaluator
from rlsys.run.events import RunEvents
from rlsys.run.generation import SampleMaker
from rlsys.run.hangs import HangReporter
from rlsys.run.placement_checks import run_uses_gpus
from rlsys.run.reporting import HealthMonitor, new_status, status_server
from rlsys.run.rollout_modes import runner_for
from rlsys.run.run_state import Run
from rlsys.system.cluster import cluster_address, ray_cluster
from rlsys.system.model_source import resolve_model_paths
from rlsys.system.reaper import start_reaper
from rlsys.system.resource_tracker import start_resource_tracker
from rlsys.system.run_lock import RunDirLock
from rlsys.system.shm_sweep import sweep_shared_memory
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["RunFailed", "StoppedAtOnce", "run"]


def _train_resuming_dead_trainers(run: Run, store: CheckpointStore) -> None:
    """`train_loop`; when a trainer rank dies, the trainer group restarts from the latest
    checkpoint (at most checkpoint.max_auto_resumes times) and the loop goes on from there."""
    for resumes in itertools.count():
        try:
            return train_loop(run)
        except (RayError, TrainerHang) as error:
            checkpoint, _ = store.latest_loadable()
            if resumes >= run.config.checkpoint.max_auto_resumes or checkpoint is None:
                raise
            group = run.parts.trainer
            if isinstance(error, TrainerHang):  # a stuck rank is handled as a dead one (its stacks are kept)
                logger.warning("%s; restarting the trainers from %s (%d of %d)", error, checkpoint, resumes + 1,
                               run.config.checkpoint.max_auto_resumes)
            else:
                dead = [rank["rank"] for rank in group.health(timeout_s=10) if not rank["alive"]]
                if not dead:
                    raise
                cause = getattr(error, "cause", None) or error
                where = ", ".join(f"rank {rank} on node {group.nodes[rank]}" for rank in dead)
                logger.warning("a trainer rank died (%s; %s); restarting the trainers from %s (%d of %d)",
                               type(cause).__name__, where, checkpoint, resumes + 1,
                               run.config.checkpoint.max_auto_resumes)
            # A rank killed between /begin_weight_update and /end_weight_update leaves the engines'
            # session open, and they would refuse the next sync.
            run.parts.rollout.fleet.end_abandoned_weight_updates()
            restart_trainers(run.config, run.parts)
            logger.info("trainer ranks are back, on node(s) %s", ", ".join(sorted(set(run.parts.trainer.nodes))))
            run.continue_from(checkpoint)
            run.trainer_restarts = resumes + 1



def prepare_run_dir(config: RunConfig, run_dir: Path, resuming: bool) -> None:
    if not resuming and (run_dir / "metrics.jsonl").exists():
        raise RunFailed(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and no checkpoint to resume; "
            "choose another run_dir, or pass --resume to continue a checkpointed run"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config.model_copy(update={"run_dir": str(run_dir)}), run_dir / "config.yaml")


def _first_lines(text: str, count: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:count] + (["..."] if len(lines) > count else []))


@contextmanager
def _failures_reported(status: RunStatus):
    """Any error ends the run as `failed` in the status; a dead or raising actor becomes RunFailed."""
    try:
        yield
    except BaseException as error:
        failure = disk_full_failure(error, Path(status.run_dir))  # in this process or in an actor
        if failure is not None:
            message = str(failure)
        elif isinstance(error, TrainerHang):
            message = str(error)
            failure = RunFailed(message)
        elif isinstance(error, (RayError, EngineRestartLimit)):
            cause = getattr(error, "cause", None) or error  # the remote exception, without Ray's wrapping
            message = f"{type(cause).__name__}: {_first_lines(str(cause), 40)}"
            failure = RunFailed(f"a trainer rank or rollout engine failed: {message}")
        else:
            message = f"{type(error).__name__}: {error}"
        status.fail(message)
        try:
            status.save_snapshot()
        except OSError as unsaved:  # reported, but the run's own error stays the one that ends it
            logger.warning("could not record the failure in status.json: %s", unsaved)
        if failure is None:
            raise
        raise failure from error


class StoppedAtOnce(SystemExit):
    """A second stop signal: the run ends inside its step, without a checkpoint (exit 128 + signal)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signal_name = _signal_name(signum)

    def __str__(self) -> str:
        return f"stopped at once by a second {self.signal_name}, without a checkpoint"


def _signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def _stop_on_signals(status: RunStatus) -> None:
    """SIGTERM, or SIGINT (Ctrl-C), stops the run as POST /api/v1/stop does: after the current
    step, with a checkpoint. A second one stops at once (engines and trainers are still shut down).
    The processes a signal to the whole process group also reaches never receive it
    (rlsys.system.interrupts)."""
    def _stop(signum, frame):
        if status.stop_requested:
            raise StoppedAtOnce(signum)
        logger.info("%s: stopping after this step, with a checkpoint (again to stop at once)", _signal_name(signum))
        status.request("stop")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)


def _describe_data(assets: RunAssets) -> str:
    dropped = []
    if assets.skipped_rows:
        dropped.append(f"{assets.skipped_rows} invalid rows skipped")
    if assets.too_long_prompts:
        dropped.append(f"{assets.too_long_prompts} prompts longer than the context window dropped")
    sets = ", ".join(f"{s.config.name} ({len(s.prompts)} prompts)" for s in assets.eval_sets)
    return (f"{len(assets.train)} train and {len(assets.eval)} eval prompts"
            + (f" ({', '.join(dropped)})" if dropped else "") + (f"; eval sets: {sets}" if sets else ""))


def _describe_rewards(config: RunConfig, environment) -> str:
    if environment is not None:
        return environment.describe()
    if config.reward.judge is not None:
        judge = config.reward.judge
        return f"the judge {judge.model} ({judge.parse}) on {judge.engines} SGLang engine(s) of its own"
    if config.reward.url:
        return f"the reward service at {config.reward.url} (reward.function is not used)"
    return f"{config.reward.function} in {config.reward.num_workers} worker process(es)"


def _open_run_dir(config: RunConfig, run_dir: Path, resuming: bool) -> tuple[RunDirLock, MetricsLog]:
    """The run directory locked for this run (before anything is written there), prepared, and its
    metrics log opened (a bad line is refused here, before anything starts)."""
    lock = RunDirLock(run_dir)
    lock.acquire()
    try:
        prepare_run_dir(config, run_dir, resuming)
        return lock, MetricsLog(run_dir / "metrics.jsonl")
    except BaseException:
        lock.release()
        raise


def _answer_events(config: RunConfig, run: Run, events: RunEvents, stack: ExitStack) -> None:
    """What the components report, answered by the run: every process's stacks (rlsys/run/hangs.py)
    on a trainer hang, a silent engine or a failed sync, and on a request through the status API
    (until the processes it reads stop); a restarted engine brought to the trainer's weights."""
    hangs = HangReporter(Path(run.status.run_dir), run.parts, lambda: run.state.next_step, run.status)
    events.follow(hangs, lambda index: bring_engines_up_to_date(config, run.parts, run.trainer_version))
    stack.callback(events.stop_following)  # (the status API's stacks then answer 409)


def _join_ray_cluster(config: RunConfig, layout: Topology, stack: ExitStack) -> None:
    """The run's Ray cluster, left at the end of `stack`: placement.ray_address's, or a local one.
    Standing engines (rollout.attach) live in a cluster that outlives runs: this machine's when no
    address is set."""
    start = time.perf_counter()
    address = cluster_address(config) if config.rollout.attach else config.placement.ray_address
    stack.enter_context(ray_cluster(address, config.placement.num_cpus or layout.local_cpus(), layout.custom_resources()))
    logger.info("Ray cluster up in %.1f s", time.perf_counter() - start)


def _new_run(config: RunConfig, assets: RunAssets, parts: Components, status: RunStatus, log: MetricsLog,
             store: CheckpointStore, evaluator: Evaluator, rewards, trackers: Trackers, maker: SampleMaker) -> Run:
    """The loop's `Run`, at step 0 until `continue_from` restores it."""
    rounds = runner_for(config.rollout.mode).rounds(config, maker)
    return Run(config, assets, parts, CoordinatorState(0, 0, 0, 0), status, log,
               PromptSampler(assets.train, config.data.prompts_per_step, config.seed), evaluator,
               Checkpointer(store, config.checkpoint.interval, config.trainer.total_steps, parts, rounds.saved),
               HealthMonitor(parts), rewards, trackers, rounds)


def run(config: RunConfig) -> Path:
    """Run GRPO to completion (or continue one, with checkpoint.resume: auto)."""
    check_backends_installed(config.logging.backends)
    run_start = time.perf_counter()
    config = resolve_model_paths(config)  # a hub id becomes its snapshot directory, at one commit
    if config.model.hub_id:
        logger.info("model %s at commit %s: %s", config.model.hub_id, config.model.revision, config.model.path)
    assets = load_assets(config)  # every input check happens before any actor starts
    maker = SampleMaker(config, assets.tokenizer, assets.environment)  # loads rollout.generate_function, if any
    random.seed(config.seed)
    config = with_absolute_paths(config, config.run_dir or default_run_dir())
    run_dir = Path(config.run_dir)
    store = CheckpointStore(run_dir, config.checkpoint.keep_last)
    checkpoint = checkpoint_to_resume(store) if config.checkpoint.resume == "auto" else None
    if checkpoint is not None:
        refuse_incompatible_checkpoint(checkpoint, config)
    lock, log = _open_run_dir(config, run_dir, resuming=checkpoint is not None)
    start_resource_tracker(run_dir / "logs" / "resource_tracker.log")  # before the reward pool registers anything
    logger.info("run directory %s", run_dir.resolve())
    logger.info("data: %s", _describe_data(assets))
    if note := repeated_prompts_note(config.data.prompts_per_step, len(assets.train)):
        logger.info("%s", note)
    if checkpoint is not None:
        logger.info("resuming from %s", checkpoint)
    events = RunEvents()  # handed to the components and the status; followed once the run exists
    status = new_status(config, run_dir, assets, resuming=checkpoint is not None, stacks=events.stacks_on_request)
    layout = Topology.from_config(config, has_gpu=False)  # CPU counts do not depend on the GPUs
    with ExitStack() as stack:
        stack.callback(lock.release)
        sweep_shared_memory()  # what runs killed without warning left on this machine
        stack.callback(sweep_shared_memory)  # and, at the end, what a killed engine left of this run
        stack.callback(start_reaper(run_dir).terminate)  # cleans up if this process is killed
        dashboard = stack.enter_context(status_server(config, status))
        trackers = Trackers(config.logging.backends, run_dir, config.model_dump(mode="json"), config.logging.project,
                            config.logging.run_name or run_dir.resolve().name)
        stack.callback(trackers.close)
        _join_ray_cluster(config, layout, stack)
        _stop_on_signals(status)  # after ray.init, which installs a SIGTERM handler of its own
        stack.enter_context(_failures_reported(status))  # entered before the components: reports after they stop
        topology = Topology.from_config(config, run_uses_gpus(config, layout))
        rewards = make_run_scorer(config, assets.environment, topology.has_gpu)
        logger.info("rewards from %s", _describe_rewards(config, assets.environment))
        stack.callback(rewards.close)
        rewards.start()  # its workers load the reward function while the engines start
        parts = start_components(config, topology, run_dir, stack, events, assets.image_load)
        evaluator = Evaluator(config, assets, parts.rollout, rewards.score, maker)
        stack.callback(evaluator.close)  # the reward workers of eval sets with a reward function of their own
        run = _new_run(config, assets, parts, status, log, store, evaluator, rewards, trackers, maker)
        _answer_events(config, run, events, stack)
        sync_start = time.perf_counter()
        run.continue_from(checkpoint)
        logger.info("engines hold the trainer's weights (version %d) after %.1f s", run.state.weight_version,
                    time.perf_counter() - sync_start)
        logger.info("training (started in %.0f s)%s", time.perf_counter() - run_start,
                    f"; dashboard at {dashboard}/" if dashboard else "")
        _train_resuming_dead_trainers(run, store)
        status.set_state("stopped" if status.stop_requested else "finished")
        status.save_snapshot()
    logger.info("%s; metrics in %s", status.state, (run_dir / "metrics.jsonl").resolve())
    return run_dir
