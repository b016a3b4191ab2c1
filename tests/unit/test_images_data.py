"""A vision-language dataset's images (data.image_key, rlsys/multimodal/images.py): paths relative
to the data file, bytes, base64 and data: URIs, one or several a row, in JSONL, CSV, Parquet and a
saved `datasets` directory; an unreadable image is a bad row naming its row and field."""

import base64
import json

import pytest

from rlsys.data.datasets import Columns, DatasetError, read_records
from tests.helpers import png_bytes

COLUMNS = Columns(images="images")


@pytest.fixture
def pictures(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png_bytes())
    return tmp_path


def test_jsonl_rows_take_relative_paths_base64_data_uris_and_lists(pictures):
    blue = png_bytes((0, 0, 255))
    rows = [{"prompt": "one", "label": "r", "images": "img/red.png"},
            {"prompt": "two", "label": "rb", "images": ["img/red.png", base64.b64encode(blue).decode()]},
            {"prompt": "uri", "label": "b", "images": "data:image/png;base64," + base64.b64encode(blue).decode()},
            {"prompt": "none", "label": "-"}]
    path = pictures / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    records, skipped = read_records(path, COLUMNS)
    assert skipped == 0
    assert [len(r.images) for r in records] == [1, 2, 1, 0]
    assert records[0].images == ((pictures / "img" / "red.png").read_bytes(),) and records[1].images[1] == blue
    assert records[2].images == (blue,)
    # without data.image_key the field is an unknown one, as any other unmapped JSONL field
    with pytest.raises(DatasetError, match=r"unknown field\(s\) \['images'\]"):
        read_records(path)


def test_table_formats_take_paths_and_bytes(pictures):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (pictures / "train.csv").write_text("prompt,label,images\nred?,r,img/red.png\n")
    (csv_record,), _ = read_records(pictures / "train.csv", COLUMNS)
    assert csv_record.images == (png_bytes(),)
    table = pa.table({"prompt": ["a", "b"], "label": ["1", "2"],
                      "images": [[png_bytes()], [png_bytes(), png_bytes((0, 255, 0))]]})
    pq.write_table(table, pictures / "train.parquet")
    records, _ = read_records(pictures / "train.parquet", COLUMNS)
    assert [len(r.images) for r in records] == [1, 2] and records[1].images[1] == png_bytes((0, 255, 0))


def test_a_saved_dataset_with_an_image_column(pictures):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    image = Image.new("RGB", (20, 20), (0, 128, 0))
    table = datasets.Dataset.from_dict({"prompt": ["green?"], "label": ["g"], "images": [[image]]},
                                       features=datasets.Features({"prompt": datasets.Value("string"),
                                                                   "label": datasets.Value("string"),
                                                                   "images": [datasets.Image()]}))
    table.save_to_disk(str(pictures / "saved"))
    (record,), _ = read_records(pictures / "saved", COLUMNS)
    from rlsys.multimodal.images import decoded

    assert len(record.images) == 1 and decoded(record.images[0]).getpixel((3, 3)) == (0, 128, 0)


@pytest.mark.parametrize(("value", "why"), [
    ("img/missing.png", r"'images'\[0\]: 'img/missing.png' is neither an image file \(looked for .*missing.png\) "
                        "nor base64"),
    (["img/red.png", base64.b64encode(b"not a picture").decode()], r"'images'\[1\]: not an image PIL can read"),
    ("data:image/png,rawbytes", r"'images'\[0\]: a data: URI must be base64"),
    (7, r"'images'\[0\]: an image must be a path, bytes, a base64 string or a data: URI, got int"),
    ("a\u0000b", r"'images'\[0\]: 'a\\x00b' is neither an image file"),
    ("x" * 5000, r"'images'\[0\]: not an image PIL can read"),  # too long for a path: read as base64
])
def test_an_unreadable_image_is_a_bad_row_naming_row_and_field(pictures, value, why):
    path = pictures / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "label": "1", "images": "img/red.png"}) + "\n"
                    + json.dumps({"prompt": "bad", "label": "1", "images": value}) + "\n")
    with pytest.raises(DatasetError, match=f"bad.jsonl:2: {why}"):
        read_records(path, COLUMNS)
    records, skipped = read_records(path, COLUMNS, skip_invalid=True)
    assert len(records) == 1 and skipped == 1


def test_images_for_a_model_without_a_vision_tower_are_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from rlsys.config import ConfigError, load_config
    from rlsys.run.assets import load_assets
    from tests.helpers import write_config

    config = load_config(write_config(tmp_path / "c.yaml", tiny_model_dir), ["data.image_key=images"])
    with pytest.raises(ConfigError, match="data.image_key=images gives each prompt images, but model.path .* is not "
                                          "a vision-language model"):
        load_assets(config)


def test_a_partial_rollouts_checkpoint_keeps_a_prompts_images():
    """rollout.mode partial writes groups in flight to coordinator.json: their images as base64."""
    from rlsys.records import EncodedPrompt, PromptRecord
    from rlsys.rollout.partial import GroupInFlight, group_from_json, group_to_json

    record = PromptRecord("red?", "r", images=(png_bytes(), png_bytes((1, 2, 3))))
    group = GroupInFlight.new(EncodedPrompt(record, [5, 6]), 2)
    restored = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert restored.prompt == group.prompt
    plain = GroupInFlight.new(EncodedPrompt(PromptRecord("7", "7"), [5]), 1)
    assert group_from_json(json.loads(json.dumps(group_to_json(plain)))).prompt == plain.prompt


def test_eval_prompts_are_told_from_train_ones_by_their_images_too(pictures):
    """A vision-language task's prompts often share one text ("color?"): a train row is dropped as
    an eval prompt only when its images are the eval row's too."""
    from rlsys.config import DataConfig
    from rlsys.data.datasets import load_splits

    blue, green = base64.b64encode(png_bytes((0, 0, 255))).decode(), base64.b64encode(png_bytes((0, 255, 0))).decode()
    rows = [{"prompt": "color?", "label": "r", "images": "img/red.png"},
            {"prompt": "color?", "label": "b", "images": blue},
            {"prompt": "color?", "label": "g", "images": green}]
    (pictures / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (pictures / "eval.jsonl").write_text(json.dumps(rows[1]) + "\n")
    splits = load_splits(DataConfig(train_path=str(pictures / "train.jsonl"), eval_path=str(pictures / "eval.jsonl"),
                                    image_key="images"), seed=0)
    assert sorted(r.label for r in splits.train) == ["g", "r"] and [r.label for r in splits.eval] == ["b"]
