"""The GRPO loop: rollout -> reward -> advantages -> train -> sync -> (periodic) eval.

`run(config)` is the whole life of a run; every line of `_train_loop` is one component call.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from actors.group import TrainerGroup
from actors.placement import ColocatedPlacement, create_colocated_placement
from actors.trainer import TrainerSpec
from rlsys.assets import EncodedPrompt, RunAssets, load_assets
from rlsys.cluster import ACTOR_ENV, ray_cluster
from rlsys.config import RunConfig, dump_config
from rlsys.data import PromptSampler
from rlsys.metrics import MetricsLog
from rlsys.samples import assign_advantages, response_text, score_groups, to_train_sequences
from rollout.engine import SamplingParams
from rollout.manager import RolloutManager
from rollout.server import ServerSpec
from weight_sync.backend import detect_backend


class RunFailed(RuntimeError):
    """The run stopped on bad input or a broken component; the message says which."""


def prepare_run_dir(config: RunConfig) -> Path:
    run_dir = Path(config.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    if (run_dir / "metrics.jsonl").exists():
        raise RunFailed(f"run directory {run_dir} already holds a run (metrics.jsonl); choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config.model_copy(update={"run_dir": str(run_dir)}), run_dir / "config.yaml")
    return run_dir


def trainer_spec(config: RunConfig) -> TrainerSpec:
    t, a = config.trainer, config.algorithm
    return TrainerSpec(
        model_path=config.model.path, dtype=config.model.dtype, lr=t.lr,
        weight_decay=t.weight_decay, betas=tuple(t.betas), grad_clip=t.grad_clip,
        micro_batch_size=t.micro_batch_size, mini_batches_per_step=t.mini_batches_per_step,
        threads_per_rank=t.threads_per_rank, temperature=config.rollout.temperature,
        clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, use_kl_loss=a.use_kl_loss,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, seed=config.seed,
    )


def server_spec(config: RunConfig) -> ServerSpec:
    e = config.rollout.engine
    return ServerSpec(
        model_path=config.model.path, dtype=config.model.dtype, tp_size=e.tp_size,
        mem_fraction_static=e.mem_fraction_static, max_total_tokens=e.max_total_tokens,
        context_length=e.context_length, skip_tokenizer_init=e.skip_tokenizer_init,
        random_seed=config.seed, extra_args=list(e.extra_args),
    )


@dataclass
class Components:
    placement: ColocatedPlacement
    rollout: RolloutManager
    trainer: TrainerGroup

    def shutdown(self) -> None:
        # Engines first: their servers hold shared-memory handles from the trainers.
        self.rollout.shutdown()
        self.trainer.shutdown()
        self.placement.remove()


def start_components(config: RunConfig, run_dir: Path) -> Components:
    backend = detect_backend()
    placement = create_colocated_placement(config.trainer.num_ranks, backend.has_gpu)
    rollout = RolloutManager(
        server_spec(config), config.rollout.num_engines, str(run_dir / "logs"),
        [placement.options(i) for i in range(config.rollout.num_engines)],
        config.rollout.engine.startup_timeout_s, config.rollout.engine.request_timeout_s,
    )
    try:
        trainer = TrainerGroup(
            trainer_spec(config), config.trainer.num_ranks,
            [placement.options(i) for i in range(config.trainer.num_ranks)], env_vars=ACTOR_ENV,
        )
    except Exception:
        rollout.shutdown()
        placement.remove()
        raise
    try:
        rollout.wait_ready()
    except Exception:
        Components(placement, rollout, trainer).shutdown()
        raise
    return Components(placement, rollout, trainer)


def evaluate(config: RunConfig, assets: RunAssets, rollout: RolloutManager) -> float:
    prompts = assets.eval[: config.eval.max_prompts] if config.eval.max_prompts else assets.eval
    sampling = SamplingParams(
        temperature=config.eval.temperature, top_p=1.0, max_new_tokens=config.rollout.max_new_tokens,
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=assets.stop_token_ids,
    )
    generations = rollout.generate([p.token_ids for p in prompts], sampling, n=1)
    rewards = []
    for prompt, generation in zip(prompts, generations, strict=False):
        text = response_text(assets.tokenizer, generation.response_ids)
        try:
            rewards.append(assets.reward_fn(prompt.record.prompt, text, prompt.record.label, prompt.record.metadata))
        except Exception:  # noqa: BLE001 - an eval sample whose reward raises scores 0
            rewards.append(0.0)
    return sum(rewards) / max(len(rewards), 1)


def _train_loop(config: RunConfig, assets: RunAssets, parts: Components, log: MetricsLog) -> None:
    from tqdm import tqdm

    group_size = config.rollout.n_samples_per_prompt
    sampling = SamplingParams(
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        max_new_tokens=config.rollout.max_new_tokens,
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=assets.stop_token_ids,
    )
    sampler = PromptSampler(assets.train, config.data.prompts_per_step, config.seed)
    total = config.trainer.total_steps
    weight_version = 0
    bar = tqdm(range(total), desc="GRPO", disable=not config.logging.progress_bar, dynamic_ncols=True)
    for step in bar:
        row: dict = {"step": step}
        step_start = time.perf_counter()

        if assets.eval and (step % config.eval.interval == 0 or step == total - 1):
            tick = time.perf_counter()
            row["eval_reward_mean"] = evaluate(config, assets, parts.rollout)
            row["time_eval_s"] = time.perf_counter() - tick

        prompts: list[EncodedPrompt] = sampler.next_batch()
        tick = time.perf_counter()
        generations = parts.rollout.generate([p.token_ids for p in prompts], sampling, group_size)
        row["time_generate_s"] = time.perf_counter() - tick

        scored = score_groups([p.record for p in prompts], generations, group_size,
                              assets.tokenizer, assets.reward_fn)
        if scored.reward_errors > config.reward.max_error_fraction * len(generations):
            raise RunFailed(
                f"step {step}: {scored.reward_errors} of {len(generations)} rewards raised "
                f"(reward.max_error_fraction={config.reward.max_error_fraction}); first error:\n"
                f"{scored.first_error}"
            )
        assign_advantages(scored.samples, group_size, config.algorithm.normalize_adv_by_std)

        tick = time.perf_counter()
        train_metrics = parts.trainer.train_step(to_train_sequences(scored.samples))
        row["time_train_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        parts.trainer.sync_weights(
            parts.rollout.urls, parts.rollout.tp_size,
            int(config.weight_sync.bucket_size_mb * 2**20), weight_version + 1,
        )
        weight_version += 1
        row["time_sync_s"] = time.perf_counter() - tick
        row["time_step_s"] = time.perf_counter() - step_start

        rewards = [s.reward for s in scored.samples]
        mean = sum(rewards) / max(len(rewards), 1)
        tokens = sum(len(g.prompt_ids) + len(g.response_ids) for g in generations)
        row.update(
            reward_mean=mean,
            reward_std=(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1)) ** 0.5,
            response_len_mean=sum(len(g.response_ids) for g in generations) / max(len(generations), 1),
            weight_version=generations[0].weight_version if generations else None,
            synced_weight_version=weight_version,
            tokens_per_s=tokens / row["time_step_s"],
            reward_errors=scored.reward_errors,
            dropped_groups=scored.dropped_groups,
            **train_metrics,
        )
        log.append(row)
        bar.set_postfix(reward=f"{mean:.2f}", eval=f"{row.get('eval_reward_mean', float('nan')):.2f}")


def _exit_cleanly_on_sigterm() -> None:
    # A killed job (ray job stop, timeout, kill) still stops its engines and trainers.
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def run(config: RunConfig) -> Path:
    """Run GRPO to completion; returns the run directory."""
    assets = load_assets(config)  # every input check happens before any actor starts
    random.seed(config.seed)
    run_dir = prepare_run_dir(config)
    print(f"rlsys: run directory {run_dir.resolve()}", flush=True)
    log = MetricsLog(run_dir / "metrics.jsonl")
    bundles = config.trainer.num_ranks
    with ray_cluster(config.placement.ray_address, config.placement.num_cpus or 2 * bundles + 1):
        _exit_cleanly_on_sigterm()  # after ray.init, which installs a SIGTERM handler of its own
        parts = start_components(config, run_dir)
        try:
            _train_loop(config, assets, parts, log)
        finally:
            parts.shutdown()
    print(f"rlsys: finished; metrics in {(run_dir / 'metrics.jsonl').resolve()}", flush=True)
    return run_dir
