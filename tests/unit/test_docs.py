"""The docs stay true to the code: docs/configuration.md is what the generator prints from
rlsys/config.py, and every relative link in README.md and docs/*.md leads somewhere."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys import config
from rlsys.tools import config_reference
from tests.helpers import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def broken_links(root: Path) -> list[str]:
    broken = []
    for page in doc_pages(root):
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_configuration_reference_is_what_the_generator_prints():
    # The documented command itself, so a broken entry point fails here too.
    printed = subprocess.run([sys.executable, "-m", "rlsys.tools.config_reference"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
    assert printed == config_reference.render()
    assert (REPO / "docs/configuration.md").read_text() == printed, (
        f"docs/configuration.md is out of date with rlsys/config.py: run `{config_reference.COMMAND}`")


def test_reference_lists_every_field_of_every_section():
    reference = config_reference.render()
    sections = dict((dotted, model) for dotted, model, _ in config_reference._sections(config.RunConfig, "", ""))
    assert {"", "model", "data", "data.synthetic", "rollout.sampling", "rollout.engine",
            "algorithm.overlong_penalty", "logging"} <= sections.keys()
    for dotted, model in sections.items():
        heading = f"## `{dotted}`" if dotted else "## Top level"
        table = reference.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        for name, info in model.model_fields.items():
            row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
            assert config_reference._cell(info.description) in row


def test_a_field_without_a_description_is_refused(monkeypatch):
    monkeypatch.setattr(config.EvalConfig.model_fields["max_prompts"], "description", None)
    with pytest.raises(ValueError, match=r"eval\.max_prompts\) has no description"):
        config_reference.render()


def test_type_and_default_rendering():
    fields = config.TrainerConfig.model_fields
    assert config_reference.type_name(fields["betas"].annotation) == "[float, float]"
    assert config_reference.type_name(fields["offload_between_steps"].annotation) == "bool | null"
    assert config_reference.type_name(fields["lr_schedule"].annotation) == "constant | cosine"
    assert config_reference.default_text(fields["betas"]) == "[0.9, 0.999]"
    assert config_reference.default_text(config.RunConfig.model_fields["model"]) == "required"


def test_every_relative_link_in_the_docs_resolves():
    assert broken_links(REPO) == []


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("# A page\n\n## Some part\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-part) [ok](https://example.com/x.md) [gone](docs/b.md)\n"
        "[no heading](docs/a.md#other-part)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md (no such file)",
                                      "README.md: docs/a.md#other-part (no such heading)"]
