"""Engine vs trainer log-probs of a vision-language model's samples with images, one SGLang server
(the CPU path, through rlsys's launcher) and one trainer rank in this process, fp32 on both sides.

    .venv/bin/python bench/vlm_logprobs.py --arch qwen3_vl --out bench/results/vlm-logprobs-qwen3-vl.json

The tiny model of `rlsys make-tiny-model --arch ARCH`, its mergers' output made 8x larger so that
its answers depend on the image (at random init another image moves a log-prob by ~1e-5, too little
to tell a wrong image feature from a right one): the JSON says how much another image moves them
(`another_image_mean_abs_change`) beside the engine/trainer difference (`mean_abs_diff`).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (colour, size in pixels, the prompt's text ids after the image)
PROMPTS = [((255, 0, 0), (64, 64), [5, 6, 7]), ((0, 0, 255), (60, 30), [9, 4]), ((20, 200, 20), (40, 40), [11, 12, 13])]


def image_sensitive(model_dir: Path) -> list[str]:
    """Scale the output layers of the vision tower's mergers by 8; the names scaled."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    scaled = [name for name in weights if any(part in name for part in (
        "merger.mlp.2.", "merger.linear_fc2.", "deepstack_merger_list.0.linear_fc2."))]
    for name in scaled:
        weights[name] = weights[name] * 8
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return scaled


def engine_samples(model_dir: Path, log: Path) -> list[tuple[list[int], int, bytes, list[float]]]:
    """Per prompt: (expanded prompt + sampled ids, prompt length, the image, the engine's log-probs)."""
    from rlsys.config import EngineConfig, ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, SGLangServer
    from rlsys.system.backend import make_backend
    from tests.helpers import png_bytes

    config = json.loads((model_dir / "config.json").read_text())
    placeholder = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    server = SGLangServer(ServerSpec(ModelConfig(path=str(model_dir)), EngineConfig(context_length=256)),
                          make_backend(False, "float32"), "vlm", log)
    server.start(600)
    samples = []
    try:
        for color, size, text in PROMPTS:
            image = png_bytes(color, size)
            answer = server.client.generate({
                "input_ids": placeholder + text, "image_data": base64.b64encode(image).decode(),
                "return_prompt_token_ids": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}})
            answer = answer[0] if isinstance(answer, list) else answer  # one prompt: SGLang answers one object
            prompt = answer["prompt_token_ids"]
            samples.append((prompt + answer["output_ids"], len(prompt), image,
                            [logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]]))
    finally:
        server.stop()
    return samples


def trainer_logprobs(model_dir: Path, sequences) -> list[list[float]]:
    from rlsys.actors.trainer import TrainerWorker
    from tests.helpers import trainer_spec

    worker = TrainerWorker(trainer_spec(model_dir, num_ranks=1), 0, 1)
    worker.setup(*worker.rendezvous_address())
    try:
        return worker.compute_log_probs(sequences)
    finally:
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    from rlsys.records import TrainSequence
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
    from tests.helpers import png_bytes

    with tempfile.TemporaryDirectory() as work:
        model_dir = make_tiny_model(Path(work) / "model", TinyModelSpec(arch=args.arch))
        image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
        scaled = image_sensitive(model_dir)
        samples = engine_samples(model_dir, Path(work) / "engine.log")
        sequences = [TrainSequence(ids, prompt_len=prompt_len, images=(image,)) for ids, prompt_len, image, _ in samples]
        trainer = trainer_logprobs(model_dir, sequences)
        grey = [TrainSequence(s.token_ids, prompt_len=s.prompt_len, images=(png_bytes((128, 128, 128), size),))
                for s, (_, size, _) in zip(sequences, PROMPTS, strict=True)]
        other = trainer_logprobs(model_dir, grey)
    diffs = [abs(e - t) for (_, _, _, engine), row in zip(samples, trainer, strict=True)
             for e, t in zip(engine, row, strict=True)]
    moved = [abs(a - b) for row, row_other in zip(trainer, other, strict=True) for a, b in zip(row, row_other, strict=True)]
    result = {"arch": args.arch, "samples": len(samples), "tokens": len(diffs),
              "image_tokens_per_prompt": [s.token_ids[:s.prompt_len].count(image_token) for s in sequences],
              "mean_abs_diff": sum(diffs) / len(diffs), "max_abs_diff": max(diffs),
              "another_image_mean_abs_change": sum(moved) / len(moved), "another_image_max_abs_change": max(moved),
              "scaled": scaled, "dtype": "float32", "engine": "sglang 0.5.23, CPU"}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
