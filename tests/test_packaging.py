"""What ``pip install .`` brings: every third-party module the package imports is a dependency or in
an extra the README tells how to install, and the README's main job (``gpipe demo``: ``gpipe corpus``,
then ``gpipe train --data FOLDER``) runs on the dependencies alone. The modules are read from the
source with ``ast`` (imports anywhere, and ``importlib.import_module`` / ``find_spec`` of a name)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import gpipe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(gpipe.__file__).parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports, or looks up by name, outside gpipe and the
    standard library."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "find_spec")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    tops = {name.split(".")[0] for name in names}
    return {t for t in tops if t not in sys.stdlib_module_names and t not in ("gpipe", "__future__")}


THIRD_PARTY = {name for path in PACKAGE.rglob("*.py") for name in _imported(path)}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(module: str) -> str:
    """The distribution that installs ``module`` (as installed here; else one of the same name)."""
    found = importlib.metadata.packages_distributions().get(module, [module])
    return _normal(found[0])


def _names(requirements: list[str]) -> set[str]:
    return {_normal(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in requirements}  # type: ignore[index]


DEPENDENCIES = _names(PROJECT["dependencies"])
EXTRAS = {name: _names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}


def test_the_walk_finds_what_the_package_imports() -> None:
    assert {"torch", "sentencepiece", "sacrebleu", "transformers", "tensorboard"} <= THIRD_PARTY, THIRD_PARTY


def test_every_module_the_package_imports_is_a_dependency_or_an_extra_the_readme_installs() -> None:
    """``dev`` is the tools of ``make test``, no user's extra: a module only there is missing for a user."""
    readme = (ROOT / "README.md").read_text()
    named = {e for group in re.findall(r"\.\[([\w,-]+)\]", readme) for e in group.split(",")} - {"dev"}
    assert named <= EXTRAS.keys(), f"the README names extras pyproject.toml lacks: {sorted(named - EXTRAS.keys())}"
    offered = DEPENDENCIES.union(*(EXTRAS[e] for e in named))
    missing = sorted(f"{m} ({_distribution(m)})" for m in THIRD_PARTY if _distribution(m) not in offered)
    assert not missing, (
        f"imported by gpipe but neither in pyproject.toml's dependencies nor in an extra the README names "
        f"({', '.join(sorted(named))}): {', '.join(missing)}"
    )


def test_the_readme_main_job_runs_on_the_dependencies_alone(tmp_path: Path) -> None:
    """As after ``pip install .``: every module gpipe imports that no dependency installs is made
    missing (``sys.modules[name] = None``: importing it fails, ``find_spec`` finds nothing)."""
    absent = sorted(m for m in THIRD_PARTY if _distribution(m) not in DEPENDENCIES)
    corpus, out = tmp_path / "corpus", tmp_path / "run"
    code = (
        "import sys\n"
        f"for name in {absent!r}:\n"
        "    sys.modules[name] = None\n"
        "from gpipe.cli import main\n"
        f"assert main(['corpus', '--out', {str(corpus)!r}, '--sizes', '300,100', '--held-out', '4']) == 0\n"
        f"sys.exit(main(['train', '--data', {str(corpus)!r}, '--vocab-size', '64', '--out', {str(out)!r},\n"
        "                '--steps', '1', '--dim', '32', '--heads', '2', '--hidden', '64', '--no-progress']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"without {absent}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert (out / "vocab.model").is_file() and "BLEU" in done.stdout


def test_the_wheel_is_gpipe_pytorch_and_runs_without_the_checkout(tmp_path: Path) -> None:
    """The distribution ``gpipe-pytorch`` (``gpipe`` in the package index is another project), built
    from a copy of the package's files (``pip wheel``), installed into a bare venv that borrows this
    one's dependencies (one ``.pth`` line: the .pth files there, this checkout's editable install among
    them, are not read), and run from an empty folder: ``gpipe schedule`` and ``gpipe train --config
    t2-256-4``, package data. (``make wheel-check``: python -m build, a venv of its own, gpipe demo.)"""
    assert PROJECT["name"] == "gpipe-pytorch"
    source, dist, venv, empty = tmp_path / "source", tmp_path / "dist", tmp_path / "venv", tmp_path / "empty"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)], check=True,
                   timeout=300, capture_output=True)  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    assert wheel.name.startswith("gpipe_pytorch-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    shipped = {f"gpipe/{p.relative_to(PACKAGE)}" for p in PACKAGE.glob("configs/**/*") if p.is_file()}
    assert shipped and shipped <= names and "gpipe/py.typed" in names

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    here = sysconfig.get_paths()["purelib"]
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    there = subprocess.run([str(venv / "bin/python"), "-c", where], check=True, capture_output=True, text=True,
                           timeout=60).stdout.strip()  # fmt: skip
    Path(there, "borrowed.pth").write_text(here + "\n")
    subprocess.run([*pip, "--python", str(venv / "bin/python"), "install", "--no-deps", str(wheel)], check=True,
                   timeout=300, capture_output=True)  # fmt: skip
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    found = subprocess.run([str(venv / "bin/python"), "-c", "import gpipe; print(gpipe.__file__)"], cwd=empty,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert found.stdout.startswith(there), found.stdout + found.stderr  # (the wheel's, never the checkout's)
    for argv in (["schedule"], ["train", "--config", "t2-256-4", "--steps", "2", "--no-progress", "--out", "t2"]):
        done = subprocess.run([str(venv / "bin/gpipe"), *argv], cwd=empty, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, f"gpipe {' '.join(argv)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert "BLEU" in done.stdout and (empty / "t2" / "checkpoints").is_dir()
