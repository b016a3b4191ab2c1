"""The GRPO loop: rollout -> reward -> advantages -> train -> sync -> (periodic) eval.

`run(config)` is the whole life of a run; every line of `_train_loop` is one component call.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ray.exceptions import RayError

from actors.group import TrainerGroup
from actors.placement import Placement, create_placement
from actors.trainer import TrainerSpec
from rlsys.assets import EncodedPrompt, RunAssets, load_assets
from rlsys.checkpointing import (
    CheckpointStore,
    CoordinatorState,
    python_random_state,
    restore_python_random_state,
)
from rlsys.cluster import ACTOR_ENV, ray_cluster
from rlsys.config import RunConfig, dump_config
from rlsys.data import PromptSampler
from rlsys.metrics import MetricsLog
from rlsys.samples import assign_advantages, response_text, score_groups, to_train_sequences
from rlsys.status.reporting import collect_actor_health, new_status, status_server
from rlsys.status.state import RunStatus
from rlsys.verify import verify_engine_weights
from rollout.engine import SamplingParams
from rollout.manager import RolloutManager
from rollout.server import ServerSpec
from weight_sync.backend import detect_backend

HEALTH_INTERVAL_S = 5.0  # actor and engine health is refreshed at most this often


class RunFailed(RuntimeError):
    """The run stopped on bad input or a broken component; the message says which."""


def prepare_run_dir(config: RunConfig, run_dir: Path, resuming: bool) -> None:
    if not resuming and (run_dir / "metrics.jsonl").exists():
        raise RunFailed(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and no checkpoint to resume; "
            "choose another run_dir, or pass --resume to continue a checkpointed run"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config.model_copy(update={"run_dir": str(run_dir)}), run_dir / "config.yaml")


def trainer_spec(config: RunConfig) -> TrainerSpec:
    t, a = config.trainer, config.algorithm
    return TrainerSpec(
        model_path=config.model.path, dtype=config.model.dtype, lr=t.lr,
        weight_decay=t.weight_decay, betas=tuple(t.betas), grad_clip=t.grad_clip,
        packing=t.packing, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        micro_batch_size=t.micro_batch_size, mini_batches_per_step=t.mini_batches_per_step,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio,
        total_optimizer_steps=t.total_steps * t.mini_batches_per_step,
        gradient_checkpointing=t.gradient_checkpointing,
        threads_per_rank=t.threads_per_rank, temperature=config.rollout.temperature,
        clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, use_kl_loss=a.use_kl_loss,
        kl_in_reward=a.kl_in_reward,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, seed=config.seed,
    )


def server_spec(config: RunConfig) -> ServerSpec:
    e = config.rollout.engine
    return ServerSpec(
        model_path=config.model.path, dtype=config.model.dtype, tp_size=e.tp_size,
        mem_fraction_static=e.mem_fraction_static, max_total_tokens=e.max_total_tokens,
        context_length=e.context_length, skip_tokenizer_init=e.skip_tokenizer_init,
        random_seed=config.seed, weight_load_threads=e.weight_load_threads, extra_args=list(e.extra_args),
    )


@dataclass
class Components:
    placement: Placement
    rollout: RolloutManager
    trainer: TrainerGroup

    def shutdown(self) -> None:
        # Engines first: their servers hold shared-memory handles from the trainers.
        self.rollout.shutdown()
        self.trainer.shutdown()
        self.placement.remove()


def start_components(config: RunConfig, run_dir: Path) -> Components:
    backend = detect_backend()
    placement = create_placement(config.placement.mode, config.trainer.num_ranks, config.rollout.num_engines,
                                 config.rollout.engine.tp_size, backend.has_gpu)
    rollout = RolloutManager(
        server_spec(config), config.rollout.num_engines, str(run_dir / "logs"),
        [placement.engine_options(i) for i in range(config.rollout.num_engines)],
        config.rollout.engine.startup_timeout_s, config.rollout.engine.request_timeout_s,
    )
    try:
        trainer = TrainerGroup(
            trainer_spec(config), config.trainer.num_ranks,
            [placement.trainer_options(i) for i in range(config.trainer.num_ranks)], env_vars=ACTOR_ENV,
        )
    except Exception:
        rollout.shutdown()
        placement.remove()
        raise
    parts = Components(placement, rollout, trainer)
    try:
        rollout.wait_ready()
        if config.placement.mode == "disaggregated":
            trainer.connect_broadcast(rollout.urls, rollout.tp_size, config.weight_sync.timeout_s)
    except BaseException:
        parts.shutdown()
        raise
    return parts


def push_weights(config: RunConfig, parts: Components, weight_version: int) -> None:
    """Trainer -> engines, by IPC handle (colocated) or broadcast (disaggregated); then, with
    weight_sync.verify, check that every engine computes what the trainer computes."""
    bucket_bytes = int(config.weight_sync.bucket_size_mb * 2**20)
    if config.placement.mode == "colocated":
        parts.trainer.sync_weights(parts.rollout.urls, parts.rollout.tp_size, bucket_bytes, weight_version)
    else:
        parts.trainer.sync_weights_broadcast(bucket_bytes, weight_version)
    if config.weight_sync.verify:
        tolerance = config.weight_sync.verify_tolerance or (1e-3 if config.model.dtype == "float32" else 5e-2)
        verify_engine_weights(parts.trainer, parts.rollout, weight_version, tolerance, config.seed)


def evaluate(config: RunConfig, assets: RunAssets, rollout: RolloutManager) -> float:
    prompts = assets.eval[: config.eval.max_prompts] if config.eval.max_prompts else assets.eval
    sampling = _sampling(config, assets, config.eval.temperature, 1.0)
    generations = rollout.generate([p.token_ids for p in prompts], sampling, n=1)
    rewards = []
    for prompt, generation in zip(prompts, generations, strict=False):
        text = response_text(assets.tokenizer, generation.response_ids)
        try:
            rewards.append(assets.reward_fn(prompt.record.prompt, text, prompt.record.label, prompt.record.metadata))
        except Exception:  # noqa: BLE001 - an eval sample whose reward raises scores 0
            rewards.append(0.0)
    return sum(rewards) / max(len(rewards), 1)


def _sampling(config: RunConfig, assets: RunAssets, temperature: float, top_p: float) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=config.rollout.max_new_tokens,
        # Without its tokenizer the engine stops on token ids only (assets.stop_token_ids).
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=assets.stop_token_ids,
    )


def _check_reward_errors(config: RunConfig, scored, num_generations: int, step: int) -> None:
    if scored.reward_errors > config.reward.max_error_fraction * num_generations:
        raise RunFailed(
            f"step {step}: {scored.reward_errors} of {num_generations} rewards raised "
            f"(reward.max_error_fraction={config.reward.max_error_fraction}); first error:\n"
            f"{scored.first_error}"
        )


def _fold_kl_into_rewards(config: RunConfig, trainer: TrainerGroup, samples: list) -> float:
    """reward -= kl_coef * sum_t KL_t(policy || reference); returns the mean penalty."""
    kls = trainer.compute_sequence_kl(to_train_sequences(samples))
    for sample, kl in zip(samples, kls, strict=True):
        sample.reward -= config.algorithm.kl_coef * kl
    return config.algorithm.kl_coef * sum(kls) / max(len(kls), 1)


@contextmanager
def _timed(row: dict, phase: str):
    """Adds the block's seconds to row["time_<phase>_s"]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        row[f"time_{phase}_s"] = row.get(f"time_{phase}_s", 0.0) + time.perf_counter() - start


def _save_checkpoint(store: CheckpointStore, parts: Components, state: CoordinatorState) -> None:
    state.python_random_state = python_random_state()
    store.save(state.next_step, parts.trainer.save_checkpoint, state)


def _wait_while_paused(status: RunStatus) -> None:
    if status.pause_requested and not status.stop_requested:
        status.set_state("paused")
        status.save_snapshot()
        while status.pause_requested and not status.stop_requested:
            time.sleep(0.2)


def _train_loop(config: RunConfig, assets: RunAssets, parts: Components, log: MetricsLog,
                store: CheckpointStore, state: CoordinatorState, status: RunStatus) -> None:
    from tqdm import tqdm

    group_size = config.rollout.n_samples_per_prompt
    sampling = _sampling(config, assets, config.rollout.temperature, config.rollout.top_p)
    sampler = PromptSampler(assets.train, config.data.prompts_per_step, config.seed)
    sampler.restore(state.data_epoch, state.data_index)
    # Only colocated trainers give their device memory to the engines between steps.
    offload = config.trainer.offload_between_steps and config.placement.mode == "colocated"
    total = config.trainer.total_steps
    last_health, last_eval = time.monotonic(), None
    bar = tqdm(range(state.next_step, total), initial=state.next_step, total=total, desc="GRPO",
               disable=not config.logging.progress_bar, dynamic_ncols=True)
    for step in bar:
        _wait_while_paused(status)
        if status.stop_requested:
            break
        row: dict = {"step": step, "data_epoch": sampler.epoch, "data_index": sampler.index}
        step_start = time.perf_counter()

        if assets.eval and (step % config.eval.interval == 0 or step == total - 1):
            status.set_state("evaluating")
            with _timed(row, "eval"):
                row["eval_reward_mean"] = evaluate(config, assets, parts.rollout)

        prompts: list[EncodedPrompt] = sampler.next_batch()
        status.set_state("rollout")
        with _timed(row, "generate"):
            generations = parts.rollout.generate([p.token_ids for p in prompts], sampling, group_size)
        scored = score_groups([p.record for p in prompts], generations, group_size,
                              assets.tokenizer, assets.reward_fn)
        _check_reward_errors(config, scored, len(generations), step)
        rewards = [s.reward for s in scored.samples]  # task rewards, before any KL penalty

        status.set_state("training")
        if offload:
            with _timed(row, "offload"):
                row["offload_bytes"] = parts.trainer.wake_up()["bytes"]
        if config.algorithm.kl_in_reward:
            with _timed(row, "train"):
                row["kl_reward_penalty"] = _fold_kl_into_rewards(config, parts.trainer, scored.samples)
        assign_advantages(scored.samples, group_size, config.algorithm.normalize_adv_by_std)
        with _timed(row, "train"):
            train_metrics = parts.trainer.train_step(to_train_sequences(scored.samples))
        status.set_state("syncing")
        with _timed(row, "sync"):
            push_weights(config, parts, state.weight_version + 1)
        state.weight_version += 1
        state.next_step, state.data_epoch, state.data_index = step + 1, sampler.epoch, sampler.index
        interval = config.checkpoint.interval
        due = interval and ((step + 1) % interval == 0 or step + 1 == total)
        if due or status.take_checkpoint_request() or (interval and status.stop_requested):
            status.set_state("checkpointing")
            with _timed(row, "checkpoint"):
                _save_checkpoint(store, parts, state)
        if offload:
            with _timed(row, "offload"):
                parts.trainer.sleep()
        row["time_step_s"] = time.perf_counter() - step_start

        mean = sum(rewards) / max(len(rewards), 1)
        tokens = sum(len(g.prompt_ids) + len(g.response_ids) for g in generations)
        row.update(
            reward_mean=mean,
            reward_std=(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1)) ** 0.5,
            response_len_mean=sum(len(g.response_ids) for g in generations) / max(len(generations), 1),
            weight_version=generations[0].weight_version if generations else None,
            synced_weight_version=state.weight_version,
            tokens_per_s=tokens / row["time_step_s"],
            reward_errors=scored.reward_errors,
            dropped_groups=scored.dropped_groups,
            **train_metrics,
        )
        log.append(row)
        status.record_step(row)
        if time.monotonic() - last_health >= HEALTH_INTERVAL_S or step + 1 == total:
            status.set_actors(collect_actor_health(parts.trainer, parts.rollout))
            last_health = time.monotonic()
        status.save_snapshot()
        last_eval = row.get("eval_reward_mean", last_eval)
        bar.set_postfix(reward=f"{mean:.2f}", eval=f"{last_eval:.2f}" if last_eval is not None else "-")


def resume_point(config: RunConfig, store: CheckpointStore) -> Path | None:
    if config.checkpoint.resume != "auto":
        return None
    return store.latest()


def restore(parts: Components, config: RunConfig, checkpoint: Path | None) -> CoordinatorState:
    """Load the trainer from `checkpoint` and bring the engines to the same weights and version."""
    if checkpoint is None:
        return CoordinatorState(next_step=0, weight_version=0, data_epoch=0, data_index=0)
    state = CheckpointStore.load_state(checkpoint)
    parts.trainer.load_checkpoint(str(checkpoint))
    push_weights(config, parts, state.weight_version)
    restore_python_random_state(state.python_random_state)
    return state


def _first_lines(text: str, count: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:count] + (["..."] if len(lines) > count else []))


def _exit_cleanly_on_sigterm() -> None:
    # A killed job (ray job stop, timeout, kill) still stops its engines and trainers.
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def run(config: RunConfig) -> Path:
    """Run GRPO to completion (or continue one, with checkpoint.resume: auto)."""
    assets = load_assets(config)  # every input check happens before any actor starts
    random.seed(config.seed)
    run_dir = Path(config.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    store = CheckpointStore(run_dir, config.checkpoint.keep_last)
    checkpoint = resume_point(config, store)
    prepare_run_dir(config, run_dir, resuming=checkpoint is not None)
    print(f"rlsys: run directory {run_dir.resolve()}", flush=True)
    if checkpoint is not None:
        print(f"rlsys: resuming from {checkpoint}", flush=True)
    log = MetricsLog(run_dir / "metrics.jsonl")
    status = new_status(config, run_dir)
    # Logical CPUs for a local cluster: one per actor (plus the colocated pairs' second slot) and a spare.
    actors = config.trainer.num_ranks + (
        config.trainer.num_ranks if config.placement.mode == "colocated" else config.rollout.num_engines)
    with status_server(config, status), \
            ray_cluster(config.placement.ray_address, config.placement.num_cpus or actors + 1):
        _exit_cleanly_on_sigterm()  # after ray.init, which installs a SIGTERM handler of its own
        try:
            parts = start_components(config, run_dir)
            try:
                state = restore(parts, config, checkpoint)
                log.truncate_from(state.next_step)  # rows of steps that will run again
                for row in log.rows:
                    status.record_step(row)
                status.set_actors(collect_actor_health(parts.trainer, parts.rollout))
                if config.trainer.offload_between_steps and config.placement.mode == "colocated":
                    parts.trainer.sleep()
                _train_loop(config, assets, parts, log, store, state, status)
            finally:
                parts.shutdown()
        except RayError as error:
            # A trainer rank or engine died or raised: say which, keep the cause for the log.
            cause = getattr(error, "cause", None) or error  # the remote exception, without Ray's wrapping
            message = f"{type(cause).__name__}: {_first_lines(str(cause), 40)}"
            status.fail(message)
            status.save_snapshot()
            raise RunFailed(f"a trainer rank or rollout engine failed: {message}") from error
        except BaseException as error:
            status.fail(f"{type(error).__name__}: {error}")
            status.save_snapshot()
            raise
        status.set_state("stopped" if status.stop_requested else "finished")
        status.save_snapshot()
    print(f"rlsys: {status.state}; metrics in {(run_dir / 'metrics.jsonl').resolve()}", flush=True)
    return run_dir
