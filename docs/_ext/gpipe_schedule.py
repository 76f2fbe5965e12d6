"""The ``gpipe-schedule`` directive: a schedule's timeline drawn at build time by ``gpipe schedule``.

In a page::

    ```{gpipe-schedule} --schedule 1f1b --stages 4 --chunks 8
    :width: 90%

    1F1B: once the pipeline is full, each worker alternates a forward and a backward.
    ```

The argument is the flags of ``gpipe schedule`` (``gpipe schedule -h``), without ``--out``: the directive runs
the real command (:func:`gpipe.cli.main`, in the build's process) with ``--out`` naming a file in the build's
cache (``DOCTREES/gpipe-schedules/``), and the page shows the picture, which Sphinx copies beside the pages
like any image. A command that fails (a bad flag) fails the build with its message. The directive's content,
if any, is the picture's caption (markdown). Options:

- ``:alt:`` the picture's alternative text (default: the command);
- ``:width:`` its width (``80%``, ``600px``; default: the page's width at most);
- ``:name:`` a label to link to it (``{ref}`label```);
- ``:output:`` (no value) also show what the command printed (makespan, bubble, memory) under it;
- ``:format:`` ``svg`` (default) or ``png``.

A page that draws one is read again when gpipe's schedule code changes (its modules are the page's
dependencies), so an incremental build redraws it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shlex
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _format(argument: str | None) -> str:
    return directives.choice(argument, ("svg", "png"))


def _sources() -> list[Path]:
    """The modules whose change changes a drawing: the schedule package and the command."""
    import gpipe.commands.schedule
    import gpipe.schedule

    package = Path(gpipe.schedule.__file__).parent
    return [*sorted(package.rglob("*.py")), Path(gpipe.commands.schedule.__file__)]


def draw(flags: list[str], out: Path) -> str:
    """Run ``gpipe schedule FLAGS --out OUT``; what it printed. A failure raises ``RuntimeError`` with its
    message."""
    from gpipe.cli import main

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        status = main(["schedule", *flags, "--out", str(out)])
    if status != 0 or not out.is_file():
        said = (errors.getvalue() or printed.getvalue()).strip()
        raise RuntimeError(f"`gpipe schedule {shlex.join(flags)}` failed (exit status {status}): {said}")
    return printed.getvalue()


class ScheduleDirective(SphinxDirective):
    """``{gpipe-schedule} FLAGS``: the timeline ``gpipe schedule FLAGS --out FILE`` draws."""

    has_content = True
    required_arguments = 0
    optional_arguments = 1
    final_argument_whitespace = True
    option_spec: ClassVar[dict[str, Any]] = {
        "alt": directives.unchanged,
        "width": directives.length_or_percentage_or_unitless,
        "name": directives.unchanged,
        "output": directives.flag,
        "format": _format,
    }

    def run(self) -> list[nodes.Node]:
        flags = shlex.split(self.arguments[0]) if self.arguments else []
        if any(f == "--out" or f.startswith("--out=") for f in flags):
            raise self.error("gpipe-schedule: leave --out out; the directive names the file")
        suffix = self.options.get("format", "svg")
        key = hashlib.sha256(shlex.join([*flags, suffix]).encode()).hexdigest()[:16]
        folder = Path(self.env.app.doctreedir) / "gpipe-schedules"
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"schedule-{key}.{suffix}"
        try:
            printed = draw(flags, out)
        except RuntimeError as exc:
            raise self.error(str(exc)) from None
        for source in _sources():
            self.env.note_dependency(str(source))

        here = (Path(self.env.srcdir) / self.env.docname).parent
        command = f"gpipe schedule {shlex.join(flags)}".strip()
        image = nodes.image(uri=_rel(out, here))
        image["alt"] = self.options.get("alt", command)
        if "width" in self.options:
            image["width"] = self.options["width"]
        figure = nodes.figure("", image, classes=["gpipe-schedule"])
        figure["align"] = "center"
        if self.content:
            parsed = self.parse_content_to_nodes()
            paragraph = parsed[0] if parsed and isinstance(parsed[0], nodes.paragraph) else None
            if paragraph is None or len(parsed) > 1:
                raise self.error("gpipe-schedule: the caption (the directive's content) must be one paragraph")
            figure += nodes.caption(paragraph.rawsource, "", *paragraph.children)
        self.add_name(figure)
        result: list[nodes.Node] = [figure]
        if "output" in self.options:
            text = f"$ {command}\n{printed.rstrip()}"
            block = nodes.literal_block(text, text, language="text", classes=["gpipe-schedule-output"])
            result.append(block)
        return result


def _rel(path: Path, start: Path) -> str:
    """``path`` relative to ``start`` (``..`` allowed), as a posix path: how a page names an image."""
    return Path(os.path.relpath(path, start)).as_posix()


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("gpipe-schedule", ScheduleDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
