"""Links into, and out of, markdown files that a page includes from elsewhere in the repository.

``docs/benchmarks.md`` includes ``benchmarks/README.md`` (MyST's ``{include}``) rather than copying it. The
included file's links are written relative to itself, for GitHub, while MyST resolves the included text's
links against the including page. At build time, and without touching the files:

- in included text (``include-read``), every relative link or image is rewritten relative to the including
  page;
- in any text (``source-read`` and ``include-read``), a link to a file that a page includes becomes a link
  to that page, with its ``#anchor``: ``docs/hf.md``'s ``../benchmarks/README.md#...`` lands on the
  benchmarks page; a link to another file of the repository outside ``docs/`` (a report, a JSON file, a
  script) becomes a download (MyST's ``path:``, Sphinx copying the file beside the pages); a link to a folder
  of the repository (``../configs/``), which no page shows, becomes its text, unlinked.

A link to nothing is left as it is: MyST names it, and a strict build fails.

Code blocks are left alone. The included files are found by reading the pages' ``{include}`` directives.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

# ```{include} PATH or :::{include} PATH
_INCLUDE = re.compile(r"^\s*(?:`{3,}|:{3,})\{include\}\s+(\S+)", re.MULTILINE)
# [text](target "title") and ![alt](target); [label]: target
_INLINE = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target><[^>\n]*>|[^\s)]+)(?P<title>\s+\"[^\"\n]*\")?\)")
_DEFINITION = re.compile(r"^(?P<lead> {0,3}\[[^\]\n]+\]:\s*)(?P<target>\S+)", re.MULTILINE)
_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,}|:{3,})\s*(?P<info>.*)$")
_SCHEME = re.compile(r"^[A-Za-z][\w+.-]*:")
_CODE_DIRECTIVES = ("{code-block}", "{code}", "{sourcecode}", "{literalinclude}")


def _included(srcdir: Path, exclude: set[Path]) -> dict[Path, Path]:
    """Every file a page includes, by its resolved path: the including page's source."""
    found: dict[Path, Path] = {}
    for page in sorted(srcdir.rglob("*.md")):
        if any(part.startswith(("_", ".")) for part in page.relative_to(srcdir).parts) or page in exclude:
            continue
        for target in _INCLUDE.findall(page.read_text(encoding="utf-8")):
            found[(page.parent / target).resolve()] = page
    return found


def _outside_code(text: str) -> list[tuple[int, int]]:
    """The character spans of ``text`` outside code blocks (directive fences, whose content is markdown,
    count as outside)."""
    spans: list[tuple[int, int]] = []
    stack: list[tuple[str, int, bool]] = []  # the open fences: character, length, is code
    at = start = 0
    for line in text.splitlines(keepends=True):
        match = _FENCE.match(line.rstrip("\n"))
        in_code = any(code for *_, code in stack)
        if match:
            fence, info = match["fence"], match["info"].strip()
            if stack and fence[0] == stack[-1][0] and len(fence) >= stack[-1][1] and not info:
                stack.pop()
                if in_code and not any(code for *_, code in stack):
                    start = at + len(line)
            elif not in_code:
                code = fence[0] != ":" and (not info.startswith("{") or info.split()[0] in _CODE_DIRECTIVES)
                stack.append((fence[0], len(fence), code))
                if code:
                    spans.append((start, at + len(line)))
        at += len(line)
    if not any(code for *_, code in stack):
        spans.append((start, at))
    return spans


class _Rewriter:
    def __init__(self, app: Sphinx) -> None:
        self.srcdir = Path(app.srcdir).resolve()
        self.suffixes = tuple(app.config.source_suffix)
        exclude = {(self.srcdir / p).resolve() for p in app.config.exclude_patterns if "*" not in p}
        self.included = _included(self.srcdir, exclude)

    def target(self, target: str, here: Path, page: Path, image: bool) -> str | None:
        """``target``, written in a file of folder ``here``, as the page of folder ``page`` must name it; None
        for a link to a folder of the repository, which no page shows (its text stays, unlinked)."""
        bare = target[1:-1] if target.startswith("<") and target.endswith(">") else target
        if not bare or bare.startswith(("#", "/")) or _SCHEME.match(bare):
            return target
        path, hashmark, fragment = bare.partition("#")
        resolved = (here / path).resolve()
        if resolved in self.included and not image:
            return os.path.relpath(self.included[resolved], page) + hashmark + fragment
        inside = resolved.is_relative_to(self.srcdir)
        in_repository = resolved.is_relative_to(self.srcdir.parent) and resolved.exists()
        if image or inside or not in_repository:
            # a page, an image, or a dead link (MyST names it): only included text needs its path rewritten
            return target if here == page else os.path.relpath(resolved, page) + hashmark + fragment
        if resolved.is_dir():
            return None
        return "path:" + os.path.relpath(resolved, page)  # a file of the repository: a download

    def text(self, text: str, here: Path, page: Path) -> str:
        def inline(match: re.Match[str]) -> str:
            new = self.target(match["target"], here, page, image=bool(match["bang"]))
            if new is None:
                return match["text"]
            return f"{match['bang']}[{match['text']}]({new}{match['title'] or ''})"

        def definition(match: re.Match[str]) -> str:
            new = self.target(match["target"], here, page, image=False)
            return match[0] if new is None else match["lead"] + new

        out, at = [], 0
        for start, end in _outside_code(text):
            out.append(text[at:start])
            out.append(_DEFINITION.sub(definition, _INLINE.sub(inline, text[start:end])))
            at = end
        out.append(text[at:])
        return "".join(out)


def _page_folder(app: Sphinx, docname: str) -> Path:
    return (Path(app.srcdir) / app.env.doc2path(docname, base=False)).resolve().parent


def _on_source(app: Sphinx, docname: str, source: list[str]) -> None:
    if Path(app.env.doc2path(docname)).suffix == ".md":
        folder = _page_folder(app, docname)
        source[0] = _rewriter(app).text(source[0], folder, folder)


def _on_include(app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]) -> None:
    if relative_path.suffix != ".md" or app.env.docname is None:
        return
    included = (Path(app.srcdir) / relative_path).resolve()
    content[0] = _rewriter(app).text(content[0], included.parent, _page_folder(app, app.env.docname))


def _rewriter(app: Sphinx) -> _Rewriter:
    found: _Rewriter | None = getattr(app, "_gpipe_links", None)
    if found is None:
        found = _Rewriter(app)
        app._gpipe_links = found  # type: ignore[attr-defined]
    return found


def _reset(app: Sphinx, *args: Any) -> None:
    app._gpipe_links = None  # type: ignore[attr-defined]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", _reset)
    app.connect("source-read", _on_source)
    app.connect("include-read", _on_include)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
