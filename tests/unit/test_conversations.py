"""Conversational prompts (rlsys/data/conversations.py): a row's prompt as a list of chat messages,
text or with image parts, in JSONL and Parquet; rendered by the tokenizer's chat template with each
image where its part stands; bad messages are bad rows naming the row and where in the prompt."""

import base64
import json

import pytest

from rlsys.config import ConfigError, load_config
from rlsys.data.datasets import DatasetError, read_records
from rlsys.data.tokenizer import load_tokenizer
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers import png_bytes, write_config

SYSTEM = {"role": "system", "content": "Answer with one digit."}


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat-model"), chat=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("vlm"), TinyModelSpec(arch="qwen2_5_vl"))


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(tmp_path, model_dir, train, *overrides):
    path = write_config(tmp_path / "c.yaml", model_dir, data={"train_path": str(train), "eval_fraction": 0.0})
    return load_config(path, ["rollout.engine.context_length=256", *overrides])


def test_messages_are_read_with_the_last_user_turn_as_the_prompt_text(tmp_path):
    rows = [{"prompt": [SYSTEM, {"role": "user", "content": "4 7 2>"}], "label": "2"},
            {"prompt": [{"role": "user", "content": "1 1 1>"}, {"role": "assistant", "content": "1"},
                        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "3>"}]}],
             "label": "3"},
            {"prompt": "plain text 5>", "label": "5"}]
    records, skipped = read_records(_write(tmp_path / "train.jsonl", rows))
    assert skipped == 0
    assert [r.prompt for r in records] == ["4 7 2>", "and\n3>", "plain text 5>"]
    assert records[0].messages == (SYSTEM, {"role": "user", "content": "4 7 2>"}) and records[2].messages == ()
    assert records[1].messages[2]["content"] == [{"type": "text", "text": "and"}, {"type": "text", "text": "3>"}]


def test_a_conversation_is_rendered_by_the_chat_template_with_its_own_system_turn(tmp_path, chat_model_dir):
    from rlsys.run.assets import load_assets

    rows = [{"prompt": [SYSTEM, {"role": "user", "content": f"{d} {d}>"}], "label": str(d)} for d in range(4)]
    config = _config(tmp_path, chat_model_dir, _write(tmp_path / "train.jsonl", rows),
                     "data.apply_chat_template=true", "data.system_prompt=Another system turn.")  # the row's own wins
    tokenizer = load_tokenizer(chat_model_dir)
    first = load_assets(config).train[0]
    expected = (f"<|im_start|>system\nAnswer with one digit.<|im_end|>\n<|im_start|>user\n{first.record.prompt}"
                "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(first.token_ids) == expected
    assert first.token_ids == tokenizer.apply_chat_template(
        [SYSTEM, {"role": "user", "content": first.record.prompt}], add_generation_prompt=True, tokenize=True,
        return_dict=False)


def test_image_parts_become_the_records_images_in_order_and_placeholders_where_they_stand(tmp_path, vlm_dir):
    from rlsys.run.assets import load_assets

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png_bytes((255, 0, 0)))
    blue = png_bytes((0, 0, 255))
    rows = [{"prompt": [{"role": "user", "content": [
                {"type": "image", "image": "img/red.png"}, {"type": "text", "text": "then"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(blue).decode()}},
                {"type": "text", "text": "colours?"}]}], "label": "rb"}] * 4
    config = _config(tmp_path, vlm_dir, _write(tmp_path / "train.jsonl", rows), "rollout.max_new_tokens=4")
    record = load_assets(config).train[0].record
    assert record.images == (png_bytes((255, 0, 0)), blue) and record.prompt == "then\ncolours?"
    encoded = load_assets(config).train[0]
    text = load_tokenizer(vlm_dir).decode(encoded.token_ids)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text.index(placeholder) < text.index("then") < text.rindex(placeholder) < text.index("colours?")
    assert text.count(placeholder) == 2


def test_parquet_rows_hold_messages_as_lists_of_structs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [[{"role": "user", "content": "1 2 3>"}], [SYSTEM, {"role": "user", "content": "4 5 6>"}]]
    pq.write_table(pa.table({"prompt": prompts, "label": ["3", "6"]}), tmp_path / "train.parquet")
    records, _ = read_records(tmp_path / "train.parquet")
    assert [r.prompt for r in records] == ["1 2 3>", "4 5 6>"] and records[1].messages[0] == SYSTEM


@pytest.mark.parametrize("prompt, where", [
    ([], r"'prompt': an empty list of messages"),
    (["hi"], r"'prompt'\[0\]: a message must be an object with a 'role'"),
    ([{"role": "robot", "content": "x"}], r"'prompt'\[0\]\.role: 'robot' is not one of"),
    ([{"role": "user", "content": 7}], r"'prompt'\[0\]\.content: a string or a non-empty list of parts"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"'prompt'\[0\]\.content\[0\]: a part is"),
    ([{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}],
     r"'prompt'\[0\]\.content\[0\]\.image\[0\]: 'missing.png' is neither an image file"),
    ([{"role": "user", "content": [{"type": "image", "image": ["a.png", "b.png"]}]}],
     r"'prompt'\[0\]\.content\[0\]: an image part holds one image"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     r"'prompt'\[1\]\.role: the last message is the one answered"),
])
def test_a_bad_message_is_a_bad_row_naming_row_and_place(tmp_path, prompt, where):
    path = _write(tmp_path / "train.jsonl", [{"prompt": [{"role": "user", "content": "ok"}], "label": "1"},
                                             {"prompt": prompt, "label": "1"}])
    with pytest.raises(DatasetError, match=rf"train\.jsonl:2: {where}"):
        read_records(path)
    records, skipped = read_records(path, skip_invalid=True)
    assert len(records) == 1 and skipped == 1


def test_what_cannot_take_a_conversation_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from rlsys.run.assets import load_assets

    text_rows = [{"prompt": [{"role": "user", "content": f"{d}>"}], "label": str(d)} for d in range(4)]
    config = _config(tmp_path, tiny_model_dir, _write(tmp_path / "train.jsonl", text_rows))
    with pytest.raises(ConfigError, match="is a list of chat messages, but the tokenizer of .* has no chat template"):
        load_assets(config)  # the quickstart's tokenizer has none
    (tmp_path / "red.png").write_bytes(png_bytes())
    image_rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                           {"type": "text", "text": "colour?"}]}], "label": "r"}] * 4
    chat_dir = make_tiny_model(tmp_path / "chat", chat=True)
    config = _config(tmp_path, chat_dir, _write(tmp_path / "images.jsonl", image_rows))
    with pytest.raises(ConfigError, match="has image parts in its messages, but model.path .* is not a vision-language"):
        load_assets(config)


def test_a_partial_rollouts_checkpoint_keeps_a_prompts_messages():
    from rlsys.records import EncodedPrompt, PromptRecord
    from rlsys.rollout.partial import GroupInFlight, group_from_json, group_to_json

    record = PromptRecord("q", "a", messages=(SYSTEM, {"role": "user", "content": [{"type": "text", "text": "q"}]}))
    group = GroupInFlight.new(EncodedPrompt(record, [5, 6]), 2)
    assert group_from_json(json.loads(json.dumps(group_to_json(group)))).prompt == group.prompt
