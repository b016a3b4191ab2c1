"""A vision-language model on the real SGLang server's CPU path (#62 so far: serving and the
trainer's side of a log-prob; the run itself is not wired yet): the tiny Qwen2.5-VL
(`rlsys make-tiny-model --arch qwen2_5_vl`) takes prompts as token ids with one image placeholder
per image and the images beside them (`image_data`); the engine expands each placeholder exactly as
transformers' processor does, and its log-probs of what it sampled are transformers' own within fp32
rounding (issue bound: mean |diff| <= 1e-5; measured 1.2e-7 mean, 4.8e-7 most on the first prompt).
One SGLang start: the one vision-language engine the suite's budget holds (tests/conftest.py)."""

import base64
import io

import pytest


def _png(color, size) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm_engine(tmp_path_factory):
    from rlsys.config import EngineConfig, ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, SGLangServer
    from rlsys.system.backend import make_backend
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("vlm"), TinyModelSpec(arch="qwen2_5_vl"))
    spec = ServerSpec(ModelConfig(path=str(model)), EngineConfig(skip_tokenizer_init=True, context_length=128,
                                                                max_total_tokens=4096, request_timeout_s=300))
    server = SGLangServer(spec, make_backend(False), "vlm", tmp_path_factory.mktemp("logs") / "vlm.log")
    server.start(spec.startup_timeout_s)
    yield model, server
    server.stop()


def test_the_engine_expands_images_as_the_processor_does_and_scores_as_transformers(vlm_engine):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.multimodal.images import decoded

    model_dir, server = vlm_engine
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [  # (images, question): one image; two of other sizes (2 and 4 image tokens)
        ([_png((255, 0, 0), (56, 56))], "red?"),
        ([_png((0, 0, 255), (60, 30)), _png((0, 255, 0), (40, 40))], "which?"),
    ]
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(images)
                                             + [{"type": "text", "text": question}]}], add_generation_prompt=True)
             for images, question in prompts]
    answers = server.client.generate({
        "input_ids": [processor.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts],
        "image_data": [[base64.b64encode(image).decode() for image in images] for images, _ in prompts],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8},
        "return_logprob": True, "return_prompt_token_ids": True,
    })
    gaps = []
    for (images, _), text, answer in zip(prompts, texts, answers, strict=True):
        inputs = processor(text=[text], images=[decoded(image) for image in images], return_tensors="pt")
        expanded = inputs["input_ids"][0].tolist()
        assert answer["prompt_token_ids"] == expanded  # the placeholder became the image's merged patches
        pairs = answer["meta_info"]["output_token_logprobs"]
        response = [int(token) for _, token, *_ in pairs]
        sequence = torch.tensor([expanded + response])
        token_types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.int)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=sequence, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=token_types).logits
        scored = torch.log_softmax(logits[0, len(expanded) - 1:-1], -1).gather(-1, torch.tensor(response)[:, None])
        gaps += (scored[:, 0] - torch.tensor([float(lp) for lp, *_ in pairs])).abs().tolist()
    assert sum(gaps) / len(gaps) <= 1e-5 and max(gaps) <= 1e-4, gaps
