"""Everything a run needs that can be checked before any actor starts: model files, tokenizer,
prompt splits (tokenised), the reward function (loaded once to check it) and the stop tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.config import ConfigError, EvalSetConfig, RunConfig
from rlsys.data.datasets import Columns, DatasetError, load_splits, read_records
from rlsys.data.tokenizer import load_tokenizer
from rlsys.environments.task_environment import load_task_environment
from rlsys.model.architecture import (
    read_model_config,
    refuse_untrained_vision_language,
    text_settings,
)
from rlsys.model.built import trained_model
from rlsys.multimodal.image_load import ImageLoad
from rlsys.records import EncodedPrompt, PromptRecord
from rlsys.rewards.loading import load_reward_function

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


@dataclass
class EvalSetAssets:
    """A named eval set (eval.datasets), read and tokenised."""

    config: EvalSetConfig
    prompts: list[EncodedPrompt]
    skipped_rows: int
    too_long_prompts: int


@dataclass
class RunAssets:
    tokenizer: object
    train: list[EncodedPrompt]
    eval: list[EncodedPrompt]
    stop_token_ids: list[int]
    skipped_rows: int
    too_long_prompts: int
    eval_sets: list[EvalSetAssets] = field(default_factory=list)
    image_load: ImageLoad | None = None  # what the training prompts' images take of a micro-batch (the plan's)
    # task.verifiers / task.openenv: the loaded environment (rlsys/environments/), None without one.
    environment: object | None = None


def _encode(tokenizer, record: PromptRecord, chat: bool, system_prompt: str | None = None,
            image_placeholder: list[int] | None = None) -> list[int]:
    """A prompt's token ids. With images, each is one placeholder (`image_placeholder`: Qwen2.5-VL's
    vision start, image pad and vision end) that the engine expands to the image's tokens: where the
    chat template puts an image part (before the text, as Qwen's processor examples do), else before
    the prompt's own ids. A conversational prompt (`record.messages`) is rendered by the chat template
    whatever `chat` says (its images where their parts stand); data.system_prompt goes first unless
    it has a system turn of its own."""
    if chat or record.messages:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        if record.messages:
            messages = [*(messages if record.messages[0]["role"] != "system" else []), *record.messages]
        else:
            content = record.prompt if not record.images else \
                [{"type": "image"} for _ in record.images] + [{"type": "text", "text": record.prompt}]
            messages.append({"role": "user", "content": content})
        # Rendered to text, then tokenised without added special tokens (the template holds them
        # all): the same ids whatever apply_chat_template(tokenize=True) returns in a given version.
        text = tokenizer.apply_chat_template(messages, tools=list(record.tools) or None, add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(record.prompt, add_special_tokens=True)["input_ids"]
    return ids if not record.images else list(image_placeholder) * len(record.images) + ids


def _stop_token_ids(config: RunConfig, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if config.rollout.engine.skip_tokenizer_init:
        # Without its tokenizer the engine cannot match stop strings; single tokens still work.
        for stop in config.rollout.stop:
            encoded = tokenizer(stop, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise ConfigError(
                    f"invalid config: rollout.stop entry {stop!r} is {len(encoded)} tokens, but with "
                    "rollout.engine.skip_tokenizer_init the engine only stops on single tokens"
                )
            ids.append(encoded[0])
    return ids


# The tokenizer's own JSON files, as transformers reads them (config.json is read_model_config's).
_TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                         "vocab.json")


def _load_tokenizer_checked(config: RunConfig, tokenizer_dir: Path):
    """`load_tokenizer`; when it fails on a file that is not JSON (a copy cut short, an edit gone
    wrong), a ConfigError naming the file and the setting that points at it. The files are looked
    at only after a failure: a good tokenizer.json is parsed once, by transformers."""
    option = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
    try:
        return load_tokenizer(tokenizer_dir)
    except Exception:
        for path in (tokenizer_dir / name for name in _TOKENIZER_JSON_FILES):
            if not path.is_file():
                continue
            try:
                content = json.loads(path.read_bytes())
            except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
                raise ConfigError(f"invalid config: {option} {tokenizer_dir}: {path} is not valid JSON ({error}); "
                                  f"point {option} at a complete tokenizer") from None
            if not isinstance(content, dict):
                raise ConfigError(f"invalid config: {option} {tokenizer_dir}: {path} must hold a JSON object, "
                                  f"not a {type(content).__name__}") from None
        raise


def refuse_incompatible_checkpoint(checkpoint: Path, config: RunConfig) -> None:
    """Before anything starts: the trainer state in `checkpoint` fits the model this config builds
    (the same parameters, shapes, and LoRA or not), else a ConfigError naming what differs."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = {key.removeprefix("model."): tuple(meta.size)
             for key, meta in FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    # A tied weight passes under any of its names; what the checkpoint holds beyond the parameters
    # (a buffer) is not this check's business.
    aliases: dict[int, list[str]] = {}
    model = trained_model(Path(config.model.path), config.model.lora)
    for name, param in model.named_parameters(remove_duplicate=False):
        if config.model.lora is None or ".lora_" in name:
            aliases.setdefault(id(param), []).append(name)
    shapes = {id(param): tuple(param.shape) for param in model.parameters()}
    wanted = {next((n for n in names if n in saved), names[0]): shapes[key] for key, names in aliases.items()}
    if all(saved.get(name) == shape for name, shape in wanted.items()):
        return
    saved_lora = any(".lora_" in name for name in saved)
    if saved_lora != (config.model.lora is not None):
        what = ("LoRA adapters only; set model.lora as the run that wrote it did" if saved_lora else
                "every weight (a full fine-tuning run); remove model.lora")
        raise ConfigError(f"invalid config: checkpoint {checkpoint} holds {what} (its settings: "
                          f"{checkpoint.parent.parent / 'config.yaml'})")
    differ = [f"{name}: {saved[name]} in the checkpoint, {wanted[name]} here" for name in wanted
              if name in saved and saved[name] != wanted[name]]
    missing = sorted(wanted.keys() - saved.keys())
    lines = differ[:3] + ([f"not in the checkpoint: {', '.join(missing[:3])}"] if missing else [])
    change = ("model.lora (rank, target_modules) as the run that wrote it had" if saved_lora
              else "model.path to the model the run trained")
    raise ConfigError(f"invalid config: checkpoint {checkpoint} was written by a different model than this config "
                      f"builds ({'; '.join(lines)}); set {change} (its settings: "
                      f"{checkpoint.parent.parent / 'config.yaml'}), or start a new run_dir")


def load_assets(config: RunConfig) -> RunAssets:
    model_dir = Path(config.model.path)
    _check_the_model(config, model_dir)
    tokenizer_dir = Path(config.model.tokenizer_dir)
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise ConfigError(f"invalid config: no tokenizer in {tokenizer_dir} (no tokenizer_config.json); "
                          "set model.tokenizer_path to the tokenizer's directory")
    tokenizer = _load_tokenizer_checked(config, tokenizer_dir)
    if config.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"invalid config: data.apply_chat_template is on but the tokenizer in {tokenizer_dir} "
                          "has no chat template")
    environment = load_task_environment(config)  # task.verifiers: its dataset and rubric, loaded once
    if config.reward.judge is not None:  # its model directory and answer tokens, before any engine starts
        from rlsys.rewards.judge import JudgeScorer

        JudgeScorer(config.reward.judge, log_dir=".")
    if config.reward.url is None and config.reward.judge is None and environment is None:
        load_reward_function(config.reward.function)  # checked here; the reward workers load their own copy
    for eval_set in config.eval.datasets:
        if eval_set.reward_function:
            load_reward_function(eval_set.reward_function, f"eval.datasets[{eval_set.name}].reward_function")
    splits = environment.splits() if hasattr(environment, "splits") else load_splits(config.data, config.seed)
    if config.task.verifiers is not None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"invalid config: task.verifiers' prompts are chat messages, and the tokenizer in "
                          f"{tokenizer_dir} has no chat template to render them")
    _refuse_conversation_images(config, splits.train + splits.eval)
    budget = config.rollout.engine.context_length - config.rollout.max_new_tokens
    if budget < 1:
        raise ConfigError(
            "invalid config: rollout.max_new_tokens must be below rollout.engine.context_length"
        )
    train, too_long_train = _encode_fitting(config, tokenizer, splits.train, budget)
    eval_, too_long_eval = _encode_fitting(config, tokenizer, splits.eval, budget)
    eval_sets = [_eval_set_assets(config, tokenizer, eval_set) for eval_set in config.eval.datasets]
    if not train:
        raise ConfigError(
            f"no training prompt fits in {budget} tokens (context_length - max_new_tokens)"
        )
    if config.eval.stop_at_reward is not None and not eval_:
        raise ConfigError("invalid config: eval.stop_at_reward is set but the data has no eval prompt to reach it "
                          "with (data.eval_fraction, data.eval_path or the synthetic task's num_eval)")
    return RunAssets(
        tokenizer=tokenizer, train=train, eval=eval_,
        stop_token_ids=_stop_token_ids(config, tokenizer),
        skipped_rows=splits.skipped_rows, too_long_prompts=too_long_train + too_long_eval, eval_sets=eval_sets,
        image_load=_image_load(config, train), environment=environment,
    )


def _image_load(config: RunConfig, train: list[EncodedPrompt]) -> ImageLoad | None:
    """What the training prompts' images take of a micro-batch (None without images)."""
    if not any(prompt.record.images for prompt in train):
        return None
    from rlsys.multimodal.image_load import image_load
    from rlsys.multimodal.vision_inputs import VisionInputs

    return image_load(train, VisionInputs.for_model(config.model.path))


def _refuse_conversation_images(config: RunConfig, records: list[PromptRecord]) -> None:
    """Images in chat messages' parts (known only once the data is read, where data.image_key is known
    from the config) refused where config-level images are: a model without a vision tower, partial
    rollouts, a generate function."""
    with_images = next((r for r in records if r.images and r.messages), None)
    if with_images is None:
        return
    named = f"prompt {with_images.prompt[:60]!r} has image parts in its messages"
    if "vision_config" not in read_model_config(config.model.path):
        raise ConfigError(f"invalid data: {named}, but model.path {config.model.path} is not a vision-language "
                          "model (its config.json has no vision_config); point model.path at one")
    if not config.rollout.mode.takes_images or config.rollout.generate_function:
        option = (f"rollout.mode {config.rollout.mode.type}" if not config.rollout.mode.takes_images
                  else "rollout.generate_function")
        raise ConfigError(f"invalid config: {option} with images is not supported yet ({named}): the engine would get "
                          "the prompt's token ids without its images")


def _check_the_model(config: RunConfig, model_dir: Path) -> None:
    """What the driver checks of the model from its config.json and file names alone: weight files
    the trainer reads, settings the model can run (images, a vision tower, experts to replay, Ulysses
    heads that split over the CP ranks); refused with a ConfigError.

    Not transformers' config class: building it costs the driver ~1.7 CPU-seconds (its
    @auto_docstring imports transformers' auto modeling code), the serial start of every run. What
    only transformers can tell (a model type it does not know, one that is no causal LM, a field of
    the wrong type) trainer rank 0 refuses before the ranks build the model, where that code is
    imported anyway (rlsys/model/checks.py `model_report`, through `read_architecture`)."""
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"invalid config: model.path {model_dir} is not a local Hugging Face checkpoint "
            "(no config.json); build one with `rlsys make-tiny-model DIR` or point at a local model"
        )
    model_config = read_model_config(model_dir)
    vision_language = "vision_config" in model_config
    if config.data.has_images and not vision_language:  # the trainer and engines take images only with a vision tower
        source = (f"data.image_key={config.data.image_key}" if config.data.image_key is not None
                  else f"data.synthetic.task={config.data.synthetic.task}")
        raise ConfigError(f"invalid config: {source} gives each prompt images, but model.path {model_dir} is not a "
                          "vision-language model (its config.json has no vision_config); point model.path at one "
                          "(rlsys make-tiny-model --arch qwen2_5_vl DIR builds a tiny one)")
    if vision_language and config.trainer.context_parallel_size > 1:
        raise ConfigError(f"invalid config: trainer.context_parallel_size={config.trainer.context_parallel_size} with a "
                          f"vision-language model ({model_dir}) is not supported yet (a sequence's image tokens would "
                          "be split over ranks the vision tower does not span); use context_parallel_size=1")
    if config.model.freeze_vision and not vision_language:
        raise ConfigError(f"invalid config: model.freeze_vision is set but model.path {model_dir} has no vision tower "
                          "(its config.json has no vision_config)")
    if vision_language:
        refuse_untrained_vision_language(model_dir, model_config)
    text = text_settings(model_config)
    if config.rollout.routing_replay != "off" and not text.get("num_experts_per_tok"):
        raise ConfigError(f"invalid config: rollout.routing_replay={config.rollout.routing_replay} replays the experts "
                          f"the engine routed each token to, but model.path {model_dir} is not a mixture-of-experts "
                          "model (its config.json has no num_experts_per_tok); set rollout.routing_replay=off")
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads", text.get("num_attention_heads"))
    if (config.trainer.context_parallel_size > 1 and config.trainer.context_parallel_style == "ulysses"
            and isinstance(heads, int) and isinstance(kv_heads, int)):  # else the memory plan's check, on rank 0's shapes
        from rlsys.actors.cp_layout import check_ulysses_heads

        try:
            check_ulysses_heads(heads, kv_heads, config.trainer.context_parallel_size)
        except ValueError as error:
            raise ConfigError(f"invalid config: {error}") from None
    weights = [p.name for pattern in _WEIGHT_FILES for p in model_dir.glob(pattern)]
    if not weights:
        raise ConfigError(
            f"invalid config: model.path {model_dir} holds no weight files ({', '.join(_WEIGHT_FILES)}); "
            "point it at a complete Hugging Face checkpoint"
        )


def _encode_fitting(config: RunConfig, tokenizer, records: list[PromptRecord],
                    budget: int) -> tuple[list[EncodedPrompt], int]:
    """The records encoded (chat template, system prompt), those of 1 to `budget` tokens kept (a
    prompt's images counted at the tokens the engine expands them to); and how many were not."""
    data = config.data
    conversational = next((r for r in records if r.messages), None)
    if conversational is not None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"invalid data: prompt {conversational.prompt[:60]!r} is a list of chat messages, but the "
                          f"tokenizer of {config.model.tokenizer_dir} has no chat template to "
                          "render them with; give prompts as text, or a tokenizer with a chat template")
    images = _ImageTokens.of(config) if any(r.images for r in records) else None
    placeholder = images.placeholder if images is not None else None
    encoded = [EncodedPrompt(r, _encode(tokenizer, r, data.apply_chat_template, data.system_prompt, placeholder))
               for r in records]
    if images is None:
        kept = [e for e in encoded if 0 < len(e.token_ids) <= budget]
    else:
        kept = [e for e in encoded if 0 < images.expanded_len(e) <= budget]
    return kept, len(encoded) - len(kept)


class _ImageTokens:
    """A vision-language model's image placeholder ids and the length a prompt's images expand to."""

    def __init__(self, model_dir: str, raw: dict):
        from rlsys.multimodal.vision_inputs import VisionInputs

        self.vision = VisionInputs.for_model(model_dir)
        self.placeholder = [raw["vision_start_token_id"], raw["image_token_id"], raw["vision_end_token_id"]]

    @classmethod
    def of(cls, config: RunConfig) -> _ImageTokens:
        return cls(config.model.path, read_model_config(config.model.path))

    def expanded_len(self, prompt: EncodedPrompt) -> int:
        """Its length on the engine; ConfigError when its ids hold another number of images than it has."""
        placeholders = prompt.token_ids.count(self.vision.image_token_id)
        if placeholders != len(prompt.record.images):
            raise ConfigError(f"invalid data: prompt {prompt.text[:60]!r} has {len(prompt.record.images)} image(s) but "
                              f"its token ids hold {placeholders} image placeholder(s) (the chat template's, or "
                              "image tokens written in the prompt's text); one per image is needed")
        return len(prompt.token_ids) + self.vision.placeholder_len(prompt.record.images)


def _eval_set_assets(config: RunConfig, tokenizer, eval_set: EvalSetConfig) -> EvalSetAssets:
    """An eval set's prompts that fit with its own max_new_tokens; refused when none does."""
    records, skipped = _read_eval_set(config, eval_set)
    _refuse_conversation_images(config, records)
    budget = config.rollout.engine.context_length - (eval_set.max_new_tokens or config.rollout.max_new_tokens)
    kept, too_long = _encode_fitting(config, tokenizer, records, budget)
    if not kept:
        raise ConfigError(f"invalid config: eval set {eval_set.name!r} ({eval_set.path}): none of its "
                          f"{len(records)} prompts fits in {budget} tokens (rollout.engine.context_length "
                          "minus its max_new_tokens)")
    return EvalSetAssets(eval_set, kept, skipped, too_long)


def _read_eval_set(config: RunConfig, eval_set: EvalSetConfig) -> tuple[list[PromptRecord], int]:
    """An eval set's rows as records (data's columns unless the set names its own), refused with
    a ConfigError naming the set when its file is missing, unreadable or empty."""
    where = f"eval set {eval_set.name!r}"
    if not Path(eval_set.path).exists():
        raise ConfigError(f"invalid config: {where}: {eval_set.path} does not exist (eval.datasets[].path: a "
                          ".jsonl, .parquet, .json or .csv file, or a saved dataset directory)")
    data = config.data
    columns = Columns(eval_set.prompt_key or data.prompt_key, eval_set.label_key or data.label_key,
                      tuple(data.metadata_keys if eval_set.metadata_keys is None else eval_set.metadata_keys),
                      data.image_key)
    try:
        records, skipped = read_records(eval_set.path, columns, data.skip_invalid_rows, eval_set.split)
    except DatasetError as error:
        raise DatasetError(f"{where}: {error}") from None
    if not records:
        raise ConfigError(f"invalid config: {where}: {eval_set.path} holds no prompts")
    if eval_set.max_prompts:
        records = records[: eval_set.max_prompts]
    return records, skipped
