"""The documentation site (docs/, docs/README.md): it builds strictly (a warning, a broken cross-reference or a
dead internal link fails it), its command-line reference lists every flag each command's ``-h`` lists, and
every code block of its pages marked runnable runs.

Sphinx and MyST are the ``docs`` extra, which ``make`` installs with ``dev``: like the other tools of the
tests, their absence fails these tests rather than skipping them (the extras that skip, such as ``hf``, are
features of gpipe a user may not install; building the documentation is part of testing it)."""

from __future__ import annotations

import argparse
import html
import importlib
import os
import re
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import markdown_it
    import myst_parser  # noqa: F401
    import sphinx  # noqa: F401
except ImportError as missing:
    pytest.fail(
        f"{missing.name} is not installed: the docs extra (make; or pip install -c constraints.txt -e '.[docs]')",
        pytrace=False,
    )

from gpipe.cli import COMMANDS, command_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 240


def _sphinx(source: Path, out: Path, *, confdir: Path = DOCS) -> subprocess.CompletedProcess[str]:
    """``make docs``'s build of ``source`` into ``out/html``, in a process of its own."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    command += ["-c", str(confdir), "-d", str(out / "doctrees"), str(source), str(out / "html")]
    return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the tests of this module: its html folder."""
    out = tmp_path_factory.mktemp("site")
    done = _sphinx(DOCS, out)
    assert done.returncode == 0, f"the strict build failed:\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
    return out / "html"


def test_the_site_builds_strictly(site: Path) -> None:
    pages = [p.relative_to(DOCS).with_suffix(".html") for p in DOCS.rglob("*.md") if "_build" not in p.parts]
    missing = [str(p) for p in pages if p != Path("README.html") and not (site / p).is_file()]
    assert not missing, f"pages not built: {missing}"
    # the landing page's timeline was drawn by gpipe schedule during the build
    drawn = re.findall(r'<img[^>]+src="(_images/schedule-[0-9a-f]+\.svg)"', (site / "index.html").read_text())
    assert drawn and (site / drawn[0]).stat().st_size > 1000, "index.html shows no schedule timeline"
    # the API reference is drawn from the docstrings of what each public module exports: every name of its
    # __all__ documented there (gpipe's page links those documented with their own module)
    for name in ("gpipe", "schedule", "balance", "saving", "sequential", "skip", "models", "decode"):
        module = importlib.import_module("gpipe" if name == "gpipe" else f"gpipe.{name}")
        page = (site / f"reference/api/{name}.html").read_text()
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        absent = [n for n in module.__all__ if f'id="{module.__name__}.{n}"' not in page and n not in text]
        assert not absent, f"reference/api/{name}.md lacks {absent}"
    assert 'id="gpipe.Pipeline"' in (site / "reference/api/gpipe.html").read_text()
    # benchmarks/README.md is included, its relative links rewritten: reports are downloads, nothing dead
    benchmarks = (site / "benchmarks.html").read_text()
    assert 'href="_downloads/' in benchmarks and "results/bench/report.md" not in re.findall(
        r'href="([^"]+)"', benchmarks
    )


def test_a_strict_build_fails_on_what_is_broken(tmp_path: Path) -> None:
    """The same configuration on a page with a dead link, a dead anchor, a reference to a function gpipe lacks
    and a timeline of a bad command: the build fails and names each, and nothing else (a reference to an
    internal module that exists, a timeline with its options and a link to it, links to a file and a folder
    outside the documentation are fine)."""
    source = tmp_path / "source"
    source.mkdir()
    (tmp_path / "data.txt").write_text("a file of the repository, outside the documentation\n")
    (tmp_path / "folder").mkdir()
    (source / "index.md").write_text(
        "# Broken\n\n"
        "[a dead link](nowhere.md), [a dead anchor](#no-such-heading), {py:func}`gpipe.no_such_function`, "
        "{py:mod}`gpipe.runtime.decoding`, {ref}`the timeline <timeline>`, [a file](../data.txt), "
        "[a folder](../folder/).\n\n"
        "```{gpipe-schedule} --stages 0\n```\n\n"
        "```{gpipe-schedule} --schedule zb-h1 --stages 2 --chunks 4\n:name: timeline\n:output:\n:format: png\n\n"
        "ZB-H1 on two workers.\n```\n\n"
        "```{toctree}\n:hidden:\n\nreference/cli\n```\n"  # the page gpipe_cli writes into any source
    )
    done = _sphinx(source, tmp_path / "out")
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    for problem in ("nowhere.md", "no-such-heading", "gpipe.no_such_function", "gpipe schedule --stages 0"):
        assert problem in said, f"{problem!r} not reported:\n{said}"
    assert len(re.findall(r"(WARNING|ERROR):", said)) == 4, said  # and nothing else
    page = (tmp_path / "out/html/index.html").read_text()  # written despite the failure (--keep-going)
    assert re.search(r'<img[^>]+src="_images/schedule-[0-9a-f]+\.png"', page) and "ZB-H1 on two workers." in page
    assert "$ gpipe schedule --schedule zb-h1 --stages 2 --chunks 4" in html.unescape(page) and "bubble" in page
    # links written for GitHub: a file outside the documentation is a download, a folder its text
    assert re.search(r'href="_downloads/[0-9a-f]+/data\.txt"', page) and "a folder" in page
    assert "../folder" not in page


# --- the command-line reference ---------------------------------------------------------------------------


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``gpipe COMMAND -h`` prints."""
    with pytest.raises(SystemExit) as exited:
        main([command, "-h"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _listed(help_text: str) -> set[str]:
    """The flags and positional arguments an argparse ``-h`` lists (not those its prose mentions)."""
    found: set[str] = set()
    positional = False
    for line in help_text.splitlines():
        if not line.startswith(" "):
            positional = line == "positional arguments:"
            continue
        entry = re.match(r"  (\S.*?)(?:\s{2,}|$)", line)
        if not entry:
            continue
        if entry[1].startswith("-"):
            found.update(part.split()[0] for part in entry[1].split(", "))
        elif positional:
            found.add(entry[1].split()[0])
    return found


def _documented_options(site: Path) -> dict[str, set[str]]:
    """The options the site documents (its inventory's ``std:cmdoption`` entries), by program."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    found: dict[str, set[str]] = {}
    for line in body.splitlines():
        entry = re.match(r"(.+?)\s+std:cmdoption\s+-?\d+\s", line)
        if entry:
            program, _, option = entry[1].partition(".")
            found.setdefault(program, set()).add(option)
    return found


def test_the_cli_reference_lists_every_flag_of_every_command(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    documented = _documented_options(site)
    for command in COMMANDS:
        listed = _listed(_help(command, capsys))
        assert "-h" in listed and len(listed) > 2, f"gpipe {command} -h: nothing read from it"
        shown = documented.get(f"gpipe-{command}", set())
        assert listed == shown, (
            f"gpipe {command}: -h lists {sorted(listed - shown)} the reference lacks; "
            f"the reference has {sorted(shown - listed)} -h does not list"
        )
    # each with the help text -h prints
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", (site / "reference/cli.html").read_text())).split())
    for command in COMMANDS:
        parser = command_parser(command)
        for action in parser._actions:
            if action.help != argparse.SUPPRESS:
                said = " ".join(parser._get_formatter()._expand_help(action).split())
                assert said in text, f"gpipe {command} {'/'.join(action.option_strings) or action.dest}: {said!r}"


# --- runnable code blocks -----------------------------------------------------------------------------------

LANGUAGES = {"python", "bash", "sh"}
DEFAULT_TIMEOUT = 120


@dataclass(frozen=True)
class Block:
    """A code block marked runnable: ```python runnable (or bash, sh), optionally timeout=SECONDS."""

    language: str
    code: str
    line: int  # where its fence opens, 1-based
    timeout: float


def runnable_blocks(text: str) -> list[Block]:
    """The page's runnable blocks, in order: fenced blocks whose info string is a language then ``runnable``."""
    blocks = []
    for token in markdown_it.MarkdownIt("commonmark").parse(text):
        words = token.info.split() if token.type == "fence" else []
        if len(words) >= 2 and words[0] in LANGUAGES and words[1] == "runnable":
            options = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            line = token.map[0] + 1 if token.map else 0
            blocks.append(Block(words[0], token.content, line, float(options.get("timeout", DEFAULT_TIMEOUT))))
    return blocks


def run_blocks(page: str, blocks: list[Block], folder: Path) -> None:
    """Run ``blocks`` in order in ``folder`` (shared by them: a block may use what an earlier one wrote), each in
    a process of its own with this Python's environment first on PATH and this checkout's gpipe importable."""
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH", "")] if p)
    for block in blocks:
        script = folder / f"block-{block.line}.{'py' if block.language == 'python' else 'sh'}"
        script.write_text(block.code)
        command = (
            [sys.executable, script.name] if block.language == "python" else ["bash", "-euo", "pipefail", script.name]
        )
        try:
            done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=block.timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{page}:{block.line}: the {block.language} block ran past {block.timeout:g} s")
        if done.returncode != 0:
            pytest.fail(
                f"{page}:{block.line}: the {block.language} block failed (exit status {done.returncode}):\n"
                f"{block.code}\n--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
            )


def _pages() -> list[Path]:
    skip = {DOCS / "README.md", DOCS / "reference" / "cli.md"}
    return [p for p in sorted(DOCS.rglob("*.md")) if p not in skip and not {"_build", "_ext"} & set(p.parts)]


RUNNABLE = [p for p in _pages() if runnable_blocks(p.read_text())]


def test_runnable_blocks_are_found_and_run_in_order(tmp_path: Path) -> None:
    page = (
        "```python runnable\n"
        "from pathlib import Path\n"
        "Path('made.txt').write_text('1f1b')\n"
        "```\n\n"
        "```python\nraise SystemExit('not marked: never run')\n```\n\n"
        "````markdown\n```bash runnable\nexit 1\n```\n````\n\n"
        "```bash runnable timeout=60\n"
        'gpipe schedule --schedule "$(cat made.txt)" --stages 2 --chunks 2 > out.txt\n'
        "grep -q bubble out.txt\n"
        "```\n"
    )
    blocks = runnable_blocks(page)
    assert [(b.language, b.line, b.timeout) for b in blocks] == [("python", 1, 120.0), ("bash", 16, 60.0)]
    run_blocks("sample.md", blocks, tmp_path)
    assert "bubble" in (tmp_path / "out.txt").read_text()
    with pytest.raises(pytest.fail.Exception, match=r"sample\.md:3: the bash block failed"):
        run_blocks("sample.md", [Block("bash", "false\n", 3, 10.0)], tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(DOCS)) for p in RUNNABLE])
def test_the_runnable_blocks_of_a_page_run(page: Path, tmp_path: Path) -> None:
    run_blocks(str(page.relative_to(ROOT)), runnable_blocks(page.read_text()), tmp_path)
