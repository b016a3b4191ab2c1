"""The architecture matrix: each architecture `rlsys make-tiny-model --arch` builds goes the whole
way through rlsys (Qwen3-MoE's learning run replays the engine's routing, rollout.routing_replay).
Qwen2 has q/k/v biases; Qwen3 has none, but per-head q/k RMSNorms and a
head_dim of its own; Llama has neither. Where rlsys does its own work they differ: meta-device
loading with per-rank shard reads (2 FSDP2 ranks), packed attention (tests/unit/test_packed_attention.py
covers every architecture), the parameter names the weight sync hands to SGLang's `load_weights`
(both transports), the served-model registry, and export; Qwen3-MoE stores its experts stacked in
the trainer and one tensor per expert in the checkpoint and the engine.

Engine log-probs equal the trainer's to 1e-3, the bound tests/e2e/test_weight_sync.py uses for
Qwen2 (fp32 on both sides; different kernels: SGLang's CPU attention against packed SDPA).
"""

import json
import subprocess
import sys

import pytest

from rlsys.actors.group import TrainerGroup
from rlsys.records import TrainSequence
from rlsys.rollout.manager import RolloutManager
from rlsys.run.verify import verify_engine_weights
from rlsys.system.topology import Topology
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers import REPO, random_sequences, standing_rollout, train_command, trainer_spec

pytestmark = pytest.mark.second_stream  # engine sets of its own, no shared one (Makefile: test)

# Qwen2, the default, goes through every other test: both transports in tests/e2e/test_weight_sync.py,
# learning in tests/e2e/test_quickstart.py, export in tests/e2e/test_resume.py.
DENSE = ["qwen3", "llama"]
CONTEXT_PARALLEL_ARCH = "qwen3"  # its learning run splits each sequence over 2 ranks
# Qwen3-MoE: transformers stacks each layer's experts into one parameter, the checkpoint and
# SGLang's load_weights keep one tensor per expert (actors/checkpoint_layout.py); SGLang's CPU path
# runs its experts in plain torch (the same numbers as transformers', to fp32 rounding).
MOE = "qwen3_moe"
SERVED = DENSE + [MOE]
FIXED = [[5, 9, 14, 3, 7, 7, 20, 31], [40, 41, 42, 6, 6, 6], [12, 65, 13, 65, 14, 73, 15, 1]]
BOUND = 1e-3


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    """`served(arch)`: (its tiny model, the override attaching a run to the standing set that serves it).
    One set per architecture in configs/recipes/cispo.yaml's layout, started at the first test of the
    architecture and shared by its tests (the sync checks and the learning run), stopped with the module."""
    from tests.conftest import standing_set, stop_standing_set

    made = {}

    def served(arch: str) -> tuple:
        if arch not in made:
            model = make_tiny_model(tmp_path_factory.mktemp(arch), TinyModelSpec(arch=arch))
            # the MoE set returns its routes: the routing replay tests share it
            replay = ["rollout.routing_replay=rollout"] if arch == MOE else []
            made[arch] = model, standing_set(f"arch-{arch}", "recipes/cispo.yaml", [f"model.path={model}", *replay],
                                             tmp_path_factory.getbasetemp() / "standing-engines")
        return made[arch]

    yield served
    for arch in made:
        stop_standing_set(f"arch-{arch}")


def _engine_gap(rollout: RolloutManager, trainer: TrainerGroup) -> float:
    expected = trainer.compute_log_probs([TrainSequence(tokens, prompt_len=1) for tokens in FIXED])
    served = rollout.fleet.score(FIXED, engine_index=0)
    return max(abs(x - y) for a, b in zip(served, expected, strict=True) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", SERVED)
def test_one_engine_serves_what_two_sharded_ranks_hold_through_both_transports(arch, served, tmp_path):
    model_dir, _ = served(arch)
    trainer = TrainerGroup(trainer_spec(model_dir, lr=1e-2), num_ranks=2)  # meta-device build, shard reads
    try:
        with standing_rollout(f"arch-{arch}", tmp_path / "logs") as rollout:
            assert trainer.describe()["layout"] == "FSDP2"
            assert _engine_gap(rollout, trainer) < BOUND, arch  # the same checkpoint, read two ways
            for version, mode in enumerate(("colocated", "disaggregated"), start=1):
                trainer.train_step(random_sequences(version, count=16, vocab=80))
                assert _engine_gap(rollout, trainer) > 10 * BOUND  # the engine still serves the old weights
                topology = Topology(mode, 2, 1, 1, has_gpu=False, trainers_sleep=False).with_engines(rollout.fleet.addresses)
                trainer.connect_engines(topology, timeout_s=60)
                trainer.sync_weights(16 * 2**20, weight_version=version)
                assert _engine_gap(rollout, trainer) < BOUND, f"{arch}, {mode} sync"
                assert verify_engine_weights(trainer, rollout.fleet, version, BOUND, seed=0) < BOUND
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("arch", DENSE + [MOE])
def test_the_quickstart_task_learns_and_exports_on_each_architecture(arch, served, tmp_path, ray_address):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsys.config import load_config
    from rlsys.data.tasks import generate_task
    from rlsys.data.tokenizer import load_tokenizer

    model_dir, attach = served(arch)  # the engine the sync test used: the run gives it its weights first
    run_dir = tmp_path / "run"
    # The CISPO recipe (two optimizer steps per batch): the quickstart's task and model size, learning in
    # fewer steps; this is also the recipe's own learning test. Qwen3's run splits every sequence over
    # its two ranks (context parallelism, ring): it must learn as the others do.
    split = ("trainer.context_parallel_size=2",) if arch == CONTEXT_PARALLEL_ARCH else ()
    # Qwen3-MoE's run replays the engine's expert routing in every trainer forward
    replay = ("rollout.routing_replay=rollout",) if arch == MOE else ()
    result = subprocess.run(train_command("recipes/cispo.yaml", model_dir, run_dir, "trainer.total_steps=100",
                                          "checkpoint.interval=100", "eval.stop_at_reward=0.9", ray_address, attach,
                                          *split, *replay),
                            cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_reward_mean"] for r in rows if r.get("eval_reward_mean") is not None]
    assert evals[0] < 0.3 and evals[-1] >= 0.9, f"{arch}: eval reward over the run: {evals}"
    if split:
        assert "context_parallel_size: 2" in (run_dir / "config.yaml").read_text()
        assert "context parallel: ring over 2 ranks) ready after" in result.stdout
    # the share of tokens whose weight hit the cap is CISPO's clip fraction (ScaleRL's cap of 5 is
    # seldom reached by one optimizer step's move); a token-level loss logs no sequence clip share
    assert all(0.0 <= r["clip_fraction"] <= 1.0 for r in rows)
    assert "seq_clip_fraction" not in rows[0]
    if replay:  # every step's forwards had the engine's routes (the metric exists only then); the share whose
        # trainer top-k differs grows with the recipe's second optimizer step per batch, which routes by moved weights
        assert all(0.0 <= r["routing_mismatch_fraction"] <= 1.0 for r in rows)

    exported = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "rlsys.cli", "export", str(run_dir), str(exported)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    # The Auto classes, from the exported files alone, tokenize as the run did and answer the eval
    # prompts as its last eval did (AutoTokenizer builds a Qwen2Tokenizer for a qwen2 config.json
    # whatever tokenizer_config says: a tokenizer of another kind once lost its spaces there).
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ran_with = load_tokenizer(model_dir)
    _, eval_rows = generate_task(load_config(run_dir / "config.yaml").data.synthetic)
    assert [tokenizer(row.prompt).input_ids for row in eval_rows] == [ran_with(row.prompt).input_ids for row in eval_rows]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.chat_template) == \
        (ran_with.eos_token_id, ran_with.pad_token_id, ran_with.chat_template)
    right = 0
    for row in eval_rows:
        ids = tokenizer(row.prompt, return_tensors="pt").input_ids
        answer = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        right += tokenizer.decode(answer, skip_special_tokens=True).strip() == row.label
    assert right / len(eval_rows) == pytest.approx(evals[-1], abs=0.05)  # near-ties may break either way


def _in_process_trainer(spec):
    """A TrainerWorker of world size 1 in this process (its routers can be patched here)."""
    import os

    import torch

    from rlsys.actors.trainer import TrainerWorker

    environment, threads = dict(os.environ), torch.get_num_threads()  # a rank sets both for its process
    worker = TrainerWorker(spec, 0, 1)
    worker.setup(*worker.rendezvous_address())
    return worker, lambda: (worker.shutdown(), os.environ.clear(), os.environ.update(environment),
                            torch.set_num_threads(threads))


def _biased_selection(bias):
    """Qwen3-MoE's router forward with `bias` added to its probabilities for the top-k choice only (as a
    DeepSeek-V3 router's correction bias is): the gating weights stay the softmax of the same logits,
    so only which experts a token goes to changes, as a bf16 kernel's near-tie flips change it."""
    import torch

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probabilities = torch.softmax(logits, dtype=torch.float, dim=-1)
        indices = torch.topk(probabilities + bias, self.top_k, dim=-1).indices
        scores = probabilities.gather(1, indices)
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), indices
    return forward


def test_a_moe_trainer_routing_apart_from_its_engine_replays_the_engines_experts(served, tmp_path, monkeypatch):
    """rollout.routing_replay: the engine's routes travel with its samples; a trainer whose router picks
    other experts for >= 20% of (token, layer) pairs computes the engine's log-probs again when it
    replays them (to the unperturbed trainer's fp32 level), and does not without."""
    from dataclasses import replace

    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from rlsys.records import SamplingParams

    model_dir, _ = served(MOE)
    with standing_rollout(f"arch-{MOE}", tmp_path / "logs") as rollout:
        generations = rollout.generate([tokens[:4] for tokens in FIXED], SamplingParams(max_new_tokens=8), n=4)
    sequences = [TrainSequence(g.prompt_ids + g.response_ids, len(g.prompt_ids), advantage=1.0,
                               engine_logprobs=g.logprobs, routes=g.routes) for g in generations]
    assert all(g.routes.shape == (len(g.prompt_ids) + len(g.response_ids) - 1, 2, 2) for g in generations)

    def gap(worker) -> float:
        ours = worker.compute_log_probs(sequences)
        return max(abs(x - y) for seq, logprobs in zip(sequences, ours, strict=True)
                   for x, y in zip(seq.engine_logprobs, logprobs, strict=True))

    spec = trainer_spec(model_dir, lr=1e-3)
    gaps = {}
    for perturbed in (False, True):
        if perturbed:  # expert 3 chosen far more often by the trainer than by the engine
            monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward",
                                _biased_selection(torch.tensor([0.0, 0.0, 0.0, 0.25])))
        for replay in (False, True):
            worker, close = _in_process_trainer(replace(spec, routing_replay=replay))
            try:
                gaps[perturbed, replay] = gap(worker)
                if perturbed and replay:
                    metrics = worker.train_step([sequences])
            finally:
                close()
    assert gaps[False, False] < BOUND and gaps[False, True] < BOUND  # fp32 engine and trainer: the same experts
    assert metrics["routing_mismatch_fraction"] >= 0.2, metrics  # the perturbed router's own choice
    assert gaps[True, False] > 10 * BOUND, gaps  # routing apart: log-probs apart
    assert gaps[True, True] <= gaps[False, False] + 1e-6, gaps  # replayed: back to the fp32 level
