"""Per-request sampling seeds on a real CPU engine (rollout/seeds.py, and the server side in
rollout/sglang/cpu_compat/site/rlsys_seeded_sampling.py): a seeded sample's tokens depend on its
seed and its prompt, not on what the engine drew before, on its batch-mates (greedy requests among
them, which send the whole batch down SGLang's filtered sampling path) or on their order."""

import ray

from rlsys.records import SamplingParams
from rlsys.rollout.seeds import sample_seeds, train_prompt_seed
from tests.helpers import standing_rollout

PROMPTS = [[5, 9, 14, 3], [40, 41, 42], [12, 65, 13, 65, 14], [7, 7, 20], [31, 2], [60, 61, 62, 63]]
N = 4
# Eight tokens a sample at temperature 1, stop tokens ignored: 6 x 4 samples x 8 tokens, each drawn
# from the untrained model's spread-out distribution.
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)


def _tokens(generations) -> list[list[int]]:
    return [list(g.response_ids) for g in generations]


def test_a_seeded_sample_draws_the_same_tokens_whatever_the_engine_drew_before_and_whoever_shares_its_batch(
        quickstart_engines, tmp_path):
    seeds = [train_prompt_seed(0, 0, index) for index in range(len(PROMPTS))]
    with standing_rollout("quickstart", tmp_path) as rollout:
        together = _tokens(rollout.generate(PROMPTS, SAMPLING, N, seeds=seeds))
        assert all(len(tokens) == 8 for tokens in together)

        rollout.fleet.restart_random_streams(12345)  # another state of the engine's own generator
        rollout.generate(PROMPTS, SAMPLING, N)  # and unseeded draws from it in between
        alone = [tokens for prompt, seed in zip(PROMPTS, seeds, strict=True)
                 for tokens in _tokens(rollout.generate([prompt], SAMPLING, N, seeds=[seed]))]
        assert alone == together

        # reversed, and beside greedy requests (SGLang: top_k=1 for the whole batch's path) and
        # unseeded ones, in one engine request
        engine = rollout.fleet.engines[0]
        rows = [prompt for prompt in PROMPTS for _ in range(N)]
        row_seeds = [seed for prompt_seed in seeds for seed in sample_seeds(prompt_seed, N)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        mixed_inputs = list(reversed(rows)) + PROMPTS + PROMPTS
        mixed_params = [SAMPLING] * len(rows) + [greedy] * len(PROMPTS) + [SAMPLING] * len(PROMPTS)
        mixed_seeds = list(reversed(row_seeds)) + [None] * (2 * len(PROMPTS))
        mixed = _tokens(ray.get(engine.generate_each.remote(mixed_inputs, mixed_params, mixed_seeds)))
        assert list(reversed(mixed[:len(rows)])) == together

        # another seed, another draw: the tokens did come from the seeds
        other = _tokens(rollout.generate(PROMPTS, SAMPLING, N, seeds=[seed + 1 for seed in seeds]))
        differing = sum(a != b for a, b in zip(other, together, strict=True))
        assert differing >= len(together) // 2, (differing, len(together))
