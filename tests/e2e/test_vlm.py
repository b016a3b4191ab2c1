"""A vision-language model end to end (#62) on the real SGLang server's CPU path, through one
standing engine set of the tiny Qwen2.5-VL (`rlsys make-tiny-model --arch qwen2_5_vl`): the one
vision-language engine the suite's budget holds (tests/conftest.py).

The engine takes a prompt's token ids with one placeholder per image and the images beside them
(`image_data`), expands each placeholder exactly as transformers' processor does, and its log-probs
of what it sampled are transformers' and the trainer's own within fp32 rounding (issue bound: mean
|diff| <= 1e-5; measured 1.2e-7 mean, 4.8e-7 most against transformers). A run on
configs/quickstart_vlm.yaml trains with the engines verified equal to the trainer after every sync,
resumes from its checkpoint on the checkpointed weights, and exports a model and processor that
transformers loads and that answers the eval prompts as the run's eval did."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import ray
import torch

from rlsys.observability.metrics import read_metrics
from tests.conftest import standing_set, stop_standing_set
from tests.helpers import REPO, image_sensitive_vlm, png_bytes, train_command, trainer_spec


@pytest.fixture(scope="module")
def vlm_model(tmp_path_factory):
    return image_sensitive_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def vlm_engines(ray_cluster, vlm_model, tmp_path_factory):
    """Standing engines for configs/quickstart_vlm.yaml on the tiny VLM, for this module's tests."""
    yield standing_set("vlm", "quickstart_vlm.yaml", [f"model.path={vlm_model}"],
                       tmp_path_factory.getbasetemp() / "standing-engines")
    stop_standing_set("vlm")


def test_the_engine_expands_images_as_the_processor_does_and_scores_as_transformers_and_the_trainer(
        vlm_model, vlm_engines):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.actors.trainer import TrainerWorker
    from rlsys.data.tokenizer import load_tokenizer
    from rlsys.multimodal.images import decoded
    from rlsys.records import PromptRecord, SamplingParams, TrainSequence
    from rlsys.rollout.standing import engine_handle, service
    from rlsys.run.assets import _encode

    processor = AutoProcessor.from_pretrained(vlm_model)
    model = AutoModelForImageTextToText.from_pretrained(vlm_model, dtype=torch.float32)
    records = [PromptRecord("red?", "r", images=(png_bytes((255, 0, 0), (56, 56)),)),  # one image, 4 tokens
               PromptRecord("which?", "g", images=(png_bytes((0, 0, 255), (60, 30)), png_bytes((0, 255, 0), (40, 40))))]
    tokenizer = load_tokenizer(vlm_model)
    prompts = [_encode(tokenizer, record, chat=True) for record in records]  # one placeholder per image
    engine = engine_handle(ray.get(service("vlm").record.remote()), 0)
    generations = ray.get(engine.generate.remote(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), 1,
                                                 [record.images for record in records]))
    worker = TrainerWorker(trainer_spec(vlm_model, num_ranks=1), 0, 1)
    worker.setup(*worker.rendezvous_address())
    try:
        trainer_logprobs = worker.compute_log_probs([
            TrainSequence(g.prompt_ids + g.response_ids, prompt_len=len(g.prompt_ids), images=record.images)
            for g, record in zip(generations, records, strict=True)])
    finally:
        worker.shutdown()
    to_transformers, to_trainer = [], []
    for record, generation, ours in zip(records, generations, trainer_logprobs, strict=True):
        content = [{"type": "image"}] * len(record.images) + [{"type": "text", "text": record.prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=[text], images=[decoded(image) for image in record.images], return_tensors="pt")
        expanded = inputs["input_ids"][0].tolist()
        assert generation.prompt_ids == expanded  # each placeholder became the image's merged patches
        response = generation.response_ids
        sequence = torch.tensor([expanded + response])
        token_types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.int)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=sequence, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=token_types).logits
        scored = torch.log_softmax(logits[0, len(expanded) - 1:-1], -1).gather(-1, torch.tensor(response)[:, None])
        engine_logprobs = torch.tensor(generation.logprobs)
        to_transformers += (scored[:, 0] - engine_logprobs).abs().tolist()
        to_trainer += (torch.tensor(ours) - engine_logprobs).abs().tolist()
    for gaps in (to_transformers, to_trainer):
        assert sum(gaps) / len(gaps) <= 1e-5 and max(gaps) <= 1e-4, gaps


def test_a_vlm_run_syncs_verified_weights_resumes_and_exports_a_model_that_answers_as_its_eval(
        tmp_path, vlm_model, ray_address, vlm_engines):
    """Four steps on the square-colour task with every sync verified (engine == trainer, the
    vision tower included), eval at steps 0 and 2, checkpoints at 2 and 4; the run resumed from
    step 2 continues with the checkpointed data position and weights; `rlsys export` of step 2 loads
    in transformers (model and processor) and answers step 2's eval prompts as the run's eval did."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.config import load_config
    from rlsys.data.tasks import generate_task
    from rlsys.multimodal.images import decoded
    from rlsys.records import PromptRecord
    from rlsys.run.assets import _encode

    run_dir = tmp_path / "run"
    overrides = ["trainer.total_steps=4", "checkpoint.interval=2", "eval.interval=2", "weight_sync.verify=true",
                 "trainer.lr=0.01", "data.prompts_per_step=8", "logging.samples_per_step=8", ray_address, vlm_engines]
    result = subprocess.run(train_command("quickstart_vlm.yaml", vlm_model, run_dir, *overrides), cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # verify after every sync, its image probe the same image each time: a vision tower the engine
    # did not take, or image features it kept from older weights (its embedding cache: 6.4e-4 after
    # two such steps), would show here
    verified = [float(found) for found in re.findall(r"mean \|logprob diff\| (\S+)", result.stdout)]
    assert len(verified) >= 4 and max(verified) <= 1e-5, verified
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["logprob_mismatch"] < 1e-5 for r in rows)  # mean |engine - trainer| of the sampled tokens' log-probs
    shown = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all(row["images"] and row["images"][0].startswith("data:image/png;base64,") for row in shown)

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000004")
    result = subprocess.run(train_command("quickstart_vlm.yaml", vlm_model, resumed_dir, *overrides,
                                          "checkpoint.resume=auto"), cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_00000002" in result.stdout
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3] and resumed[:2] == rows[:2]
    assert [(r["data_epoch"], r["data_index"]) for r in resumed] == [(r["data_epoch"], r["data_index"]) for r in rows]
    # on the checkpointed weights (version 2), engine and trainer alike: its step-2 eval is the run's
    assert resumed[2]["weight_version"] == 2 and resumed[2]["eval_reward_mean"] == rows[2]["eval_reward_mean"]

    export = subprocess.run([sys.executable, "-m", "rlsys.cli", "export", str(run_dir), str(tmp_path / "hf"),
                             "--step", "2"], capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    config = load_config(run_dir / "config.yaml")
    _, eval_examples = generate_task(config.data.synthetic)
    evaluated = [row for row in shown if row["step"] == 2 and row["source"] == "eval"]
    assert evaluated
    placeholder = [model.config.vision_start_token_id, model.config.image_token_id, model.config.vision_end_token_id]
    for example, row in zip(eval_examples, evaluated, strict=False):
        ids = _encode(processor.tokenizer, PromptRecord(example.prompt, example.label, images=example.images),
                      chat=False, image_placeholder=placeholder)  # as the run encodes it
        inputs = processor.image_processor(images=[decoded(example.images[0])], return_tensors="pt")
        expanded = _expanded(ids, model.config.image_token_id, inputs["image_grid_thw"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([expanded]), pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=(torch.tensor([expanded]) == model.config.image_token_id).int()).logits
        answer = processor.tokenizer.decode([int(logits[0, -1].argmax())], skip_special_tokens=False)
        assert answer == row["response"], row


def _expanded(ids: list[int], image_token: int, grid) -> list[int]:
    """The placeholder as the processor expands it: one token per 2 x 2 merged patches."""
    at = ids.index(image_token)
    return ids[:at] + [image_token] * int(grid[0].prod() // 4) + ids[at + 1:]


def test_a_run_on_conversational_prompts_sees_each_image_where_its_message_puts_it(
        tmp_path, vlm_model, ray_address, vlm_engines):
    """A dataset of chat messages with image parts (a file path, a data: URI), rendered by the chat
    template (rlsys/data/conversations.py), on the module's standing engines: two steps where the
    engine's and the trainer's log-probs of every sampled token agree (the image in the same place
    and expanded alike on both sides), and the shown samples carry their images."""
    import base64

    from rlsys.config import SyntheticTaskConfig
    from rlsys.data.tasks import generate_task

    train, eval_ = generate_task(SyntheticTaskConfig(task="square_color", num_train=16, num_eval=8))
    (tmp_path / "img").mkdir()

    def row(index: int, example) -> dict:
        if index % 2:
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                        + base64.b64encode(example.images[0]).decode()}}
        else:
            (tmp_path / "img" / f"{index}.png").write_bytes(example.images[0])
            image = {"type": "image", "image": f"img/{index}.png"}
        return {"prompt": [{"role": "user", "content": [image, {"type": "text", "text": example.prompt}]}],
                "label": example.label}

    for name, examples in (("train", train), ("eval", eval_)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row(i, e)) + "\n" for i, e in enumerate(examples)))
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command("quickstart_vlm.yaml", vlm_model, run_dir, "data.synthetic=null",
                                          f"data.train_path={tmp_path / 'train.jsonl'}",
                                          f"data.eval_path={tmp_path / 'eval.jsonl'}", "data.prompts_per_step=8",
                                          "trainer.total_steps=2", "eval.interval=100", ray_address, vlm_engines),
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and all(r["logprob_mismatch"] < 1e-5 for r in rows)
    shown = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert shown and all(s["prompt"] == "color?" and len(s["images"]) == 1 for s in shown)
