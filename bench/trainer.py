"""Trainer benchmark: packed vs padded tokens/s on one mixed-length batch, 2 ranks vs 1, and
sleep/wake_up cost, for a ~50 M-parameter Qwen2 built locally. Prints one JSON object.

    .venv/bin/python bench/trainer.py [--hidden-size 512 --layers 12 --steps 2]

tokens/s counts real (non-padding) tokens of the batch over the wall time of `train_step`
(old log-probs + forward/backward + optimizer step), median of `--steps` timed steps after one
warm-up step. Every configuration sees exactly the same sequences.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import ray

from rlsys.actors.group import TrainerGroup
from rlsys.actors.trainer import TrainerSpec
from rlsys.config import ModelConfig, TrainerConfig
from rlsys.records import TrainSequence
from rlsys.system.cluster import ACTOR_ENV
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model


def mixed_length_batch(count: int, seed: int) -> list[TrainSequence]:
    """Mostly short sequences and a few long ones, as RL responses are."""
    rng = random.Random(seed)
    batch = []
    for _ in range(count):
        length = rng.choice([24, 32, 48, 64, 96]) if rng.random() < 0.8 else rng.choice([384, 512])
        prompt_len = max(4, length // 4)
        tokens = [rng.randrange(3, 80) for _ in range(length)]
        batch.append(TrainSequence(tokens, prompt_len, advantage=rng.uniform(-1, 1)))
    return batch


def time_train_steps(group: TrainerGroup, batch: list[TrainSequence], steps: int) -> float:
    group.train_step(batch)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        group.train_step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    model_dir = tempfile.mkdtemp(prefix="rlsys-bench-model-")
    spec_model = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                               intermediate_size=args.hidden_size * 9 // 2)
    make_tiny_model(model_dir, spec_model)
    from transformers import AutoConfig, AutoModelForCausalLM

    num_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters())
    batch = mixed_length_batch(args.sequences, seed=0)
    real_tokens = sum(len(s.token_ids) for s in batch)
    longest = max(len(s.token_ids) for s in batch)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ACTOR_ENV})
    results = {"model_parameters": num_params, "sequences": len(batch), "real_tokens": real_tokens,
               "longest_sequence": longest, "configs": {}}
    try:
        configs = {
            "packed_2_ranks": (True, 2),
            "padded_2_ranks": (False, 2),
            "packed_1_rank": (True, 1),
        }
        for name, (packing, ranks) in configs.items():
            spec = TrainerSpec(ModelConfig(path=model_dir), TrainerConfig(
                lr=1e-5, packing=packing, max_tokens_per_microbatch=2048, micro_batch_size=4))
            group = TrainerGroup(spec, ranks)
            try:
                seconds = time_train_steps(group, batch, args.steps)
                entry = {"step_seconds": seconds, "tokens_per_s": real_tokens / seconds}
                if name == "packed_2_ranks":
                    sleeps, wakes, moved = [], [], 0
                    for _ in range(3):
                        report = group.sleep()
                        sleeps.append(report["seconds"])
                        moved = report["bytes"]
                        wakes.append(group.wake_up()["seconds"])
                    entry.update(sleep_seconds=statistics.median(sleeps), wake_up_seconds=statistics.median(wakes),
                                 offloaded_bytes=moved)
                results["configs"][name] = entry
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    configs = results["configs"]
    results["packed_over_padded"] = configs["packed_2_ranks"]["tokens_per_s"] / configs["padded_2_ranks"]["tokens_per_s"]
    results["two_ranks_over_one"] = configs["packed_2_ranks"]["tokens_per_s"] / configs["packed_1_rank"]["tokens_per_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
