"""A whole run's batches, replayed through TRL's GRPOTrainer update and rlsys's, side by side.

    .venv/bin/python bench/replay.py ROLLOUTS_DIR MODEL_DIR [--lr 2e-4] [--grad-clip 1.0] [--steps N] [--out FILE]

ROLLOUTS_DIR holds one step_NNNNNN.jsonl per step: an rlsys run's (logging.save_rollouts) or TRL's
(bench/trl_grpo.py with `save_rollouts`). Both sides start from MODEL_DIR's weights and, step after
step, train on the same recorded batch: its prompt and response token ids and rewards. Nothing is
sampled; what differs is only the update path: advantages, which tokens carry loss, the loss and
its normalisation, clipping, the optimizer and its schedule.

- TRL runs its own training loop (`Trainer.train`: its loss, `clip_grad_norm_`, AdamW, the
  scheduler), with `_generate` serving the recorded completions and the reward function the
  recorded rewards: everything from the completions on is TRL's own code (`_generate_and_score_completions`).
- rlsys runs a real `TrainerWorker.train_step` in this process (one rank, fp32), on TrainSequences
  built as rlsys/algorithms/samples.py builds them, with advantages from rlsys's estimator.

With `--resync`, each rlsys step starts from TRL's parameters and AdamW state, so every step's
update is compared on its own; without it each side runs free, as two runs would, and rounding
differences accumulate (through steps where the policy changes fast, they grow exponentially:
two free runs of one code in different summation orders part the same way).

Per step (a TRL callback runs rlsys's step on the same batch right after TRL's): each side's loss,
gradient norm before clipping (what `clip_grad_norm_` returns) and after it, learning rate, Adam
step count, and the parameters: ||theta_rlsys - theta_trl|| relative to ||theta_trl - theta_0||
(how far the run has moved) and the largest element difference, and AdamW's two moments, relative.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for _, p in sorted(model.named_parameters())])


class _GradientNorms:
    """The norm of the gradient each optimizer step applies (after any clipping)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.norms: list[float] = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.norms.append(math.sqrt(sum(
            float((p.grad.double() ** 2).sum()) for group in opt.param_groups for p in group["params"]
            if p.grad is not None))))


def _adam_moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's first and second moments of every parameter, flattened in name order."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
    states = [optimizer.state.get(p, {}) for _, p in sorted(model.named_parameters())]
    return tuple(torch.cat([s[key].reshape(-1).double() if key in s else torch.zeros(p.numel(), dtype=torch.double)
                            for s, (_, p) in zip(states, sorted(model.named_parameters()), strict=True)])
                 for key in ("exp_avg", "exp_avg_sq"))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _adam_steps(optimizer: torch.optim.Optimizer) -> int:
    states = [s for s in optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


def rlsys_worker(model_dir: str, lr: float, grad_clip: float, steps: int):
    from rlsys.actors.trainer import TrainerWorker
    from tests.helpers import trainer_spec

    spec = trainer_spec(model_dir, lr=lr, grad_clip=grad_clip, mini_batches_per_step=1, total_steps=steps,
                        betas=(0.9, 0.999), weight_decay=0.0, policy_loss="grpo", loss_agg_mode="token-mean",
                        clip_eps_low=0.2, clip_eps_high=0.2)
    worker = TrainerWorker(spec, 0, 1)
    worker.setup(*worker.rendezvous_address())
    return spec, worker


def rlsys_sequences(rows: list[dict], group_size: int, advantage_eps: float | None):
    """The step's TrainSequences as rlsys makes them from the samples: rlsys's group advantages of
    the recorded rewards (its own epsilon unless `advantage_eps`), every response token in the loss."""
    from rlsys.algorithms.advantages import group_advantages
    from rlsys.records import TrainSequence

    scores = torch.tensor([float(r["reward"]) for r in rows])
    kwargs = {} if advantage_eps is None else {"eps": advantage_eps}
    advantages = group_advantages(scores, group_size, "group", **kwargs).tolist()
    return [TrainSequence(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]), advantage=a,
                          engine_logprobs=r.get("engine_logprobs") or [0.0] * len(r["response_ids"]))
            for r, a in zip(rows, advantages, strict=True)], advantages


def _copy_training_state(source: torch.nn.Module, source_optimizer, target: torch.nn.Module, target_optimizer) -> None:
    """The target model's parameters and AdamW state set to the source's (by parameter name)."""
    source_optimizer = getattr(source_optimizer, "optimizer", source_optimizer)
    targets = dict(target.named_parameters())
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            targets[name].copy_(parameter)
            state = source_optimizer.state.get(parameter)
            if state:
                target_optimizer.state[targets[name]] = {key: value.clone() for key, value in state.items()}


def replay(steps_rows: list[list[dict]], model_dir: str, lr: float, grad_clip: float, group_size: int,
           advantage_eps: float | None, resync: bool = False) -> dict:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlsys.actors.group import global_mini_batches

    steps = len(steps_rows)
    batch = len(steps_rows[0])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    served = {"step": 0}

    class ReplayedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            rows = steps_rows[served["step"]]
            prompt_ids = [r["prompt_ids"] for r in rows]
            completion_ids = [r["response_ids"] for r in rows]
            texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
            return prompt_ids, completion_ids, None, texts, None, {}, None, None

    def recorded_rewards(prompts, completions, **_):
        return [float(r["reward"]) for r in steps_rows[served["step"]]]

    environment, threads = dict(os.environ), torch.get_num_threads()  # the rank sets both for its process
    spec, worker = rlsys_worker(model_dir, lr, grad_clip, steps)
    rlsys_norms = _GradientNorms(worker.optimizer)
    rows_out: list[dict] = []
    first_apart: dict = {}

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            num_generations=group_size, max_completion_length=max(len(r["response_ids"]) for s in steps_rows for r in s),
            temperature=1.0, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=grad_clip, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=0.0,
            loss_type="dapo", epsilon=0.2, num_iterations=1, use_cpu=True, bf16=False, seed=0, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )

        class Lockstep(TrainerCallback):
            """After each TRL step: rlsys's step on the same batch, and the two compared."""

            def on_train_begin(self, args, state, control, **kwargs):
                self.initial = _flat(trainer.model)
                assert torch.equal(self.initial, _flat(worker.model)), "the two sides start from different weights"
                # Accelerate wraps the optimizer; the hook goes on the torch optimizer that steps
                self.trl_norms = _GradientNorms(getattr(trainer.optimizer, "optimizer", trainer.optimizer))

            def on_log(self, args, state, control, logs=None, **kwargs):
                # The Trainer logs a step (its loss, the norm clip_grad_norm_ returned) after on_step_end
                if logs and "grad_norm" in logs and rows_out:
                    rows_out[-1].update(trl_loss=logs.get("loss"), trl_grad_norm=float(logs["grad_norm"]))

            def on_step_begin(self, args, state, control, **kwargs):
                self.trl_before = _flat(trainer.model)

            def on_step_end(self, args, state, control, **kwargs):
                step = served["step"]
                sequences, advantages = rlsys_sequences(steps_rows[step], group_size, advantage_eps)
                rlsys_before = _flat(worker.model)
                metrics = worker.train_step(global_mini_batches(sequences, spec))
                self.compare(step, metrics, advantages, rlsys_before)
                if resync:
                    _copy_training_state(trainer.model, trainer.optimizer, worker.model, worker.optimizer)
                served["step"] += 1

            def compare(self, step: int, metrics: dict, advantages: list[float], rlsys_before: torch.Tensor) -> None:
                trl_params, rlsys_params = _flat(trainer.model), _flat(worker.model)
                trl_update, rlsys_update = trl_params - self.trl_before, rlsys_params - rlsys_before
                moved = float((trl_params - self.initial).norm())
                apart = float((rlsys_params - trl_params).norm())
                rows = steps_rows[step]
                row = {
                    "step": step, "reward_mean": sum(r["reward"] for r in rows) / len(rows),
                    "response_len_mean": sum(len(r["response_ids"]) for r in rows) / len(rows),
                    "trl_loss": None, "rlsys_loss": metrics.get("loss"),
                    "trl_grad_norm": None, "rlsys_grad_norm": metrics.get("grad_norm"),
                    "trl_applied_grad_norm": self.trl_norms.norms[-1] if self.trl_norms.norms else None,
                    "rlsys_applied_grad_norm": rlsys_norms.norms[-1] if rlsys_norms.norms else None,
                    "trl_lr": trainer.optimizer.param_groups[0]["lr"], "rlsys_lr": worker.optimizer.param_groups[0]["lr"],
                    "trl_adam_steps": _adam_steps(trainer.optimizer), "rlsys_adam_steps": _adam_steps(worker.optimizer),
                    "params_moved": moved, "params_apart": apart, "params_apart_relative": apart / max(moved, 1e-30),
                    "params_max_abs_diff": float((rlsys_params - trl_params).abs().max()),
                    # this step's own update (each side from where it stood), rlsys's against TRL's
                    "update_apart_relative": _relative(rlsys_update, trl_update) if trl_update.any() else 0.0,
                    **dict(zip(("exp_avg_apart_relative", "exp_avg_sq_apart_relative"),
                               (_relative(mine, theirs) for mine, theirs in zip(
                                   _adam_moments(worker.model, worker.optimizer),
                                   _adam_moments(trainer.model, trainer.optimizer), strict=True)), strict=True)),
                    "advantage_abs_mean": sum(abs(a) for a in advantages) / len(advantages),
                }
                rows_out.append(row)
                if not first_apart and row["params_apart_relative"] > 1e-3:
                    first_apart.update(row)

        trainer = ReplayedGRPOTrainer(
            model=model_dir, reward_funcs=recorded_rewards, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * batch), callbacks=[Lockstep()],
        )
        trainer.remove_callback(PrinterCallback)  # a dict printed per step
        try:
            trainer.train()
        finally:
            worker.shutdown()
            os.environ.clear()
            os.environ.update(environment)
            torch.set_num_threads(threads)
    return {"steps": steps, "batch": batch, "group_size": group_size, "lr": lr, "grad_clip": grad_clip,
            "advantage_eps": advantage_eps, "resync": resync, "first_step_apart_1e-3": first_apart or None,
            "worst_params_apart_relative": max(r["params_apart_relative"] for r in rows_out),
            "worst_update_apart_relative": max(r["update_apart_relative"] for r in rows_out),
            "final": rows_out[-1], "per_step": rows_out}


def main() -> None:
    from rlsys.observability.rollouts import read_rollouts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rollouts", help="a directory of step_NNNNNN.jsonl (rlsys: RUN_DIR/rollouts)")
    parser.add_argument("model", help="the model directory both runs started from")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, help="replay only the first N steps")
    parser.add_argument("--advantage-eps", type=float, default=None,
                        help="rlsys's group-std epsilon (default: rlsys's own, 1e-6; TRL's is 1e-4)")
    parser.add_argument("--resync", action="store_true",
                        help="start every rlsys step from TRL's parameters and AdamW state: each step's update "
                             "compared alone, without the run's accumulated (and, where learning is fast, "
                             "exponentially amplified) rounding")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    try:
        steps_rows = read_rollouts(Path(args.rollouts))[: args.steps]
    except FileNotFoundError as error:
        raise SystemExit(f"replay: {error}") from None
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"replay: {args.model} is not a model directory (no config.json): "
                         "pass the model the run started from")
    result = replay(steps_rows, args.model, args.lr, args.grad_clip, args.group_size, args.advantage_eps, args.resync)
    text = json.dumps(result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_step"}, indent=1))
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
