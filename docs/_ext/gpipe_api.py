"""The API pages' docstrings: their ``Args:`` sections, classes' bases, and references to gpipe's internals.

A docstring's ``Args:`` section (each ``name: text`` indented under it) becomes the parameter list, and
``Returns:`` its return value, as autodoc reads them: the text after a colon stays text (Napoleon would read
``The number of layers: ...`` as a type). autodoc's "Bases: object" is dropped; other bases stay. Data a module
imports (``gpipe.schedule.STAGE_WIDE``) gets the docstring written where it is defined, not its type's. A
dataclass field without a docstring gets its ``help`` metadata (``TrainConfig``'s: the help of its flag, and a
link to the flag).

The docstrings also name internal modules and helpers (``:mod:`gpipe.runtime.decoding```, a TypeVar in a
signature). The API pages document the public modules only, so such a reference has no target, and with
``nitpicky`` it would fail the build although nothing is wrong. A reference whose target is not documented is
looked up in the code instead: when it names a gpipe module or object that exists (tried as Python resolves
it: inside the current class, the current module, then as written), it is shown as code, without a link;
when it names nothing (a typo, a renamed or removed function), the warning stands and a strict build fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer

_MISSING = object()


def lookup(dotted: str) -> Any:
    """The module, or attribute of one, that ``dotted`` names in the package ``gpipe``; else ``_MISSING``."""
    if dotted != "gpipe" and not dotted.startswith("gpipe."):
        return _MISSING
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
            return _MISSING
        return found
    return _MISSING


def exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute of one, of the package ``gpipe``."""
    return lookup(dotted) is not _MISSING


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


def defined_doc(name: str, obj: Any) -> list[str]:
    """The docstring of data a module imports (``gpipe.schedule.STAGE_WIDE``), read where it is defined: the
    string after its assignment in the gpipe module whose attribute of that name it is."""
    short = name.rpartition(".")[2]
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("gpipe.") or getattr(module, short, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        if ("", short) in docs:
            return list(docs[("", short)])
    return []


# A dataclass of a command's settings, by its qualified name: the command whose flags its fields are.
SETTINGS = {"gpipe.train.config.TrainConfig": "train"}
_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z](?:[\w-]*\w)?")


def field_help(name: str) -> tuple[str, str | None, dict[str, str]] | None:
    """A dataclass field's ``help`` metadata; for a command's settings (:data:`SETTINGS`) also the command and
    its flags (each option string, and ``dest:FIELD``: the flag that sets the field)."""
    owner_name, _, field_name = name.rpartition(".")
    owner = lookup(owner_name)
    if not dataclasses.is_dataclass(owner) or not isinstance(owner, type):
        return None
    field = {f.name: f for f in dataclasses.fields(owner)}.get(field_name)
    if field is None or "help" not in field.metadata:
        return None
    command = SETTINGS.get(f"{owner.__module__}.{owner.__qualname__}")
    flags: dict[str, str] = {}
    if command:
        from gpipe.cli import command_parser

        for action in command_parser(command)._actions:
            flags.update({o: o for o in action.option_strings})
            if action.option_strings:
                flags.setdefault(f"dest:{action.dest}", action.option_strings[0])
    return str(field.metadata["help"]), command, flags


def _option(command: str, flag: str, docname: str) -> nodes.Node:
    literal = nodes.literal(flag, flag, classes=["xref", "std", "std-option"])
    target = f"gpipe {command} {flag}"
    return pending_xref("", literal, refdomain="std", reftype="option", reftarget=target, refexplicit=True,
                        refwarn=True, refdoc=docname)  # fmt: skip


def _field_docs(app: Sphinx, doctree: nodes.document) -> None:
    """Fill an undocumented dataclass field's entry with its ``help``, flags linked, and the flag that sets it."""
    for desc in list(doctree.findall(addnodes.desc)):
        if desc.get("domain") != "py" or desc.get("objtype") != "attribute":
            continue
        signature, content = desc[0], desc[-1]
        if not isinstance(content, addnodes.desc_content) or len(content):
            continue
        found = field_help(f"{signature.get('module')}.{signature.get('fullname')}")
        if found is None:
            continue
        text, command, flags = found
        paragraph, at = nodes.paragraph(), 0
        for match in _FLAG.finditer(text):
            paragraph += nodes.Text(text[at : match.start()])
            flag = match.group(0)
            linked = command and flag in flags
            paragraph += _option(command, flag, app.env.docname) if linked else nodes.literal(flag, flag)
            at = match.end()
        paragraph += nodes.Text(text[at:])
        content += paragraph
        field = str(signature.get("fullname")).rpartition(".")[2]
        if command and f"dest:{field}" in flags:
            option = _option(command, flags[f"dest:{field}"], app.env.docname)
            content += nodes.paragraph("", "", nodes.Text("Set by "), option, nodes.Text("."))


def _docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what == "data" and (not lines or "\n".join(lines).strip() == (type(obj).__doc__ or "").strip()):
        lines[:] = defined_doc(name, obj)  # not its type's docstring (dict's, tuple's)
    lines[:] = fields(lines)


def _no_object_base(app: Sphinx, doctree: nodes.document) -> None:
    """Drop autodoc's "Bases: object": it says nothing (other bases stay)."""
    for paragraph in list(doctree.findall(nodes.paragraph)):
        if paragraph.astext() == "Bases: object":
            paragraph.parent.remove(paragraph)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _docstring)
    app.connect("doctree-read", _no_object_base)
    app.connect("doctree-read", _field_docs)
    app.connect("missing-reference", _unlinked)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
