"""Policy losses (algorithm.policy_loss) and their aggregations on a hand-computed batch: two
sequences of three response tokens, old log-prob -1 everywhere, the log-ratios below. Each loss
is what TRL 1.16's GRPOTrainer._compute_loss computes for its loss_type."""

import math

import pytest
import torch

from rlsys.actors.batching import build_micro_batch
from rlsys.actors.loss_sums import LossSums
from rlsys.algorithms.losses import flagged_sequences, micro_batch_loss, sequence_loss_weights
from rlsys.config import AlgorithmConfig
from rlsys.records import TrainSequence

LOG_RATIOS = [[0.6, 0.3, 0.0], [-0.1, -0.2, 0.0]]  # sequence 1 (A = +1), sequence 2 (A = -1)
ADVANTAGES = [1.0, -1.0]
OLD = -1.0


def micro_batch(algorithm: AlgorithmConfig, packed: bool, log_ratios=LOG_RATIOS, advantages=ADVANTAGES,
                prompt_lens=(1, 2), engine_logprobs=None):
    """The batch laid out packed or padded; returns (batch, log-probs leaf [B, T], spans)."""
    lengths = [len(r) for r in log_ratios]
    weights = sequence_loss_weights(lengths, algorithm.aggregation, norm_tokens=4)
    sequences = [TrainSequence(list(range(1, p + n + 1)), prompt_len=p, advantage=a, loss_weight=w,
                               engine_logprobs=e or [])
                 for p, n, a, w, e in zip(prompt_lens, lengths, advantages, weights,
                                          engine_logprobs or [None] * len(lengths), strict=True)]
    batch = build_micro_batch(sequences, list(range(len(sequences))), pad_id=0, device=torch.device("cpu"),
                              packed=packed)
    old = torch.full(batch.targets.shape, OLD)
    logprobs = old.clone()
    for (row, first, end), ratios in zip(batch.spans, log_ratios, strict=True):
        logprobs[row, first:end] += torch.tensor(ratios)
    batch.old_logprobs = old
    return batch, logprobs.requires_grad_()


def run(algorithm: AlgorithmConfig, packed: bool = True, **layout):
    """-> (objective, token gradients and clip flags sequence after sequence, the loss record, the batch)."""
    batch, logprobs = micro_batch(algorithm, packed, **layout)
    loss = micro_batch_loss(logprobs, torch.zeros_like(logprobs), batch, algorithm)
    loss.objective.backward()
    grads = [g for row, first, end in batch.spans for g in logprobs.grad[row, first:end].tolist()]
    clipped = [c for row, first, end in batch.spans for c in loss.clipped[row, first:end].tolist()]
    return loss.objective.item(), grads, clipped, loss, batch


def flat(per_sequence: list[list[float]]) -> list[float]:
    return [x for seq in per_sequence for x in seq]


def test_grpo_default_is_the_token_level_ppo_clip_with_token_mean():
    # r = e^0.6, e^0.3 > 1.2 with A > 0: clipped to 1.2 (no gradient); the rest -A * r.
    objective, grads, clipped, _, _ = run(AlgorithmConfig())
    r = [[math.exp(x) for x in seq] for seq in LOG_RATIOS]
    assert objective == pytest.approx((-1.2 - 1.2 - 1.0 + r[1][0] + r[1][1] + 1.0) / 6)
    assert grads == pytest.approx(flat([[0.0, 0.0, -1 / 6], [r[1][0] / 6, r[1][1] / 6, 1 / 6]]))
    assert clipped == flat([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("packed", [True, False])
def test_gspo_clips_the_geometric_mean_ratio_of_each_sequence(packed):
    # s_1 = exp(mean(0.6, 0.3, 0)) = e^0.3 > 1.2, A = +1: -1.2 on each token, no gradient.
    # s_2 = exp(mean(-0.1, -0.2, 0)) = e^-0.1, inside [0.8, 1.2], A = -1: +s_2 on each token.
    # seq-mean-token-mean: (-1.2 + s_2) / 2; d/d log p_t of s_2 / 2 = s_2 / 6 (s_2 = exp(mean)).
    objective, grads, clipped, _, _ = run(AlgorithmConfig(policy_loss="gspo"), packed=packed)
    s2 = math.exp(-0.1)
    assert objective == pytest.approx((-1.2 + s2) / 2)
    assert grads == pytest.approx(flat([[0.0] * 3, [s2 / 6] * 3]))
    assert clipped == [1.0] * 3 + [0.0] * 3  # the whole sequence is clipped or not


@pytest.mark.parametrize("packed", [True, False])
def test_luspo_is_gspo_with_each_sequence_summed_over_its_tokens(packed):
    # seq-mean-token-sum: w = 1/2 per token, so (3 * -1.2 + 3 * s_2) / 2; gradient s_2 / 2 per token.
    objective, grads, clipped, _, _ = run(AlgorithmConfig(policy_loss="luspo"), packed=packed)
    s2 = math.exp(-0.1)
    assert objective == pytest.approx((3 * -1.2 + 3 * s2) / 2)
    assert grads == pytest.approx(flat([[0.0] * 3, [s2 / 2] * 3]))
    assert clipped == [1.0] * 3 + [0.0] * 3


def test_cispo_caps_a_detached_weight_so_capped_tokens_still_train():
    # L = -sg(min(r, 1.2)) * A * log p; log p = -1 + log r. Token-mean: w = 1/6.
    objective, grads, clipped, _, _ = run(AlgorithmConfig(policy_loss={"name": "cispo", "max_ratio": 1.2}))
    r2 = [math.exp(x) for x in LOG_RATIOS[1]]
    logp = [[OLD + x for x in seq] for seq in LOG_RATIOS]
    token_losses = [-1.2 * logp[0][0], -1.2 * logp[0][1], -1.0 * logp[0][2]]
    token_losses += [r * lp for r, lp in zip(r2, logp[1], strict=True)]
    assert objective == pytest.approx(sum(token_losses) / 6)
    # The stop-gradient: d/d log p is -c * A (no d c / d log p term) and capped tokens keep -1.2 * A.
    # Without it an uncapped token would get -A * r * (1 + log p) / 6: for sequence 2, r * -0.1 / 6, not r / 6.
    assert grads == pytest.approx(flat([[-1.2 / 6, -1.2 / 6, -1.0 / 6], [r2[0] / 6, r2[1] / 6, 1.0 / 6]]))
    assert clipped == flat([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # r > 1.2 where A > 0 (TRL's cispo_clip_ratio)


def test_sapo_gates_softly_with_the_temperature_of_the_advantage_sign():
    # L = -A * (4 / tau) * sigmoid(tau * (r - 1)); tau = 1 (A > 0), 1.05 (A <= 0); seq-mean-token-mean: w = 1/6.
    objective, grads, clipped, _, _ = run(AlgorithmConfig(policy_loss="sapo"))
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    total, expected_grads = 0.0, []
    for seq, a, tau in zip(LOG_RATIOS, ADVANTAGES, (1.0, 1.05), strict=True):
        row = []
        for x in seq:
            r = math.exp(x)
            g = sigmoid(tau * (r - 1))
            total += -a * 4 / tau * g / 6
            row.append(-a * 4 * g * (1 - g) * r / 6)  # d/d log p = -A * 4 sigma (1 - sigma) * r
        expected_grads.append(row)
    assert objective == pytest.approx(total)
    assert grads == pytest.approx(flat(expected_grads))
    assert grads[2] == pytest.approx(-1 / 6) and grads[5] == pytest.approx(1 / 6)  # r = 1: PPO's -A
    assert clipped == [0.0] * 6


def vespo_phi(log_w: float, k: float, lam: float) -> float:
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_weighs_each_sequence_by_a_detached_gamma_of_its_ratio():
    # log w = sum of log-ratios: 0.9 (A = +1: k 2, lambda 3) and -0.3 (A = -1: k 3, lambda 2).
    # L = -phi * A * log p, token-mean w = 1/6; gradient -phi * A / 6 (phi detached).
    objective, grads, _, loss, _ = run(AlgorithmConfig(policy_loss="vespo"))
    phi = [vespo_phi(0.9, 2.0, 3.0), vespo_phi(-0.3, 3.0, 2.0)]
    assert phi == pytest.approx([math.exp(4.8 - 3 * math.exp(0.9)), math.exp(1.1 - 2 * math.exp(-0.3))])
    logp = [[OLD + x for x in seq] for seq in LOG_RATIOS]
    token_losses = [-p * a * lp for p, a, seq in zip(phi, ADVANTAGES, logp, strict=True) for lp in seq]
    assert objective == pytest.approx(sum(token_losses) / 6)
    assert grads == pytest.approx(flat([[-phi[0] / 6] * 3, [phi[1] / 6] * 3]))
    assert loss.weight is not None


def test_vespo_folds_token_tis_weights_into_its_sequence_ratio_instead_of_multiplying():
    # Old log-prob -1, engine log-probs -1 - log 2, -1, -1 for sequence 1: TIS weights 2, 1, 1
    # (cap 3), so log w_1 = 0.9 + log 2; sequence 2 has engine = old: weight 1.
    algorithm = AlgorithmConfig(policy_loss="vespo", corrections=[{"name": "importance_sampling", "max": 3.0}])
    engine = [[OLD - math.log(2), OLD, OLD], [OLD, OLD, OLD]]
    objective, grads, _, loss, _ = run(algorithm, engine_logprobs=engine)
    phi = [vespo_phi(0.9 + math.log(2), 2.0, 3.0), vespo_phi(-0.3, 3.0, 2.0)]
    assert grads == pytest.approx(flat([[-phi[0] / 6] * 3, [phi[1] / 6] * 3]))
    assert loss.tis.weights.max().item() == pytest.approx(2.0)


@pytest.mark.parametrize("policy_loss", ["grpo", "gspo", "luspo", "cispo", "sapo", "vespo"])
def test_packed_and_padded_layouts_give_the_same_loss_and_gradient(policy_loss):
    """Unequal lengths and prompts, so a packed row holds sequences at different offsets."""
    layout = dict(log_ratios=[[0.25, -0.5], [0.1, 0.4, -0.3, 0.2], [-0.05]], advantages=[0.7, -1.3, 0.4],
                  prompt_lens=(2, 1, 3))
    algorithm = AlgorithmConfig(policy_loss=policy_loss)
    packed, padded = run(algorithm, packed=True, **layout), run(algorithm, packed=False, **layout)
    assert packed[0] == pytest.approx(padded[0], rel=1e-6)
    assert packed[1] == pytest.approx(padded[1], rel=1e-6)
    assert packed[2] == padded[2]


def test_seq_mean_token_sum_weighs_every_sequence_one_over_n():
    assert sequence_loss_weights([2, 4, 0, 6], "seq-mean-token-sum") == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])


def test_each_policy_loss_brings_trls_aggregation_unless_one_is_set():
    own = {name: AlgorithmConfig(policy_loss=name).aggregation for name in ("grpo", "gspo", "luspo", "cispo",
                                                                              "sapo", "vespo")}
    # TRL: grpo/sapo -> per-sequence mean; dapo/cispo/vespo -> tokens; luspo -> per-sequence sums.
    assert own == {"grpo": "token-mean", "gspo": "seq-mean-token-mean", "luspo": "seq-mean-token-sum",
                   "cispo": "token-mean", "sapo": "seq-mean-token-mean", "vespo": "token-mean"}
    assert AlgorithmConfig(policy_loss="cispo", loss_agg_mode="seq-mean-token-mean").aggregation == \
        "seq-mean-token-mean"


@pytest.mark.parametrize("packed", [True, False])
def test_gspo_logs_its_clip_fraction_per_sequence(packed):
    """Sequence 1 is clipped, sequence 2 not; a sequence without loss tokens counts for neither."""
    _, _, _, loss, batch = run(AlgorithmConfig(policy_loss="gspo"), packed=packed)
    assert tuple(map(int, flagged_sequences(loss.clipped, batch.response_mask, batch.spans))) == (2, 1)
    sums = LossSums(clipped=3.0, tokens=6.0, sequences=2.0, clipped_sequences=1.0)
    assert sums.metrics(with_corrections=False, policy_loss=AlgorithmConfig(policy_loss="gspo").policy_loss)[
        "seq_clip_fraction"] == 0.5
    # per token
    assert "seq_clip_fraction" not in sums.metrics(with_corrections=False, policy_loss=AlgorithmConfig().policy_loss)
    no_loss = batch.response_mask.clone()
    row, first, end = batch.spans[0]
    no_loss[row, first:end] = 0.0  # e.g. a truncated response with mask_truncated
    assert tuple(map(int, flagged_sequences(loss.clipped, no_loss, batch.spans))) == (1, 0)


def test_vespo_logs_the_mean_phi_over_loss_tokens():
    sums = LossSums(policy_weight=3.0, tokens=6.0)
    assert sums.metrics(with_corrections=False, policy_loss=AlgorithmConfig(policy_loss="vespo").policy_loss)[
        "vespo_phi_mean"] == 0.5


def test_the_entropy_bonus_is_aggregated_like_the_policy_loss():
    """Where rlsys differs from TRL on purpose (tests/e2e/test_trl_equivalence.py compares the bonus
    under token-mean only): TRL subtracts coef * the token mean of the entropy whatever the loss's
    aggregation; rlsys weighs each token's entropy like its policy loss (verl's choice), so under
    seq-mean-token-mean a short sequence's tokens weigh more in both terms alike."""
    algorithm = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.1)
    log_ratios = [[0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]  # on-policy: the policy term is -A per token
    batch, logprobs = micro_batch(algorithm, packed=True, log_ratios=log_ratios, advantages=[0.0, 0.0])
    entropy = torch.zeros_like(logprobs)
    values = [[1.0, 3.0], [2.0, 2.0, 2.0, 6.0]]
    for (row, first, end), h in zip(batch.spans, values, strict=True):
        entropy[row, first:end] = torch.tensor(h)
    entropy.requires_grad_()
    loss = micro_batch_loss(logprobs, entropy, batch, algorithm)
    # w_i = 1 / (2 n_i): -0.1 * (mean(1, 3) + mean(2, 2, 2, 6)) / 2 = -0.1 * (2 + 3) / 2
    assert loss.objective.item() == pytest.approx(-0.25)
    loss.objective.backward()
    grads = [g for row, first, end in batch.spans for g in entropy.grad[row, first:end].tolist()]
    assert grads == pytest.approx([-0.1 / 4] * 2 + [-0.1 / 8] * 4)  # TRL's token mean: -0.1 / 6 on every token


def test_a_loss_added_as_one_class_runs_through_config_trainer_metrics_and_docs(tmp_path, tiny_model_dir):
    """A new policy loss is one class and its registration: the config reads it and its parameter,
    resolves its own aggregation and writes it to config.yaml; a trainer rank trains on it and logs
    its metric; the configuration reference lists it. Nothing else is edited."""
    from typing import Literal

    from pydantic import Field

    from rlsys.actors.trainer import TrainerSpec, TrainerWorker
    from rlsys.algorithms.grpo import PolicyLossTerms
    from rlsys.algorithms.policy_losses import POLICY_LOSSES, PolicyLoss, register_policy_loss
    from rlsys.config import dump_config, load_config
    from rlsys.tools.config_reference import render
    from tests.helpers import write_config

    @register_policy_loss
    class Toy(PolicyLoss):
        name: Literal["toy"] = Field("toy", description="The loss.")
        scale: float = Field(1.0, gt=0.0, description="What multiplies the policy gradient.")
        summary = "-scale A log p"
        aggregation = "seq-mean-token-mean"

        def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
            return PolicyLossTerms(loss=-self.scale * batch.advantages * logprobs, clipped=torch.zeros_like(logprobs),
                                   weight=torch.full_like(logprobs, self.scale))

        def weight_metrics(self, mean_weight):
            return {"toy_scale_mean": mean_weight}

    try:
        config = load_config(write_config(tmp_path / "c.yaml", tiny_model_dir),
                             ["algorithm.policy_loss=toy", "algorithm.policy_loss.scale=2.5", "trainer.num_ranks=1"])
        assert isinstance(config.algorithm.policy_loss, Toy) and config.algorithm.policy_loss.scale == 2.5
        assert config.algorithm.loss_agg_mode == "seq-mean-token-mean"  # its own, resolved at load
        dump_config(config, tmp_path / "run-config.yaml")
        assert load_config(tmp_path / "run-config.yaml").algorithm.policy_loss == config.algorithm.policy_loss
        assert "### `toy`" in render() and "What multiplies the policy gradient." in render()

        sequences = [TrainSequence([5, 6, 7, 8, 9], prompt_len=2, advantage=1.0),
                     TrainSequence([5, 9, 8, 7, 6, 5, 4], prompt_len=3, advantage=-0.5)]
        for sequence, weight in zip(sequences, sequence_loss_weights([3, 4], config.algorithm.aggregation), strict=True):
            sequence.loss_weight = weight
        worker = TrainerWorker(TrainerSpec.from_config(config, has_gpu=False), 0, 1)
        worker.setup(*worker.rendezvous_address())
        try:
            logprobs = worker.compute_log_probs(sequences)  # before the step: what the loss sees
            metrics = worker.train_step([sequences])
        finally:
            worker.shutdown()
        # seq-mean-token-mean: each sequence's token mean of -2.5 * A * log p, averaged over the two
        expected = sum(-2.5 * s.advantage * sum(lp) / len(lp) for s, lp in zip(sequences, logprobs, strict=True)) / 2
        assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
        assert metrics["toy_scale_mean"] == pytest.approx(2.5)
        assert "seq_clip_fraction" not in metrics and "vespo_phi_mean" not in metrics
    finally:
        POLICY_LOSSES.pop("toy")


def test_the_flat_keys_of_earlier_versions_are_read_into_the_loss_with_a_deprecation_line(caplog):
    with caplog.at_level("WARNING"):
        cispo = AlgorithmConfig(policy_loss="cispo", cispo_max_ratio=1.5, sapo_temperature_pos=2.0)
    assert cispo.policy_loss.max_ratio == 1.5
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "algorithm.cispo_max_ratio is deprecated: write algorithm.policy_loss: {name: cispo, max_ratio: 1.5}" in said
    assert "algorithm.sapo_temperature_pos is deprecated" in said and "(ignored: the policy loss is 'cispo')" in said
    # written both ways: the same value passes; two values are refused (which one was meant?), as
    # when a command line's flat key meets a file's nested one
    both = AlgorithmConfig(policy_loss={"name": "vespo", "k_pos": 1.0}, vespo_k_pos=1.0, vespo_k_neg=5.0)
    assert (both.policy_loss.k_pos, both.policy_loss.k_neg) == (1.0, 5.0)
    with pytest.raises(ValueError, match=r"algorithm.vespo_k_pos is 4.0 but algorithm.policy_loss.k_pos is 1.0: "
                                         "set one of them"):
        AlgorithmConfig(policy_loss={"name": "vespo", "k_pos": 1.0}, vespo_k_pos=4.0)


def test_a_loss_named_in_yaml_takes_its_parameters_from_the_command_line(tmp_path, tiny_model_dir):
    from rlsys.config import ConfigError, load_config
    from tests.helpers import write_config

    path = write_config(tmp_path / "c.yaml", tiny_model_dir, algorithm={"policy_loss": "cispo"})
    assert load_config(path, ["algorithm.policy_loss.max_ratio=3"]).algorithm.policy_loss.max_ratio == 3.0
    with pytest.raises(ConfigError, match="policy_loss.max_ratio"):
        load_config(path, ["algorithm.policy_loss.max_ratio=-1"])
    with pytest.raises(ConfigError, match="unknown policy loss 'ppo' .*one of .*grpo"):
        load_config(path, ["algorithm.policy_loss=ppo"])
    with pytest.raises(ConfigError, match="max_ratio"):  # a parameter of another loss
        load_config(path, ["algorithm.policy_loss=sapo", "algorithm.policy_loss.max_ratio=3"])
    # a parameter over a config that names no loss: the name is what is missing
    unnamed = write_config(tmp_path / "unnamed.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match=r"policy_loss needs a name beside its parameters \(max_ratio: -1\)"):
        load_config(unnamed, ["algorithm.policy_loss.max_ratio=-1"])
    # the deprecated flat key on the command line against the file's nested value: refused, not ignored
    nested = write_config(tmp_path / "nested.yaml", tiny_model_dir,
                          algorithm={"policy_loss": {"name": "cispo", "max_ratio": 5.0}})
    with pytest.raises(ConfigError, match="algorithm.cispo_max_ratio is 3 but algorithm.policy_loss.max_ratio is 5.0"):
        load_config(nested, ["algorithm.cispo_max_ratio=3"])
