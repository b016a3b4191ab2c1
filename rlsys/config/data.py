"""data: training and eval prompts, from files or a built-in synthetic task."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlsys.section import Section


class SyntheticTaskConfig(Section):
    task: Literal["max_digit", "first_digit", "last_digit", "sum_mod10", "calculator", "square_color"] = Field(
        "max_digit", description="The built-in task whose prompts and labels are generated (rlsys/data/tasks.py). "
        "square_color: an image (a vision-language model's task) with a coloured square on grey, answered by the "
        "colour's letter.",
    )
    num_digits: int = Field(3, ge=1, le=12, description="Digits per prompt (the digit tasks).")
    num_train: int = Field(2000, ge=1, description="Training prompts generated.")
    num_eval: int = Field(128, ge=1, description="Eval prompts generated (none of them among the training ones).")
    seed: int = Field(0, description="Seed of the generator that draws the prompts.")
    blank_images: bool = Field(
        False, description="square_color: draw the grey background only (the same sizes and labels), so no answer "
        "can be seen: a control that a model which learns the task does so by looking.",
    )


class DataConfig(Section):
    train_path: str | None = Field(
        None, description="Prompts: .jsonl, .parquet, .json, .csv, or a directory written by datasets' save_to_disk.",
    )
    eval_path: str | None = Field(
        None, description="Held-out eval prompts, in train_path's formats (their prompts are removed from train).",
    )
    prompt_key: str = Field("prompt", description="The field (column) holding the prompt: text, or a list of chat "
                            "messages (docs/bring-your-own-task.md, conversational prompts).")
    label_key: str = Field("label", description="The field holding the label the reward function gets.")
    metadata_keys: list[str] = Field(default_factory=list, description="Fields passed to the reward as metadata.")
    image_key: str | None = Field(
        None, description="A vision-language model's data: the field holding a row's images (one, or a list), each "
        "a path relative to the data file, the image's bytes, a base64 string or a data: URI; every image is opened "
        "when the data is read, and an unreadable one is a bad row (data.skip_invalid_rows). Unset: no images.")
    train_split: str = Field("train", description="The split of a saved DatasetDict that train_path names.")
    eval_split: str = Field("test", description="The split of a saved DatasetDict that eval_path names.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Held out of train_path when no eval_path.")
    synthetic: SyntheticTaskConfig | None = Field(
        None, description="Generate a built-in task instead of reading train_path (exactly one of the two, or "
        "task.verifiers).",
    )
    prompts_per_step: int = Field(16, ge=1, description="Prompts (GRPO groups) per training step.")
    apply_chat_template: bool = Field(
        False, description="Wrap each prompt as a user turn of the tokenizer's chat template (with the "
        "assistant turn opened).",
    )
    system_prompt: str | None = Field(None, description="A system turn before each prompt (needs apply_chat_template).")
    skip_invalid_rows: bool = Field(False, description="Skip (and count) malformed rows instead of failing.")

    @property
    def has_images(self) -> bool:
        """Its prompts carry images (a vision-language model's data)."""
        return self.image_key is not None or (self.synthetic is not None and self.synthetic.task == "square_color")

    @model_validator(mode="after")
    def _one_source(self):
        # Neither: the prompts come from task.verifiers, or nowhere (config/rules.py `check_task` says which).
        if self.train_path is not None and self.synthetic is not None:
            raise ValueError("set exactly one of data.train_path or data.synthetic")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("data.system_prompt needs data.apply_chat_template: true (it is a turn of the chat template)")
        return self
