"""Reading a run configuration: `load_config("configs/quickstart.yaml", ["trainer.lr=1e-5"])` returns
a validated, resolved `RunConfig` or raises `ConfigError` naming every bad field and why, before any
actor starts; `dump_config` writes what ran."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from rlsys.config.run import RunConfig, resolve_derived_settings
from rlsys.errors import UserError


class ConfigError(UserError):
    """A run configuration is invalid; the message names each field and the reason."""


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see docs/configuration.md for the fields)"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


# Settings a name may stand for, or a section keyed on that name (algorithm.policy_loss, rollout.mode):
# an override of one of the section's fields turns a name into {key: name, field: value}.
NAMED_SECTIONS = {"algorithm.policy_loss": "name", "rollout.mode": "type"}


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (1e-5, true, [1,2])."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.field=value")
    key, raw_value = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {dotted!r} has an empty field name")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {dotted!r}: value is not valid YAML ({error})") from error
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        named = ".".join(parts[:depth + 1])
        if isinstance(child, str) and named in NAMED_SECTIONS:  # `policy_loss: cispo` is {name: cispo}
            child = node[part] = {NAMED_SECTIONS[named]: child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; name a YAML file (e.g. {path / 'config.yaml'})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[error.start]:#04x} on line {line}); "
                          "save it as UTF-8") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections at the top level")
    for override in overrides:
        apply_override(tree, override)
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, str(path))) from None
    return resolve_derived_settings(config)


def dump_config(config: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
