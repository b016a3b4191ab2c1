"""Context parallelism in the trainer: the log-probs and gradients of a batch with each sequence
split over CP ranks (ring CP 2 and 4, Ulysses CP 2, and 2 data-parallel groups of CP 2) equal one
rank's, with packed micro-batches of odd-length sequences (padded to 2 x CP), gradient
checkpointing, the KL term to the reference and TIS weights on.

Bounds (fp32, unit roundoff u ~ 6e-8), as in test_fsdp_equivalence: a gradient element is a sum of
per-token terms that the layouts add in different orders (blocks merged by log-sum-exp, other
micro-batches, a reduce-scatter over more ranks), within 2 n u sum|terms| for n terms: with a few
hundred terms, 1e-4 of the gradient's scale. A log-prob is a log-softmax over a 64-wide model's
vocabulary of values O(10): 1e-5 absolute is ~100x its rounding. A misplaced token, a wrong
label at a chunk edge or a lost ring step moves a log-prob by O(0.1) (the attention unit tests'
mutation) and gradients by O(1/#tokens)."""

import random

import pytest

from rlsys.actors.group import weighed
from tests.helpers import random_sequences, trainer_spec

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)

GRADIENT_RTOL = 1e-4
LOGPROB_ATOL = 1e-5
LAYOUTS = [("ulysses", 2, 2), ("ring", 4, 4), ("ring", 4, 2)]  # (style, ranks, CP)


def _batch(vocab: int):
    sequences = random_sequences(3, 8, prompt_lens=(2, 7), response_lens=(1, 14), vocab=vocab)
    rng = random.Random(4)  # engine log-probs near the trainer's: TIS weights around 1, some truncated
    for sequence in sequences:
        sequence.engine_logprobs = [-rng.uniform(3.0, 5.5) for _ in range(sequence.response_len)]
    return sequences


@pytest.fixture(scope="module")
def groups(trainer_pool, tiny_model_dir, request):
    common = dict(max_tokens_per_microbatch=24, mini_batches_per_step=2, gradient_checkpointing=True,
                  use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, corrections=["importance_sampling"])
    specs = [trainer_spec(tiny_model_dir, **common)]
    specs += [trainer_spec(tiny_model_dir, num_ranks=ranks, context_parallel_size=cp, context_parallel_style=style,
                           **common) for style, ranks, cp in LAYOUTS]
    failed_before = request.session.testsfailed
    started = trainer_pool.take((specs[0], 1), *((spec, ranks) for spec, (_, ranks, _) in zip(specs[1:], LAYOUTS,
                                                                                              strict=True)))
    yield started[0], started[1:], specs[0]
    trainer_pool.give_back(started, healthy=request.session.testsfailed == failed_before)


def test_context_parallel_log_probs_and_gradients_equal_one_rank(groups):
    single, split, spec = groups
    sequences = _batch(single.vocab_size())
    expected_logprobs = single.compute_log_probs(sequences)
    expected_reference = single.compute_log_probs(sequences, reference=True)
    expected = single.loss_gradients(weighed(sequences, spec))
    scale = max(float(g.abs().max()) for g in expected.values())
    for (style, ranks, cp), group in zip(LAYOUTS, split, strict=True):
        layout = f"{style} CP {cp} on {ranks} ranks"
        for got, want in ((group.compute_log_probs(sequences), expected_logprobs),
                          (group.compute_log_probs(sequences, reference=True), expected_reference)):
            assert [len(values) for values in got] == [len(values) for values in want], layout
            worst = max(abs(a - b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
            assert worst <= LOGPROB_ATOL, (layout, worst)
        gradients = group.loss_gradients(weighed(sequences, spec))
        assert gradients.keys() == expected.keys()
        worst = max(float((gradients[name] - expected[name]).abs().max()) for name in expected)
        assert worst <= GRADIENT_RTOL * scale, (layout, worst, scale)


def test_context_parallel_trains_a_step_like_one_rank(groups):
    """One optimizer step (two mini-batches, so the second is off-policy and its old log-probs are a
    CP forward too): the same loss, KL, clip fraction and gradient norm."""
    single, split, spec = groups
    sequences = _batch(single.vocab_size())
    want = single.train_step(sequences)
    for (style, ranks, cp), group in zip(LAYOUTS, split, strict=True):
        got = group.train_step(sequences)
        for key in ("loss", "kl", "entropy", "grad_norm", "train_tokens", "tis_weight_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (style, ranks, cp, key)
