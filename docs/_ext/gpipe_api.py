"""The API pages' docstrings: their ``Args:`` sections, and references to gpipe's internals.

A docstring's ``Args:`` section (each ``name: text`` indented under it) becomes the parameter list, and
``Returns:`` its return value, as autodoc reads them: the text after a colon stays text (Napoleon would read
``The number of layers: ...`` as a type).

Cross-references to gpipe's own modules and objects that have no page:

The docstrings name internal modules and helpers too (``:mod:`gpipe.runtime.decoding```, a TypeVar in a
signature). The API pages document the public modules only, so such a reference has no target; with
``nitpicky`` it would fail the build although nothing is wrong. A reference whose target is not documented is
looked up in the code instead: when it names a gpipe module or object that exists (tried as Python resolves
it: inside the current class, the current module, then as written), it is shown as code, without a link;
when it names nothing (a typo, a renamed or removed function), the warning stands and a strict build fails.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment


def exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute of one, of the package ``gpipe``."""
    if dotted != "gpipe" and not dotted.startswith("gpipe."):
        return False
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            return False
        return True
    return False


def _candidates(node: pending_xref) -> list[str]:
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    found = []
    if module and cls:
        found.append(f"{module}.{cls}.{target}")
    if module:
        found.append(f"{module}.{target}")
    found.append(target)
    return found


def _unlinked(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.Element | None:
    if node.get("refdomain") != "py":
        return None
    if any(exists(name) for name in _candidates(node)):
        return contnode  # a real part of gpipe without a page: code, no link, no warning
    return None


_ENTRY = re.compile(r"^    (\*{0,2}\w+(?:, \*{0,2}\w+)*)( \(.*?\))?: ?(.*)$")  # name: text, or a, b: text


def fields(lines: list[str]) -> list[str]:
    """``lines`` with their ``Args:`` entries as ``:param name:`` fields (one per name where several share a
    text) and ``Returns:`` as ``:returns:``."""
    out: list[str] = []
    section: str | None = None
    entries: list[tuple[list[str], list[str]]] = []  # the section's entries: names, text lines

    def close() -> None:
        for names, text in entries:
            joined = " ".join(text)
            out.extend(f":{name}: {joined}" for name in names)
        entries.clear()

    for line in lines:
        if line in ("Args:", "Returns:") and (not out or not out[-1].strip()):
            close()
            section = line
            continue
        if section and not line.strip():
            close()
            out.append(line)
            continue
        if section and line.strip() and not line.startswith("    "):
            close()
            section = None  # the section ended: a line at the docstring's own indentation
        if not section:
            out.append(line)
            continue
        entry = _ENTRY.match(line) if section == "Args:" else None
        if entry:
            entries.append(([f"param {n.lstrip('*')}" for n in entry[1].split(", ")], [entry[3]]))
        elif section == "Returns:" and not entries and line.strip():
            entries.append((["returns"], [line.strip()]))
        elif line.strip() and entries:
            entries[-1][1].append(line.strip())  # a continuation of the entry above
    close()
    return out


def _docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    lines[:] = fields(lines)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _docstring)
    app.connect("missing-reference", _unlinked)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
