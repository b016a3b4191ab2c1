"""Routing replay in the trainer (actors/routing_replay.py) on the tiny Qwen3-MoE: with routes set,
every MoE layer sends each token to exactly the given experts, weighted by the trainer's own router
probabilities over them (renormalised, as the model's norm_topk_prob says), with the router's
gradient kept; a token without a route keeps its own top-k; a dense model is refused."""

import pytest
import torch

from rlsys.actors.routing_replay import RouteReplay, moe_routers
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

TOKENS = 10


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe"), TinyModelSpec(arch="qwen3_moe", num_experts=4,
                                                                         num_experts_per_tok=2))


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _expert_calls(model):
    """What each layer's experts received: (top-k indices, routing weights) per layer, in order."""
    calls = {}
    for layer in moe_routers(model):
        experts = model.model.layers[layer].mlp.experts
        experts.register_forward_hook(lambda module, args, output, layer=layer: calls.__setitem__(
            layer, (args[1].clone(), args[2].detach().clone())))
    return calls


def test_each_layer_routes_by_the_given_experts_weighted_by_the_trainers_own_probabilities(moe_dir):
    model = _model(moe_dir)
    routers = moe_routers(model)
    assert sorted(routers) == [0, 1]
    generator = torch.Generator().manual_seed(0)
    # two distinct experts of 4 per token and layer; the last token has none (the engine never forwarded it)
    routes = torch.stack([torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(2)])
                          for _ in range(TOKENS)])
    routes[-1] = -1
    input_ids = torch.randint(3, 60, (1, TOKENS), generator=generator)

    calls = _expert_calls(model)
    logits = {}
    for layer, router in routers.items():
        router.register_forward_hook(lambda module, args, output, layer=layer: logits.__setitem__(layer, output[0]))
    model(input_ids=input_ids)  # its own routing first
    own = {layer: indices for layer, (indices, _) in calls.items()}

    replay = RouteReplay(model)
    replay.set_routes(routes)
    model(input_ids=input_ids).logits.sum().backward()
    for layer in routers:
        indices, weights = calls[layer]
        assert torch.equal(indices[:-1], routes[:-1, layer]), layer  # exactly the engine's experts
        assert torch.equal(indices[-1], own[layer][-1])  # no route: its own top-k
        probabilities = torch.softmax(logits[layer].detach(), dim=-1)
        expected = probabilities.gather(1, indices)
        expected = expected / expected.sum(dim=-1, keepdim=True)  # tiny model: norm_topk_prob=True
        assert torch.allclose(weights, expected, atol=1e-6)
        assert routers[layer].weight.grad is not None and routers[layer].weight.grad.abs().sum() > 0
    differing = sum((torch.sort(routes[:-1, layer]).values != torch.sort(own[layer][:-1]).values).any(-1).sum().item()
                    for layer in routers)
    assert replay.counts.routed == 2 * (TOKENS - 1) and replay.counts.differing == differing > 0

    replay.set_routes(None)  # back to its own routing
    model(input_ids=input_ids)
    assert all(torch.equal(calls[layer][0], own[layer]) for layer in routers)


def test_a_replayed_route_equal_to_the_routers_own_changes_nothing(moe_dir):
    model = _model(moe_dir)
    input_ids = torch.randint(3, 60, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    calls = _expert_calls(model)
    plain = model(input_ids=input_ids).logits
    routes = torch.stack([calls[layer][0] for layer in sorted(calls)], dim=1)  # [tokens, layers, k]
    replay = RouteReplay(model)
    replay.set_routes(routes)
    assert torch.allclose(model(input_ids=input_ids).logits, plain, atol=1e-6)
    assert replay.counts.differing == 0


def test_a_dense_model_is_refused(tmp_path):
    dense = _model(make_tiny_model(tmp_path / "dense", TinyModelSpec(arch="qwen3")))
    with pytest.raises(ValueError, match="routing replay needs a mixture-of-experts model"):
        RouteReplay(dense)


def test_an_engines_answer_gives_compact_routes_of_every_forwarded_token():
    import base64

    import numpy as np

    from rlsys.rollout.engine import decode_routes
    from rlsys.rollout.sglang.client import EngineError

    routes = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4  # prompt 3 + response 3 - 1 tokens
    meta = {"routed_experts": base64.b64encode(routes.tobytes()).decode()}
    decoded = decode_routes(meta, (2, 2), tokens=5)
    assert decoded.dtype == np.uint8 and np.array_equal(decoded, routes)
    wide = {"routed_experts": base64.b64encode((routes * 100).tobytes()).decode()}  # ids up to 300
    assert decode_routes(wide, (2, 2), tokens=5).dtype == np.int16
    with pytest.raises(EngineError, match="hold 20 ids, not 6 tokens x 2 layers x 2 experts"):
        decode_routes(meta, (2, 2), tokens=6)
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        decode_routes({}, (2, 2), tokens=5)


def test_a_continued_sample_keeps_the_routes_its_tokens_were_sampled_with():
    import numpy as np

    from rlsys.records import Generation
    from rlsys.rollout.partial import GroupInFlight, group_from_json, group_to_json, stitch

    # prompt 2 tokens; first call sampled 2 (routes of 2 + 2 - 1 = 3 tokens); the continuation's
    # input is those 4 tokens, it samples 2 more: routes of 4 + 2 - 1 = 5 tokens
    before = Generation([1, 2], [3, 4], [-0.1, -0.2], "abort", 0, routes=np.full((3, 2, 2), 1, np.int16))
    answer = Generation([1, 2, 3, 4], [5, 6], [-0.3, -0.4], "stop", 1, routes=np.full((5, 2, 2), 2, np.int16))
    sample = stitch([1, 2], before, answer)
    assert sample.routes.shape == (5, 2, 2)  # prompt + response - 1 tokens
    assert (sample.routes[:3] == 1).all() and (sample.routes[3:] == 2).all()  # the first 3 as sampled
    group = GroupInFlight.new(_encoded([1, 2]), 2)
    group.samples[0] = before
    restored = group_from_json(__import__("json").loads(__import__("json").dumps(group_to_json(group))))
    assert np.array_equal(restored.samples[0].routes, before.routes) and restored.samples[0].routes.dtype == np.int16


def _encoded(token_ids):
    from rlsys.records import EncodedPrompt, PromptRecord

    return EncodedPrompt(PromptRecord(prompt="p", label="l"), token_ids)


def test_a_batch_lays_each_sequences_routes_where_its_tokens_are():
    import numpy as np

    from rlsys.actors.batching import build_micro_batch
    from rlsys.records import TrainSequence

    first = TrainSequence([1, 2, 3, 4], 2, routes=np.full((3, 2, 2), 1, np.int16))
    second = TrainSequence([5, 6, 7], 1)  # no routes: its own routing
    packed = build_micro_batch([first, second], [0, 1], pad_id=0, device=torch.device("cpu"), packed=True)
    assert packed.routes.shape == (1, 7, 2, 2)
    assert (packed.routes[0, :3] == 1).all() and (packed.routes[0, 3:] == -1).all()
    padded = build_micro_batch([first, second], [0, 1], pad_id=0, device=torch.device("cpu"), packed=False)
    assert padded.routes.shape == (2, 4, 2, 2) and (padded.routes[1] == -1).all()
    assert build_micro_batch([second], [0], pad_id=0, device=torch.device("cpu"), packed=True).routes is None
    with pytest.raises(ValueError, match="routes of shape"):
        build_micro_batch([TrainSequence([1, 2], 1, routes=np.zeros((2, 2, 2), np.int16))], [0], pad_id=0,
                          device=torch.device("cpu"), packed=True)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.routing_replay=rollout", "rollout.generate_function=rlsys.rollout.trajectory:single_turn"],
     "routing_replay replays the routes of single engine calls"),
    (["rollout.routing_replay=rollout", "trainer.context_parallel_size=2"],
     "routing_replay with trainer.context_parallel_size > 1 is not supported yet"),
])
def test_routing_replay_where_it_cannot_apply_is_refused(tmp_path, moe_dir, overrides, message):
    from rlsys.config import ConfigError, load_config
    from tests.helpers import write_config

    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path / "c.yaml", moe_dir), overrides)


def test_routing_replay_of_a_dense_model_is_refused_before_anything_starts(tmp_path):
    from rlsys.config import ConfigError, load_config
    from rlsys.run.assets import load_assets
    from tests.helpers import write_config

    dense = make_tiny_model(tmp_path / "dense", TinyModelSpec(arch="qwen3"))
    config = load_config(write_config(tmp_path / "c.yaml", dense), ["rollout.routing_replay=rollout"])
    with pytest.raises(ConfigError, match="is not a mixture-of-experts model .* set rollout.routing_replay=off"):
        load_assets(config)
