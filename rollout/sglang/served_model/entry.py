"""`EntryClass`: the class `RLSYS_SGLANG_MODEL_CLASS` names ("sglang.srt.models.qwen2:Qwen2ForCausalLM")."""

import importlib
import os

_module, _, _name = os.environ["RLSYS_SGLANG_MODEL_CLASS"].partition(":")
EntryClass = getattr(importlib.import_module(_module), _name)
