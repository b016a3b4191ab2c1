"""LoRA RL (model.lora, actors/lora.py): adapters train under FSDP2 on 2 ranks while the base stays
bit-for-bit what the checkpoint holds; the reference is the base (adapters off); the engines get
merged weights W + scale * B A through both transports and serve what the trainer computes.

The engine bound is tests/e2e/test_weight_sync.py's (fp32 on both sides, different kernels)."""

import hashlib

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from rlsys.run.verify import verify_engine_weights
from rlsys.system.topology import Topology
from tests.helpers import random_sequences, standing_rollout, trainer_spec

FIXED = [[5, 9, 14, 3, 7, 7, 20, 31], [40, 41, 42, 6, 6, 6], [12, 65, 13, 65, 14, 73, 15, 1]]
BOUND = 1e-3
LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
# The quickstart under LoRA, on a tiny model whose output layer can spread its logits (init std 0.1,
# docs/operations.md "LoRA"): adapters start at B = 0 and are few, so they take a larger lr than the
# full model's 5e-4. Without an entropy bonus some seeds collapse the policy onto a few digits within
# ~10 steps and stay on a plateau (greedy eval 0.06) for 40-55 steps, one of them past 100 (a CI run);
# entropy_coef 0.01 brought both such seeds re-run to >= 0.39 by step 40 (docs/operations.md "LoRA").
RUN_LORA = {"rank": 8, "alpha": 16}
RUN_SETTINGS = ("trainer.lr=0.005", "algorithm.entropy_coef=0.01", "trainer.total_steps=100", "eval.interval=10",
                "checkpoint.interval=50")


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def _checksums(state: dict) -> dict[str, str]:
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for name, t in state.items()}


def test_adapters_train_the_base_stays_and_the_engine_serves_the_merged_weights(tiny_model_dir, quickstart_engines,
                                                                                 tmp_path):
    trainer = InspectableTrainerGroup(trainer_spec(tiny_model_dir, lr=3e-2, use_kl_loss=True, kl_coef=0.1, lora=LORA),
                           num_ranks=2)
    fixed = [TrainSequence(tokens, prompt_len=1) for tokens in FIXED]
    # the session's engine, as the model holds it
    try:
        with standing_rollout("quickstart", tmp_path / "logs") as rollout:
            before = trainer.full_state_dict()
            base = {name: t for name, t in before.items() if ".lora_" not in name}
            adapters = [name for name in before if ".lora_" in name]
            assert len(adapters) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
            assert all(not before[name].any() for name in adapters if ".lora_B." in name)  # the policy starts as the base
            served = rollout.fleet.score(FIXED, engine_index=0)  # the engine serves the checkpoint: the base
            assert _gap(served, trainer.compute_log_probs(fixed)) < BOUND

            for version, mode in enumerate(("colocated", "disaggregated"), start=1):
                metrics = trainer.train_step(random_sequences(version, count=16, vocab=80))
                assert metrics["kl"] > 0 or version == 1  # the KL to the base grows once the adapters moved
                after = trainer.full_state_dict()
                assert _checksums({n: after[n] for n in base}) == _checksums(base), "a frozen base weight changed"
                assert max((after[n] - before[n]).abs().max().item() for n in adapters) > 1e-3
                # The reference is the base: it matches the engine that still holds the base (before
                # the first sync), while the policy has moved away from it.
                if version == 1:
                    assert _gap(served, trainer.compute_log_probs(fixed, reference=True)) < BOUND
                    assert _gap(served, trainer.compute_log_probs(fixed)) > 10 * BOUND
                topology = Topology(mode, 2, 1, 1, has_gpu=False, trainers_sleep=False).with_engines(rollout.fleet.addresses)
                trainer.connect_engines(topology, timeout_s=60)
                trainer.sync_weights(16 * 2**10, weight_version=version)  # 16 KiB: buckets smaller than some weights
                assert _gap(rollout.fleet.score(FIXED, engine_index=0), trainer.compute_log_probs(fixed)) < BOUND, mode
                assert verify_engine_weights(trainer, rollout.fleet, version, BOUND, seed=0) < BOUND
    finally:
        trainer.shutdown()


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_exactly(tiny_model_dir, ray_cluster,
                                                                                       tmp_path):
    """Save after one step, load into fresh ranks: the next step gives the same metrics and weights
    as the ranks that never stopped (AdamW's moments and step count came back too), and the
    checkpoint holds no base weight."""
    from torch.distributed.checkpoint import FileSystemReader

    spec = trainer_spec(tiny_model_dir, lr=3e-2, use_kl_loss=True, kl_coef=0.1, lora=LORA)
    first = InspectableTrainerGroup(spec, num_ranks=2)
    try:
        first.train_step(random_sequences(1, count=16, vocab=80))
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
        model_keys = [key for key in saved if key.startswith("model.")]
        assert model_keys and all(".lora_" in key for key in model_keys), model_keys[:5]
        assert any(key.startswith("optim.state.") and key.endswith("exp_avg_sq") for key in saved)
        going_on = first.train_step(random_sequences(2, count=16, vocab=80))
        expected = first.full_state_dict()
    finally:
        first.shutdown()
    second = InspectableTrainerGroup(spec, num_ranks=2)
    try:
        second.load_checkpoint(str(tmp_path / "ckpt"))
        resumed = second.train_step(random_sequences(2, count=16, vocab=80))
        got = second.full_state_dict()
    finally:
        second.shutdown()
    for key in ("loss", "kl", "grad_norm", "clip_fraction", "lr"):
        assert resumed[key] == going_on[key], key
    assert all((got[name] == expected[name]).all() for name in expected)


def test_a_lora_run_learns_the_quickstart_task_and_exports_its_adapter(tmp_path, ray_address, quickstart_engines):
    """`rlsys train` with model.lora learns (measured here with the entropy bonus, seeds 0, 1, 4, 5, 6:
    greedy eval 0.04 -> 0.39-0.49 at step 40 and 0.73-0.92 at step 99; full fine-tuning reaches 0.9
    sooner); `rlsys export` writes a PEFT adapter that PeftModel loads onto the base, and --merged the
    same model merged; --resume with another adapter rank is refused before anything starts, naming
    the setting; an adapter rank the model cannot have is refused by trainer rank 0."""
    import json
    import subprocess
    import sys

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlsys.observability.metrics import read_metrics
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
    from tests.helpers import train_command

    tiny_model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(init_std=0.1))
    run_dir = tmp_path / "run"
    lora = f"model.lora={{rank: {RUN_LORA['rank']}, alpha: {RUN_LORA['alpha']}}}"
    finished = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, lora, *RUN_SETTINGS, ray_address,
                                            quickstart_engines),
                              capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval_reward_mean"]) for r in rows if "eval_reward_mean" in r]
    print("LoRA quickstart eval:", evals)
    assert evals[0][1] <= 0.1 and max(value for _, value in evals[-3:]) >= 0.35, evals
    sampled = [r["reward_mean"] for r in rows]
    assert sum(sampled[-20:]) / 20 > 4 * sum(sampled[:10]) / 10, sampled
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3  # the engines served the merged weights

    def export(*extra):
        out = tmp_path / ("merged" if extra else "adapter")
        done = subprocess.run([sys.executable, "-m", "rlsys.cli", "export", str(run_dir), str(out), *extra],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return out

    adapter, merged = export(), export("--merged")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == RUN_LORA["rank"]
    assert not (adapter / "model.safetensors").exists()
    tokens = torch.tensor([[5, 9, 14, 3, 7, 7, 20, 31]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, str(adapter))(tokens).logits
        whole = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)(tokens).logits
    assert (adapted - before).abs().max() > 1e-2  # the adapters learned something
    assert (adapted - whole).abs().max() < 1e-4  # merged = base + adapters (fp32 rounding of W + sBA)

    other = f"model.lora={{rank: {2 * RUN_LORA['rank']}, alpha: {RUN_LORA['alpha']}}}"
    refused = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, other, *RUN_SETTINGS,
                                           "--resume"), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "was written by a different model" in refused.stderr and "model.lora (rank" in refused.stderr

    # What the ranks cannot build is refused by trainer rank 0 before they build the model (the driver
    # no longer imports the modeling code): one error line, exit 2, nothing trained.
    too_large = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, tmp_path / "too-large",
                                             "model.lora.rank=4096", ray_address, quickstart_engines),
                               capture_output=True, text=True, timeout=300)
    assert too_large.returncode == 2, too_large.stderr[-2000:]
    assert "rlsys: error: invalid config: model.lora.rank 4096 is above the smallest dimension" in too_large.stderr
    assert "Traceback" not in too_large.stderr and not (tmp_path / "too-large" / "checkpoints").exists()
