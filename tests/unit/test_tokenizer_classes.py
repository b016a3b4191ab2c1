"""rlsys/data/tokenizer.py: the class AutoTokenizer chooses for a tokenizer is remembered, and a later
load calls it without importing AutoTokenizer (~2 CPU-seconds of every run's serial start), giving the
same tokenizer."""

import json
import os
import subprocess
import sys

import pytest

from rlsys.data.tokenizer import load_tokenizer, tokenizer_classes_file

# Loads the tokenizer in a fresh interpreter and says what it got and whether AutoTokenizer was imported.
_PROBE = """
import json, sys
from rlsys.data.tokenizer import load_tokenizer
t = load_tokenizer(sys.argv[1])
print(json.dumps({"auto": "transformers.models.auto.tokenization_auto" in sys.modules, "class": type(t).__name__,
                  "ids": t("a<b> 7 9, zz", add_special_tokens=False)["input_ids"], "vocab": len(t.get_vocab())}))
"""


def _probe(model_dir, cache) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE, str(model_dir)], capture_output=True, text=True,
                            env={**os.environ, "RLSYS_CACHE_DIR": str(cache)}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and a.special_tokens_map == b.special_tokens_map
    assert a.chat_template == b.chat_template and a.eos_token_id == b.eos_token_id and a.pad_token_id == b.pad_token_id
    text = "<|im_start|>user\n4 7 2><|im_end|>\n<|im_start|>assistant\n a b"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert a.decode(a(text)["input_ids"]) == b.decode(b(text)["input_ids"])


@pytest.mark.parametrize("chat", [False, True])
def test_a_remembered_tokenizer_class_gives_what_autotokenizer_gives_without_importing_it(tmp_path, monkeypatch,
                                                                                         chat):
    from transformers import AutoTokenizer

    from rlsys.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", chat=chat)
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLSYS_CACHE_DIR", str(cache))
    first = _probe(model, cache)  # a fresh cache: AutoTokenizer chooses, and the choice is written down
    assert first["auto"] and json.loads(tokenizer_classes_file().read_text())
    second = _probe(model, cache)
    assert not second["auto"] and second == {**first, "auto": False}
    _same_tokenizer(load_tokenizer(model), AutoTokenizer.from_pretrained(str(model)))

    # another tokenizer (a file changed): AutoTokenizer chooses again
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 77}))
    assert _probe(model, cache)["auto"]
    assert len(json.loads(tokenizer_classes_file().read_text())) == 2


def test_a_cache_that_cannot_be_written_or_read_only_costs_the_autotokenizer_import(tmp_path, monkeypatch,
                                                                                   tiny_model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("RLSYS_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    assert load_tokenizer(tiny_model_dir).eos_token_id is not None
    monkeypatch.setenv("RLSYS_CACHE_DIR", str(tmp_path / "cut"))
    (tmp_path / "cut").mkdir()
    tokenizer_classes_file().write_text('{"cut short')
    assert load_tokenizer(tiny_model_dir).eos_token_id is not None
    assert list(json.loads(tokenizer_classes_file().read_text()).values()) == [
        [type(load_tokenizer(tiny_model_dir)).__module__, type(load_tokenizer(tiny_model_dir)).__name__]]
    assert not [p for p in (tmp_path / "cut").iterdir() if p.name.startswith(".")]  # no scratch file left
