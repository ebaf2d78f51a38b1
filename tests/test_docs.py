"""The documentation a newcomer reads: every link between pages lands on a file (and a heading, where it
names one), every flag of every `voiced` command has its line in the configuration reference, and the README
stays a ten-minute read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", page.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_pages_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: outside the repository
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def command_flags(parser, path=("voiced",)):
    """(command, flag) for every long flag of `voiced` and its sub-commands but `bench` (its suites have their
    own parsers and --help)."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name != "bench":
                    yield from command_flags(sub, (*path, name))
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                yield " ".join(path), flag


def test_every_flag_of_every_command_is_in_the_configuration_reference():
    from voiced.cli import build_parser

    reference = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    missing = sorted({f"`{command} {flag}`" for command, flag in command_flags(build_parser())
                      if not re.search(re.escape(flag) + r"(?![\w-])", reference)})
    assert not missing, f"docs/CONFIGURATION.md has no line for {', '.join(missing)}"


def test_the_readme_stays_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260, "README.md grew past a ten-minute read: move the detail to docs/"
    assert text.index("make run") < text.index("voiced-client file") < 2500
    assert (ROOT / "examples" / "hello.wav").is_file(), "the README's first success streams examples/hello.wav"


def test_the_gpu_suite_page_names_every_gpu_test_and_only_those():
    """docs/GPU_TESTS.md says what each GPU test compares: the lead reads it to know what a GPU run checked."""
    import ast

    tests = {node.name for path in (ROOT / "tests").glob("test_*_gpu.py")
             for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}
    named = set(re.findall(r"`(test_\w+?)(?:\[[^`]*\])?`", (ROOT / "docs" / "GPU_TESTS.md").read_text()))
    named -= {path.stem for path in (ROOT / "tests").glob("test_*_gpu.py")}  # the file column
    assert not tests - named, f"docs/GPU_TESTS.md has no row for {sorted(tests - named)}"
    assert not named - tests, f"docs/GPU_TESTS.md names tests that do not exist: {sorted(named - tests)}"
