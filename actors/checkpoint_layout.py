"""Which checkpoint tensors a parameter is made of, where the two differ.

transformers 5 builds some models with parameters that their Hugging Face checkpoints (and
SGLang's `load_weights`) store as several tensors: a mixture-of-experts layer's experts are one
stacked parameter, `mlp.experts.gate_up_proj` [E, 2I, H], saved as 2E tensors
`mlp.experts.{e}.gate_proj.weight` and `.up_proj.weight` [I, H] each; `mlp.experts.down_proj`
[E, H, I] as E tensors `mlp.experts.{e}.down_proj.weight` [H, I]. transformers converts on load
and save (its `WeightConverter`s, `transformers.conversion_mapping`); rlsys reads checkpoints
and feeds engines itself, so it takes the same converters from transformers and turns each into
the list of checkpoint tensors that tile the parameter in row-major order: expert 0's pieces,
then expert 1's, ... Each piece is then a contiguous block of the parameter's memory, so the
trainer reads an expert's rows from its pieces (actors/loading.py) and the weight sync hands the
engine the pieces as views of the gathered parameter, copying nothing (weight_sync/buckets.py).

Only converters that stack a module list along dim 0 (`MergeModulelist(dim=0)`), optionally
after concatenating several projections of each module (`Concatenate(dim=1)`), are understood:
the layouts of Qwen2-MoE, Qwen3-MoE, Mixtral and the DeepSeek/GLM-MoE family. A model with any
other converter that touches one of its parameters is refused by name (`unsupported_layouts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    name: str  # the checkpoint tensor's name
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _converters(model: torch.nn.Module) -> list:
    from transformers.conversion_mapping import extract_weight_conversions_for_model

    try:
        return [c for c in extract_weight_conversions_for_model(model) or [] if type(c).__name__ == "WeightConverter"]
    except AttributeError:  # not a transformers model (a test's own module)
        return []


def _targets(converter) -> list[str]:
    return list(converter.target_patterns)


def _sources(converter) -> list[str]:
    return list(converter.source_patterns)


def _is_stacking(converter) -> bool:
    """MergeModulelist(dim=0), or that after Concatenate(dim=1): one "*" (the module index) in
    each source, one plain target."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return (ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
            and len(_targets(converter)) == 1 and "*" not in _targets(converter)[0]
            and all(source.count("*") == 1 for source in _sources(converter))
            and (len(_sources(converter)) == 1) == (len(ops) == 1))


def _matching(name: str, target: str) -> str | None:
    """The prefix before `target` when parameter `name` ends with it at a module boundary."""
    if name == target:
        return ""
    if name.endswith("." + target):
        return name[: -len(target)]
    return None


def checkpoint_pieces(model: torch.nn.Module) -> dict[str, list[Piece]]:
    """Parameter name -> the checkpoint tensors that tile it, for every parameter stored as other
    tensors than itself; a parameter not in the result is stored under its own name and shape."""
    stacking = [c for c in _converters(model) if _is_stacking(c)]
    pieces: dict[str, list[Piece]] = {}
    for name, param in model.named_parameters():
        for converter in stacking:
            target = _targets(converter)[0]
            prefix = _matching(name, target)
            if prefix is None:
                continue
            sources = _sources(converter)
            experts, rows = param.shape[0], param.shape[1]
            if rows % len(sources):
                raise ValueError(f"{name}: {rows} rows do not split into the {len(sources)} tensors {sources}")
            each = (rows // len(sources), *param.shape[2:])
            pieces[name] = [Piece(prefix + source.replace("*", str(expert)), each)
                            for expert in range(experts) for source in sources]
            break
    return pieces


def released_names(model: torch.nn.Module) -> Callable[[str], str]:
    """A parameter's name -> its name in the released checkpoint (and in SGLang's `load_weights`),
    where transformers 5 renames on loading: a vision-language model's `model.language_model.*` is
    `model.*` there and `model.visual.*` is `visual.*` (its `WeightRenaming`s, reversed as
    transformers' own `revert_weight_conversion` does on saving). The identity for the others."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    try:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except AttributeError:  # not a transformers model (a test's own module)
        return str
    renamings = [c.reverse_transform() for c in reversed(conversions) if type(c) is WeightRenaming]
    if not renamings:
        return str
    return lambda name: rename_source_key(name, renamings, [], reverse=True)[0]


def unsupported_layouts(model: torch.nn.Module) -> list[str]:
    """Parameters that a checkpoint converter of another kind than `checkpoint_pieces` knows maps
    (transposes, splits, renames of stacked experts): rlsys would read or send them wrong."""
    others = [c for c in _converters(model) if not _is_stacking(c)]
    return [name for name, _ in model.named_parameters()
            if any(_matching(name, target.replace("*", "")) is not None or target in name
                   for converter in others for target in _targets(converter))]
