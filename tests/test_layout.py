"""The package's layout: the library apart from the applications, no import circle, rooms of a size one
can hold in mind, and ``import gpipe`` light. (The parts and what flows between them:
docs/architecture.md.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpipe

ROOT = Path(gpipe.__file__).parent

# The two parts, by the name under gpipe/ of each module or folder. The library: the engine and its front
# ends; the applications: what is built on it. Every entry of gpipe/ is in exactly one.
LIBRARY = frozenset({
    "__init__", "microbatch", "checkpoint", "rng", "batchnorm", "skip", "tied", "memory", "cache", "auxiliary",
    "shards", "threads", "balance", "schedule", "sequential", "runtime", "distributed", "saving", "engine",  # engine
    "pipeline", "gpipe", "generation", "nonfinite", "health",  # the front ends
})  # fmt: skip
APPLICATIONS = frozenset({
    "models", "recipe", "data", "decode", "evaluation", "evaluator", "translate", "generate", "export", "train",
    "bench", "demo", "commands", "sweep", "runs", "runfile", "cli", "__main__", "hypergradient",
})  # fmt: skip

# What the applications need and the library must not pull in.
HEAVY = (
    "sentencepiece",
    "sacrebleu",
    "matplotlib",
    "tensorboard",
    "transformers",
    "tqdm",
    "PIL",
    "torchvision",
    "optuna",
)

MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("gpipe", *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """The gpipe modules ``name`` imports anywhere in its file: at the top, in functions, for type checking."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from a import b`: the module a.b if there is one, else a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target.startswith("gpipe") and target != name:
                yield target


GRAPH = {name: set(_imported(name, path)) for name, path in MODULES.items()}


def _part(name: str) -> str:
    top = name.split(".")[1] if "." in name else "__init__"
    return "library" if top in LIBRARY else "application" if top in APPLICATIONS else "unknown"


def test_every_entry_of_the_package_is_in_one_part() -> None:
    entries = {
        p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert not LIBRARY & APPLICATIONS
    assert entries == LIBRARY | APPLICATIONS, (
        f"classify {sorted(entries - LIBRARY - APPLICATIONS)} in LIBRARY or APPLICATIONS (and docs/architecture.md); "
        f"gone: {sorted((LIBRARY | APPLICATIONS) - entries)}"
    )


def test_the_library_imports_nothing_of_the_applications() -> None:
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _part(name) == "library"
        for target in targets
        if _part(target) != "library"
    )
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert not _cycles(GRAPH), _cycles(GRAPH)


def test_no_folder_or_module_of_the_package_imports_itself_through_others() -> None:
    """The same at the level of gpipe/'s entries (``gpipe.runtime`` for all of gpipe/runtime/), the root
    package's public API left out (it imports the library to offer it)."""

    def entry(name: str) -> str:
        return ".".join(name.split(".")[:2])

    entries: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if name != "gpipe":
            entries.setdefault(entry(name), set()).update(
                entry(t) for t in targets if entry(t) not in ("gpipe", entry(name))
            )
    assert not _cycles(entries), _cycles(entries)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines: split it along its seams"


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_every_folder_says_what_it_holds_and_what_it_may_import(name: str) -> None:
    """In its docstring, or in a comment under it (where the docstring is a command's help text)."""
    source = MODULES[name].read_text()
    tree = ast.parse(source)
    assert ast.get_docstring(tree), f"{MODULES[name]} has no docstring"
    body = tree.body[1:]
    head = "\n".join(source.splitlines()[: body[0].lineno - 1 if body else None])
    part = "library" if _part(name) == "library" else "application"
    assert part in head.lower(), f"{MODULES[name]}'s docstring does not say it is part of the {part}"
    if name != "gpipe":
        assert "imports" in head, f"{MODULES[name]}'s docstring does not say what the folder may import"


def test_import_gpipe_is_light() -> None:
    """``import gpipe`` loads the library alone: none of the applications' modules or dependencies."""
    code = (  # (torch itself loads tqdm: what it loads is not gpipe's doing)
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import gpipe\n"
        f"print(' '.join(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r})))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('gpipe.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    heavy, loaded = out.stdout.splitlines()
    assert heavy == "", f"import gpipe loads {heavy}"
    assert loaded, "the library's modules are loaded"
    applications = [m for m in loaded.split() if _part(m) != "library"]
    assert not applications, f"import gpipe loads the applications' {applications}"
