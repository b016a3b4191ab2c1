"""The configuration reference (docs/configuration.md), generated from the pydantic models in
rlsys/config/ so the docs cannot drift from the code (tests/unit/test_docs.py compares them).

    python -m rlsys.tools.config_reference > docs/configuration.md
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from typing import Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlsys.algorithms.corrections import CORRECTIONS, Correction
from rlsys.algorithms.policy_losses import POLICY_LOSSES, PolicyLoss
from rlsys.config import ROLLOUT_MODES, RolloutMode, RunConfig

COMMAND = "python -m rlsys.tools.config_reference > docs/configuration.md"

INTRO = f"""\
# Configuration reference

<!-- Generated from rlsys/config/ by `{COMMAND}`; do not edit by hand
     (tests/unit/test_docs.py fails when this file and the models differ). -->

A run's config is a YAML file of the sections below. Any field can be overridden on the command
line as `section.field=value` (the value is parsed as YAML), e.g.
`rlsys train configs/quickstart.yaml trainer.lr=3e-4 rollout.engine.context_length=1024`. The whole
config is validated before any actor starts; a bad value fails naming the field and the reason, and
the resolved config is written to `RUN_DIR/config.yaml`. Unknown fields are refused. The fields, types,
defaults and descriptions here are generated from `rlsys/config/`.
"""

_BOUNDS = {annotated_types.Ge: (">=", "ge"), annotated_types.Gt: (">", "gt"),
           annotated_types.Le: ("<=", "le"), annotated_types.Lt: ("<", "lt")}


def _section_model(annotation) -> type[BaseModel] | None:
    """The model class of a field that holds a section (`X`, `X | None` or a list of X), else None."""
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    models = [c for c in candidates if inspect.isclass(c) and issubclass(c, BaseModel)]
    return models[0] if models else None


def _mentions(annotation, cls: type) -> bool:
    """Whether `annotation` is `cls` or holds it (inside a list, a union or Annotated)."""
    if inspect.isclass(annotation) and issubclass(annotation, cls):
        return True
    return any(_mentions(arg, cls) for arg in typing.get_args(annotation))


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_name(annotation) -> str:
    """A field's type as a YAML user reads it: `int`, `float | null`, `constant | cosine`, `list[str]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None) or annotation is None:
        return "null"
    if _is_union(annotation):
        return " | ".join(type_name(arg) for arg in args)
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(arg) for arg in args) + "]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return annotation.__name__


def _bounds(info: FieldInfo) -> list[str]:
    found = []
    for item in info.metadata:
        for kind, (symbol, attribute) in _BOUNDS.items():
            if isinstance(item, kind):
                found.append(f"{symbol} {getattr(item, attribute)}")
    return found


def _value(value) -> str:
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)  # null, true/false, numbers and lists as YAML also reads them


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        return "(section)" if isinstance(value, BaseModel) else _value(value)
    return _value(info.default)


def _cell(text: str) -> str:
    # `|` would end the table cell; `<word>` would be read as an HTML tag and vanish
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def _sections(model: type[BaseModel], prefix: str, description: str):
    """(dotted name, model, description) of `model` and, depth first, every section inside it."""
    yield prefix, model, description
    for name, info in model.model_fields.items():
        nested = _section_model(info.annotation)
        if nested is not None and not issubclass(nested, PolicyLoss | RolloutMode):  # those: _variants
            dotted = (f"{prefix}.{name}" if prefix else name) + ("[]" if _is_list(info.annotation) else "")
            yield from _sections(nested, dotted, info.description or "")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if not info.description:
            raise ValueError(f"{model.__name__}.{name} ({dotted}) has no description: add "
                             "Field(description=...) in rlsys/config/")
        kind = type_name(info.annotation)
        if _mentions(info.annotation, Correction):  # a list of corrections' names or sections
            kind = "list[" + " | ".join(CORRECTIONS) + " | section] | null"
            description = f"{info.description} See [`{dotted}`](#{dotted.replace('.', '')})."
            lines.append(f"| `{name}` | {_code(kind)} | {_code(default_text(info))} | {_cell(description)} |")
            continue
        nested = _section_model(info.annotation)
        if nested is not None and issubclass(nested, PolicyLoss | RolloutMode):  # a variant's name, or its section
            registry, key = (POLICY_LOSSES, "name") if issubclass(nested, PolicyLoss) else (ROLLOUT_MODES, "type")
            kind = " | ".join(registry) + " | section"
            description = f"{info.description} See [`{dotted}`](#{dotted.replace('.', '')})."
            default = getattr(info.default_factory(), key)
            lines.append(f"| `{name}` | {_code(kind)} | {_code(default)} | {_cell(description)} |")
            continue
        if nested is not None:
            if _is_list(info.annotation):
                kind, dotted = "list[section]", dotted + "[]"
            else:
                kind = "section" + (", optional" if _is_union(info.annotation) else "")
            anchor = dotted.replace(".", "").replace("[]", "")
            description = f"{info.description} See [`{dotted}`](#{anchor})."
        else:
            description = info.description
        bounds = _bounds(info)
        if bounds:
            kind += ", " + ", ".join(bounds)
        lines.append(f"| `{name}` | {_code(kind)} | {_code(default_text(info))} | {_cell(description)} |")
    return lines


def _variants(prefix: str, registry: dict[str, type[BaseModel]], key: str, default: str, what: str) -> list[str]:
    """Each registered variant of a setting keyed on `key` (the policy losses, the rollout modes):
    what it does, and the table of its parameters when it has any."""
    out = [f"## `{prefix}`", "",
           f"`{prefix}: {key.upper()}` takes the {what}'s defaults; `{prefix}: {{{key}: {key.upper()}, PARAMETER: VALUE}}` "
           f"sets its parameters (on the command line: `{prefix}={key.upper()} {prefix}.PARAMETER=VALUE`).", ""]
    for name, variant in sorted(registry.items(), key=lambda item: item[0] != default):  # the default first
        out.extend([f"### `{name}`", "", _cell(variant.summary) + ".", ""])
        if len(variant.model_fields) > 1:  # `key` and its parameters
            out.extend(_table(variant, prefix) + [""])
    return out


def _corrections(prefix: str) -> list[str]:
    """Each registered rollout correction (rlsys/algorithms/corrections/): what it computes, and the
    table of its parameters."""
    out = [f"## `{prefix}`", "",
           f"`{prefix}: [NAME, ...]` takes each one's defaults; `{prefix}: [{{name: NAME, PARAMETER: VALUE}}]` sets "
           "its parameters. Their factors multiply: a \"weight\" is the importance weight the policy loss receives "
           "(VESPO folds it into its ratio); a \"mask\" (0 or 1) multiplies the token loss after it. "
           "rho = exp(log p_old - log p_engine) per token.", ""]
    for name, correction in sorted(CORRECTIONS.items()):
        out.extend([f"### `{name}` ({correction.kind})", "", _cell(correction.summary) + ".", ""])
        if len(correction.model_fields) > 1:
            out.extend(_table(correction, prefix) + [""])
    return out


def render() -> str:
    out = [INTRO]
    for dotted, model, description in _sections(RunConfig, "", ""):
        out.append(f"## `{dotted}`" if dotted else "## Top level")
        out.append("")
        # the section's own docstring says more than its one-line field description, when it has one
        note = inspect.cleandoc(model.__doc__ or "") or description
        if note:
            out.extend([" ".join(paragraph.split()) + "\n" for paragraph in note.split("\n\n")])
        out.extend(_table(model, dotted))
        out.append("")
        for name, info in model.model_fields.items():
            nested = _section_model(info.annotation)
            if nested is not None and issubclass(nested, PolicyLoss):
                out.extend(_variants(f"{dotted}.{name}", POLICY_LOSSES, "name", "grpo", "loss"))
            if nested is not None and issubclass(nested, RolloutMode):
                out.extend(_variants(f"{dotted}.{name}", ROLLOUT_MODES, "type", "sync", "mode"))
            if _mentions(info.annotation, Correction):
                out.extend(_corrections(f"{dotted}.{name}"))
    return "\n".join(out)


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
