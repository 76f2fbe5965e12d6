"""The README as a front page: short, every link resolving (files, and headings of markdown files), its
picture of a schedule what ``gpipe schedule`` draws, its Python example whole."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from gpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading (MyST's ``myst_heading_anchors`` slugs alike)."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fenced, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            found.add(_slug(m[1]))
    return found


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+://", link)]
    assert len(links) >= 20, links  # (the guides, the concepts, the reference)
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve() if path else README
        assert target.exists(), f"README links to {link!r}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README links to {link!r}: {path} has no heading {anchor!r}"


def test_the_readmes_schedule_is_what_gpipe_schedule_draws() -> None:
    text = README.read_text()
    command = re.search(r"`gpipe schedule ([^`]+)`:\n\n```text\n(.*?)```", text, re.S)
    assert command is not None, "the README's schedule picture and the command that draws it"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schedule", *command[1].split()]) == 0
    drawn = [line.rstrip() for line in out.getvalue().splitlines()]
    shown = [line.rstrip() for line in command[2].splitlines()]
    assert shown and all(line in drawn for line in shown), (shown, drawn)


def test_the_readmes_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    monkeypatch.chdir(tmp_path)  # (it writes step.json)
    exec(compile(code, str(README), "exec"), {})
    assert json.loads((tmp_path / "step.json").read_text())["traceEvents"]
