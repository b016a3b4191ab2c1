"""rlsys's update equals TRL 1.16's GRPOTrainer on one identical batch, for every policy loss and
aggregation TRL has.

Both sides get the same tiny model (fp32, CPU), the same prompts and completions, the same rewards
and the same engine ("sampling") log-probs. TRL runs its own code from the completions on:
`_generate_and_score_completions` (rewards, advantages, old and reference log-probs, the
importance-sampling ratio against the engine) with only its `_generate` replaced by the fixed
completions, then `compute_loss` and its AdamW. rlsys runs a real `TrainerWorker.train_step`. Each
case takes two optimizer steps over two mini-batches of the batch: the first on-policy, the second
after the first update, where the old log-probs differ from the current ones and the clip, the
cap, the soft gate or the gamma weight acts. Compared, per optimizer step: the gradient that goes
into AdamW (no norm clipping on either side: it would hide a wrong normaliser), the loss of the
step, and the parameters after it.

Bounds, from fp32 arithmetic (unit roundoff u = 6e-8):
- Gradients: each element is a sum over 8 sequences x <= 12 positions of per-token terms, which
  the two sides add in different orders (TRL pads an [8, P + C] batch, rlsys packs the sequences
  back to back and chunks its output layer). Two orders of n terms differ by at most 2 n u
  sum|terms|: for n ~ 100, 1.2e-5 of the sum of magnitudes, which is within a small factor of the
  gradient's scale here (advantages have both signs, but few tokens share a parameter row). The
  test asks ||g_rlsys - g_trl|| <= 1e-5 ||g_trl|| over the whole model. Measured: 1.4e-7 to
  2.5e-7 at step 1. A change of a formula moves it far more: a 1% change of SAPO's gate gives
  1e-2, a KL term off by 1% of the log-ratio 4e-4.
- Step 2 starts from parameters that differ by AdamW's reaction to that rounding: its step is
  lr * m / (sqrt(v) + eps), about lr * sign(g) at the first step, so an element whose exact
  gradient is ~0 moves by up to lr in a direction set by rounding. The function's change from
  that, and so step 2's gradient difference, grows with lr (measured, grpo case: 3e-7 at lr 3e-5,
  1.7e-6 at 1e-4, 1.4e-5 at 3e-4, 7.6e-4 at 3e-3); at this test's lr 5e-5 it measures 2e-7 to
  6.5e-7, so the same 1e-5 bound holds with a margin of 15x. The clip bounds are set small
  (5e-4) so that step 2's ratios, which move by ~1e-3 at this lr, do cross them.
- Parameters after both steps: at most 2 lr per step and element apart (Adam's own bound).
- The mean loss: the same sums, relative 1e-5.

Where rlsys and TRL differ on purpose, the test says so and checks rlsys against what it means:
- advantages: rlsys divides by std + 1e-6 (verl's epsilon), TRL by std + 1e-4; checked here with
  the epsilon passed to rlsys's estimator, and the loss compared on TRL's advantages;
- the entropy bonus: TRL takes the token mean of the entropy under every aggregation, rlsys
  aggregates it like the policy loss (as verl does); compared only under token-mean aggregations;
- TRL's dapo/cispo/vespo divide each mini-batch's token sum by the generation batch's tokens over
  steps_per_generation, rlsys by the mini-batch's own tokens (token-mean); equal when the two
  mini-batches hold equally many loss tokens, as this batch is built to.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from rlsys.actors.group import global_mini_batches
from rlsys.actors.trainer import TrainerWorker
from rlsys.algorithms.advantages import group_advantages
from rlsys.records import TrainSequence
from tests.helpers import trainer_spec

PROMPTS, GROUP, PROMPT_LEN, MAX_NEW = 4, 4, 5, 8
LR = 5e-5
GRADIENT_RTOL = 1e-5  # of the gradient's norm; see the module docstring
KL = {"beta": 0.04}, {"use_kl_loss": True, "kl_coef": 0.04, "kl_estimator": "k3"}
# TRL's four vllm_importance_sampling_modes and its off-policy mask -> rlsys's algorithm.corrections.
# The engine's log-probs are the model's own +-0.3 (_engine_logprobs): token ratios in [0.74, 1.35],
# so the bounds below cut or mask tokens (and, at sequence level, whole responses) on both sides.
TIS_TOKEN = ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2},
             {"corrections": [{"name": "importance_sampling", "max": 1.2}]})
TIS_SEQUENCE = ({"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_max": 2.0},
                {"corrections": [{"name": "importance_sampling", "level": "sequence", "max": 2.0}]})
TOKEN_TRUNCATE_BOTH = (
    {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.9,
     "vllm_importance_sampling_clip_max": 1.1},
    {"corrections": [{"name": "importance_sampling", "min": 0.9, "max": 1.1}]})
TOKEN_MASK = ({"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.85,
               "vllm_importance_sampling_clip_max": 1.2},
              {"corrections": [{"name": "importance_sampling", "mode": "mask", "min": 0.85, "max": 1.2}]})
SEQUENCE_MASK = ({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5,
                  "vllm_importance_sampling_clip_max": 1.5},
                 {"corrections": [{"name": "importance_sampling", "level": "sequence", "mode": "mask", "min": 0.5,
                                   "max": 1.5}]})
# DeepSeek-V3.2's mask beside TIS (TRL reads the engine's log-probs for it only when it has them):
# responses with A < 0 whose mean log(p_engine / p_theta) is above 0.02 are dropped.
OFF_POLICY_MASK = ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2,
                    "off_policy_mask_threshold": 0.02},
                   {"corrections": [{"name": "importance_sampling", "max": 1.2},
                                    {"name": "off_policy_mask", "threshold": 0.02}]})


def _case(trl: dict, rlsys: dict, *extras: tuple[dict, dict]) -> tuple[dict, dict]:
    trl, rlsys = dict(trl), dict(rlsys)
    for trl_extra, rlsys_extra in extras:
        trl.update(trl_extra)
        rlsys.update(rlsys_extra)
    return trl, rlsys


# TRL GRPOConfig fields -> rlsys algorithm fields, one case per loss TRL has (KL, the engine-mismatch
# correction and the entropy bonus on in some). Clip bounds are small enough for the step-2 ratios,
# which move by ~1e-3 at this learning rate, to cross them: every clip, cap and gate acts.
EPS = 5e-4
CASES = {
    "grpo": _case({"loss_type": "grpo", "epsilon": EPS}, {"policy_loss": "grpo", "loss_agg_mode": "seq-mean-token-mean",
                  "clip_eps_low": EPS, "clip_eps_high": EPS}, KL, TIS_TOKEN),
    "bnpo": _case({"loss_type": "bnpo", "epsilon": EPS}, {"policy_loss": "grpo", "loss_agg_mode": "token-mean",
                  "clip_eps_low": EPS, "clip_eps_high": EPS}, TIS_TOKEN),
    "dapo-clip-higher-entropy": _case(
        {"loss_type": "dapo", "epsilon": EPS, "epsilon_high": 1.4 * EPS, "entropy_coef": 0.01},
        {"policy_loss": "grpo", "loss_agg_mode": "token-mean", "clip_eps_low": EPS, "clip_eps_high": 1.4 * EPS,
         "entropy_coef": 0.01}, KL),
    "dr_grpo": _case({"loss_type": "dr_grpo", "scale_rewards": "none", "epsilon": EPS},
                     {"policy_loss": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm", "loss_norm_tokens": MAX_NEW,
                      "advantage_estimator": "none", "clip_eps_low": EPS, "clip_eps_high": EPS}, TIS_TOKEN),
    "gspo": _case({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.3 * EPS,
                   "epsilon_high": 0.4 * EPS},
                  {"policy_loss": "gspo", "clip_eps_low": 0.3 * EPS, "clip_eps_high": 0.4 * EPS}, TIS_SEQUENCE),
    "luspo": _case({"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.3 * EPS},
                   {"policy_loss": "luspo", "clip_eps_low": 0.3 * EPS, "clip_eps_high": 0.3 * EPS}, KL),
    "cispo": _case({"loss_type": "cispo", "epsilon_high": 1 + EPS}, {"policy_loss": "cispo", "cispo_max_ratio": 1 + EPS},
                   KL, TIS_TOKEN),
    "sapo": _case({"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
                  {"policy_loss": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, TIS_TOKEN),
    "vespo": _case({"loss_type": "vespo"}, {"policy_loss": "vespo"}, TIS_TOKEN),
    "token-truncate-both-bounds": _case({"loss_type": "bnpo", "epsilon": EPS},
                                        {"policy_loss": "grpo", "loss_agg_mode": "token-mean", "clip_eps_low": EPS,
                                         "clip_eps_high": EPS}, TOKEN_TRUNCATE_BOTH),
    "token-mask": _case({"loss_type": "grpo", "epsilon": EPS},
                        {"policy_loss": "grpo", "loss_agg_mode": "seq-mean-token-mean", "clip_eps_low": EPS,
                         "clip_eps_high": EPS}, TOKEN_MASK),
    "sequence-mask": _case({"loss_type": "bnpo", "epsilon": EPS},
                           {"policy_loss": "grpo", "loss_agg_mode": "token-mean", "clip_eps_low": EPS,
                            "clip_eps_high": EPS}, SEQUENCE_MASK),
    "off-policy-mask": _case({"loss_type": "bnpo", "epsilon": EPS},
                             {"policy_loss": "grpo", "loss_agg_mode": "token-mean", "clip_eps_low": EPS,
                              "clip_eps_high": EPS}, OFF_POLICY_MASK),
    "batch-scaled-advantages": _case({"loss_type": "dapo", "scale_rewards": "batch", "epsilon": EPS},
                                     {"policy_loss": "grpo", "loss_agg_mode": "token-mean", "clip_eps_low": EPS,
                                      "clip_eps_high": EPS, "advantage_estimator": "batch"}),
}


def _batch(vocab: int, pad_id: int, eos_id: int):
    """Equal-length prompts (TRL pads prompts on the left; equal lengths keep positions identical),
    completions of 2..MAX_NEW tokens ordered so that both mini-batches (groups 0-1, 2-3) hold the
    same number of tokens, rewards with both signs of advantage and one all-equal group."""
    rng = random.Random(7)
    lengths = [2, 8, 5, 3, 7, 4, 6, 3] * 2  # each half: 38 tokens
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    completions = [[rng.choice([t for t in range(3, vocab) if t not in (pad_id, eos_id)]) for _ in range(n)]
                   for n in lengths]
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0, 0.0, 0.75, 0.0, 1.0]
    return prompts, completions, rewards


def _engine_logprobs(model, prompts, completions) -> list[list[float]]:
    """What an engine would report: the model's own log-probs, off by up to +-0.3 (a bf16 engine,
    a kernel difference), so the correction has ratios on both sides of 1 and some over its cap."""
    rng = random.Random(11)
    out = []
    with torch.no_grad():
        for i, completion in enumerate(completions):
            ids = torch.tensor([prompts[i // GROUP] + completion])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            own = logprobs[torch.arange(PROMPT_LEN - 1, ids.shape[1] - 1), ids[0, PROMPT_LEN:]]
            out.append([v + rng.uniform(-0.3, 0.3) for v in own.tolist()])
    return out


class _Recorded:
    """The gradients that go into each optimizer step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.steps: list[dict[str, torch.Tensor]] = []
        names = {p: n for n, p in model.named_parameters()}
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.steps.append(
            {names[p]: p.grad.detach().clone() for group in opt.param_groups for p in group["params"]
             if p.grad is not None}))


def _trl_steps(model_dir, trl_fields: dict, prompts, completions, rewards, engine_logprobs):
    """TRL's two optimizer steps on the batch: (advantages, [loss per step], recorded gradients, params)."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    fields = dict(trl_fields)
    correction = {k: fields.pop(k) for k in list(fields) if k.startswith("vllm_importance_sampling")}
    correction.update({k: fields.pop(k) for k in list(fields) if k == "off_policy_mask_threshold"})
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=PROMPTS * GROUP // 2, steps_per_generation=2,
            gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_NEW, temperature=1.0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1e9,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, use_cpu=True, bf16=False, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_steps=2,
            **{"epsilon": 0.2, "beta": 0.0, **fields, **correction},
        )
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, target, **_: list(target),
                              args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": "x", "target": 0.0}]))
    model = trainer.model
    model.train()
    # The engine's side: TRL corrects for it only when it generates with vLLM; its code path is
    # the same with the fixed engine log-probs below standing in for vLLM's.
    trainer.use_vllm = bool(correction)
    trainer.vllm_importance_sampling_correction = bool(correction)
    trainer._generate = lambda _prompts: (
        [prompts[i // GROUP] for i in range(len(completions))], completions, None,
        [tokenizer.decode(c) for c in completions], engine_logprobs if correction else None, {}, None, None)
    trainer.current_gradient_accumulation_steps = 1
    rows = [{"prompt": "x", "target": r} for r in rewards]
    batch = trainer._generate_and_score_completions(rows)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    recorded = _Recorded(model, trainer.optimizer)
    losses = []
    for half in split_tensor_dict(batch, 2):  # in order, as rlsys splits a step into its mini-batches
        loss = trainer.compute_loss(model, half)
        loss.backward()
        losses.append(loss.item())
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return batch["advantages"].view(-1), losses, recorded.steps, params


def _rlsys_steps(model_dir, algorithm_fields: dict, sequences):
    """rlsys's step on the batch in one in-process trainer rank (world size 1, fp32: the model whole,
    as TRL holds it): (metrics, recorded gradients, params)."""
    spec = trainer_spec(model_dir, lr=LR, grad_clip=1e9, mini_batches_per_step=2, total_steps=1,
                        betas=(0.9, 0.999), weight_decay=0.0, **algorithm_fields)
    environment, threads = dict(os.environ), torch.get_num_threads()  # a rank sets both for its process
    worker = TrainerWorker(spec, 0, 1)
    try:
        worker.setup(*worker.rendezvous_address())
        recorded = _Recorded(worker.model, worker.optimizer)
        metrics = worker.train_step(global_mini_batches(sequences, spec))
        return metrics, recorded.steps, {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    finally:
        worker.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        torch.set_num_threads(threads)


def _relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in b))
    norm = torch.sqrt(sum((b[k] ** 2).sum() for k in b))
    assert norm > 1e-4  # a real gradient, not an all-zero one that would match trivially
    return (diff / norm).item()


@pytest.mark.parametrize("case", list(CASES))
def test_two_optimizer_steps_equal_trls_grpo_trainer(case, tiny_model_dir):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    trl_fields, algorithm_fields = CASES[case]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    prompts, completions, rewards = _batch(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = _engine_logprobs(reference, prompts, completions)

    advantages, trl_losses, trl_grads, trl_params = _trl_steps(tiny_model_dir, trl_fields, prompts, completions,
                                                               rewards, engine)
    # rlsys's estimator gives TRL's advantages once given TRL's epsilon (rlsys's own is 1e-6)
    estimator = algorithm_fields.get("advantage_estimator", "group")
    ours = group_advantages(torch.tensor(rewards), GROUP, estimator, eps=1e-4)
    assert torch.allclose(ours, advantages, atol=1e-6), (ours, advantages)

    sequences = [TrainSequence(prompts[i // GROUP] + c, PROMPT_LEN, advantage=advantages[i].item(),
                               engine_logprobs=engine[i]) for i, c in enumerate(completions)]
    metrics, grads, params = _rlsys_steps(tiny_model_dir, algorithm_fields, sequences)

    assert len(grads) == len(trl_grads) == 2
    for step in range(2):
        difference = _relative_difference(grads[step], trl_grads[step])
        assert difference <= GRADIENT_RTOL, f"{case}, optimizer step {step + 1}: gradients differ by {difference:.2e}"
    assert metrics["loss"] == pytest.approx(sum(trl_losses) / 2, rel=1e-5, abs=1e-7)
    # and the case really exercised what it compares (a clip nobody crosses would match trivially)
    if algorithm_fields["policy_loss"] in ("grpo", "gspo", "luspo", "cispo"):
        assert metrics["clip_fraction"] > 0
    for correction in algorithm_fields.get("corrections", []):
        if correction.get("mode") == "mask" or correction["name"] == "off_policy_mask":
            assert metrics["masked_token_fraction"] > 0, correction
        else:
            assert metrics["tis_clipped_fraction"] > 0, correction
    if algorithm_fields["policy_loss"] == "vespo":
        assert metrics["vespo_phi_mean"] != pytest.approx(1.0, abs=1e-3)
    worst = max((params[k] - trl_params[k]).abs().max().item() for k in params)
    assert worst <= 2 * LR * 2, f"{case}: parameters differ by {worst} after two AdamW steps"
