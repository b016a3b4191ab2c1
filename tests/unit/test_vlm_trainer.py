"""A vision-language model on the trainer's side (#62), one rank in this process: the log-probs of
sequences whose images the engine expanded equal transformers' own forward of the same input
(processor output, its rotary positions), packed and padded alike, with text-only sequences beside
them and in batches of their own (where a dummy image keeps the vision tower's collectives running);
a step trains the vision tower unless model.freeze_vision, and a sync sends the engine's names."""

import random

import pytest
import torch

from rlsys.actors.weights_out import engine_parameters
from tests.helpers import image_sensitive_vlm, png_bytes, trainer_spec


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return image_sensitive_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def cases(vlm_dir):
    """(TrainSequence, transformers' inputs for it) for prompts of 0, 1 and 2 images, each with a
    response of random tokens, as the engine would have returned them (placeholders expanded)."""
    return _cases(vlm_dir, with_a_sampled_image_token=True)


def _cases(vlm_dir, with_a_sampled_image_token: bool):
    from transformers import AutoProcessor

    from rlsys.multimodal.images import decoded
    from rlsys.records import TrainSequence

    processor = AutoProcessor.from_pretrained(vlm_dir)
    rng = random.Random(0)
    out = []
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for images, question, sampled_image_token in [([png_bytes((255, 0, 0), (56, 56))], "red?", False),
                                                  ([png_bytes((0, 0, 255), (60, 30)), png_bytes((0, 255, 0), (40, 40))],
                                                   "which?", False),
                                                  ([], "3 4>", False),
                                                  ([png_bytes((9, 9, 9), (28, 28))], "dark?", True)][
                                                      :4 if with_a_sampled_image_token else 3]:
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=[text], images=[decoded(image) for image in images] or None, return_tensors="pt")
        prompt = inputs["input_ids"][0].tolist()
        response = [rng.randrange(3, 80) for _ in range(6)]
        if sampled_image_token:  # the policy sampled the image token: text, to the engine
            response[2] = image_token
        out.append((TrainSequence(prompt + response, prompt_len=len(prompt), images=tuple(images)), inputs))
    return out


def _reference_logprobs(vlm_dir, cases) -> list[list[float]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    image_token = model.config.image_token_id
    result = []
    for sequence, inputs in cases:
        ids = torch.tensor([sequence.token_ids])
        extra = {}
        if sequence.images:
            extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                     "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                                  (0, sequence.response_len))}
        sampled = [i for i, token in enumerate(sequence.token_ids) if token == image_token and i >= sequence.prompt_len]
        if sampled:
            # transformers' own rule for the prompt, then text positions; the sampled image tokens
            # get their text embedding as extra "features" after the image's (they come after it)
            with torch.no_grad():
                prompt_positions, _ = model.model.get_rope_index(
                    ids[:, :sequence.prompt_len], image_grid_thw=inputs["image_grid_thw"],
                    mm_token_type_ids=inputs["mm_token_type_ids"])
                after = prompt_positions.max() + 1 + torch.arange(sequence.response_len)
                extra["position_ids"] = torch.cat([prompt_positions, after.expand(3, 1, -1)], dim=-1)
                features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
                text = model.get_input_embeddings()(torch.tensor([image_token] * len(sampled)))
                extra["mm_encoder_outputs"] = {"image": type("Out", (), {"pooler_output": (*features, text)})()}
                del extra["pixel_values"]
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, sequence.prompt_len - 1:-1]
        response = torch.tensor(sequence.token_ids[sequence.prompt_len:])
        result.append(torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0].tolist())
    return result


def _worker(vlm_dir, **fields):
    from rlsys.actors.trainer import TrainerWorker

    freeze = fields.pop("freeze_vision", False)
    spec = trainer_spec(vlm_dir, num_ranks=1, **fields)
    spec.model.freeze_vision = freeze
    worker = TrainerWorker(spec, 0, 1)
    worker.setup(*worker.rendezvous_address())
    return worker


def test_log_probs_equal_transformers_packed_and_padded_with_text_only_batches(vlm_dir, cases):
    expected = torch.tensor([lp for row in _reference_logprobs(vlm_dir, cases) for lp in row])
    sequences = [sequence for sequence, _ in cases]
    for packing in (True, False):
        worker = _worker(vlm_dir, packing=packing, max_tokens_per_microbatch=64, micro_batch_size=1)
        try:
            # one micro-batch each (the text-only one with a dummy image), then all three in one
            got_alone = torch.tensor([lp for row in worker.compute_log_probs(sequences) for lp in row])
            worker.spec.trainer.max_tokens_per_microbatch = 4096
            worker.spec.trainer.micro_batch_size = 8
            got_together = torch.tensor([lp for row in worker.compute_log_probs(sequences) for lp in row])
        finally:
            worker.shutdown()
        # fp32: a few ulps of the largest magnitude per op; the orders of the sums differ
        bound = 64 * torch.finfo(torch.float32).eps * expected.abs().max().item()
        assert (got_alone - expected).abs().max().item() <= bound, packing
        assert (got_together - expected).abs().max().item() <= bound, packing


@pytest.mark.parametrize("freeze", [False, True])
def test_a_step_trains_the_vision_tower_unless_frozen_and_a_sync_sends_the_engines_names(vlm_dir, cases, freeze):
    worker = _worker(vlm_dir, lr=1e-2, freeze_vision=freeze)
    try:
        sequences = [sequence for sequence, _ in cases]
        for sequence, advantage in zip(sequences, (1.0, -1.0, 0.5, -0.5), strict=True):
            sequence.advantage = advantage
        before = {name: param.detach().clone() for name, param in worker.model.named_parameters()}
        metrics = worker.train_step([sequences])
        assert metrics and all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        changed = {name for name, param in worker.model.named_parameters() if not torch.equal(param, before[name])}
        vision = {name for name in before if name.startswith("model.visual.")}
        assert vision and changed - vision  # the language model learns either way
        assert changed & vision == (set() if freeze else vision)
        names = [name for name, _ in engine_parameters(worker.models, worker.spec.model.freeze_vision)[0]]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
        assert not any(name.startswith("model.language_model.") or name.startswith("model.visual.") for name in names)
        assert any(name.startswith("visual.") for name in names) != freeze
    finally:
        worker.shutdown()



def test_lora_adapts_the_language_model_only_and_a_sync_sends_merged_weights_under_the_engines_names(vlm_dir, cases):
    """model.lora on a vision-language model: adapters on the language model's linear layers (as
    verl and TRL put them), none in the vision tower; a step trains only them, and a sync sends every
    weight once under the engine's names, the adapted ones merged."""
    from rlsys.actors.lora import is_adapter_parameter

    worker = _worker(vlm_dir, lr=1e-2, lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"})
    try:
        adapters = [name for name, _ in worker.model.named_parameters() if is_adapter_parameter(name)]
        assert adapters and all(name.startswith("model.language_model.") for name in adapters)
        sequences = [sequence for sequence, _ in cases]
        for sequence, advantage in zip(sequences, (1.0, -1.0, 0.5, -0.5), strict=True):
            sequence.advantage = advantage
        before = {name: param.detach().clone() for name, param in worker.model.named_parameters()}
        worker.train_step([sequences])
        changed = {name for name, param in worker.model.named_parameters() if not torch.equal(param, before[name])}
        assert changed and all(is_adapter_parameter(name) for name in changed)
        named, merge = engine_parameters(worker.models, worker.spec.model.freeze_vision)
        names = [name for name, _ in named]
        assert len(names) == len(set(names)) and "visual.blocks.0.attn.qkv.weight" in names
        assert "model.layers.0.self_attn.q_proj.weight" in names and not any(".lora_" in name for name in names)
        q_proj = dict(named)["model.layers.0.self_attn.q_proj.weight"]
        assert not torch.equal(merge("model.layers.0.self_attn.q_proj.weight", q_proj), q_proj)  # W + s B A
    finally:
        worker.shutdown()


def test_the_reference_model_and_gradient_checkpointing_take_the_images_too(vlm_dir, cases):
    """With a KL term the frozen reference scores the same images (KL 0 on the first step, where
    policy and reference are one model); with gradient checkpointing (the vision blocks' and the
    decoder layers') the step's loss, gradient norm and update are those without it."""
    results = []
    for checkpointing in (False, True):
        worker = _worker(vlm_dir, lr=1e-2, use_kl_loss=True, kl_coef=0.1, gradient_checkpointing=checkpointing)
        try:
            sequences = [sequence for sequence, _ in cases]
            for sequence, advantage in zip(sequences, (1.0, -1.0, 0.5, -0.5), strict=True):
                sequence.advantage = advantage
            metrics = worker.train_step([sequences])
            results.append(metrics)
        finally:
            worker.shutdown()
    plain, checkpointed = results
    assert plain["kl"] == 0.0 and checkpointed["kl"] == 0.0
    # fp32, the same ops recomputed: the loss and the gradient's norm agree to rounding (the weights are
    # not compared: AdamW's first step is ~lr * sign(g), which rounding flips where a gradient is ~0)
    assert abs(plain["grad_norm"] - checkpointed["grad_norm"]) <= 1e-5 * plain["grad_norm"]
    assert abs(plain["loss"] - checkpointed["loss"]) <= 1e-5 * max(abs(plain["loss"]), 1e-6)


def test_qwen3_vl_trains_through_the_same_path_its_log_probs_equal_transformers(tmp_path_factory):
    """Qwen3-VL (`--arch qwen3_vl`: a Qwen3 language model with interleaved 3-row RoPE, a deepstack
    merger feeding a decoder layer): the trainer's log-probs equal transformers' own forward, packed
    and padded, beside a text-only sequence; a step trains the vision tower too, and a sync sends the
    names SGLang's qwen3_vl loader takes (it strips `model.language_model.` and `model.` itself)."""
    vlm_dir = image_sensitive_vlm(tmp_path_factory.mktemp("qwen3-vl"), "qwen3_vl")
    cases = _cases(vlm_dir, with_a_sampled_image_token=False)
    expected = torch.tensor([lp for row in _reference_logprobs(vlm_dir, cases) for lp in row])
    sequences = [sequence for sequence, _ in cases]
    bound = 64 * torch.finfo(torch.float32).eps * expected.abs().max().item()
    for packing in (True, False):
        worker = _worker(vlm_dir, packing=packing, lr=1e-2)
        try:
            got = torch.tensor([lp for row in worker.compute_log_probs(sequences) for lp in row])
            assert (got - expected).abs().max().item() <= bound, packing
            if packing:
                for sequence, advantage in zip(sequences, (1.0, -1.0, 0.5), strict=True):
                    sequence.advantage = advantage
                before = {name: param.detach().clone() for name, param in worker.model.named_parameters()}
                worker.train_step([sequences])
                changed = {name for name, param in worker.model.named_parameters()
                           if not torch.equal(param, before[name])}
                assert any(name.startswith("model.visual.deepstack_merger_list.") for name in changed)
                assert any(name.startswith("model.language_model.") for name in changed)
                names = [name for name, _ in engine_parameters(worker.models, False)[0]]
                assert "model.visual.blocks.0.attn.qkv.weight" in names and "lm_head.weight" in names
        finally:
            worker.shutdown()
