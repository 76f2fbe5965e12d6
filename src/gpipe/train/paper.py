"""The paper's configurations: the ``gpipe train --config`` files of ``configs/``, each a named
experiment of the paper (its model, its partitions K and micro-batches M where the paper gives them)
with what the paper reports about it in a ``[paper]`` table, and its model built on the meta device,
which costs nothing whatever its size.

The files ship in the package as ``gpipe/configs/`` (``configs/`` at the top of a source checkout is
a link to that folder), so an installed gpipe finds them too; :func:`find` is the one lookup, used by
``gpipe train --config NAME``, ``gpipe bench`` and the tests::

    from gpipe.train import paper
    paper.names()                        # ['amoebanet-d-18-208', ..., 't6-8192-16', ...]
    config = paper.read("t6-8192-16")    # its settings, the paper's figures, gpipe's count
    model = paper.meta_model(config.train_config())  # on the meta device

A ``[paper]`` table holds ``model`` (the paper's name of it), ``parameters`` (the paper's figure as
the paper writes it, '' where it gives none), ``source`` (where the figures are), ``result`` (what
the paper reports of the run, or that it reports none), ``counted`` (gpipe's count of the file's
model) and, where that count is more than 1% from the paper's figure, ``gap`` (why); ``column``
names a Table 1 row's column (``"Pipeline-8"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe.models import hf
from gpipe.train.checks import ConfigError
from gpipe.train.config import TrainConfig
from gpipe.train.config_file import paper_table, read_config_file
from gpipe.train.setup import image_model, make_data, make_model, translation_model

__all__ = ["FOLDER", "PaperConfig", "find", "meta_model", "names", "parameter_count", "parse_count", "read"]

FOLDER = Path(__file__).resolve().parents[1] / "configs"
"""Where the files are: ``gpipe/configs`` in the package (package data)."""

_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9}
_KEYS = {"model": str, "parameters": str, "source": str, "result": str, "counted": int, "gap": str, "column": str,
         "active": int}  # fmt: skip
_REQUIRED = ("model", "parameters", "source", "result", "counted")


@dataclass(frozen=True)
class PaperConfig:
    """One file of ``configs/``: its ``settings`` (``TrainConfig`` fields) and its ``[paper]`` table."""

    name: str
    path: Path
    settings: dict[str, Any]
    model: str
    parameters: str
    source: str
    result: str
    counted: int
    gap: str = ""
    column: str = ""
    active: int = 0  # a mixture of experts': the parameters a token goes through

    @property
    def paper_count(self) -> float | None:
        """The paper's parameter count as a number (``"5.3B"``: 5.3e9), or None where it gives none."""
        return parse_count(self.parameters) if self.parameters else None

    def train_config(self, **overrides: Any) -> TrainConfig:
        """The file's settings (then ``overrides``) as a checked :class:`TrainConfig`."""
        cfg = TrainConfig(**{**self.settings, **overrides})
        cfg.check()
        return cfg

    def hf_settings(self) -> dict[str, Any]:
        """A ``--model hf`` file's transformers config (its JSON, read without transformers)."""
        if self.settings.get("model") != "hf" or not self.settings.get("hf_config"):
            raise ValueError(f"the paper's configuration {self.name!r} is not a --model hf one with an --hf-config")
        config: dict[str, Any] = json.loads(Path(self.settings["hf_config"]).read_text())
        return config


def names() -> list[str]:
    """The names of the paper's configurations (their files' stems), sorted."""
    return sorted(p.stem for p in FOLDER.glob("*.toml"))


def find(name: str, *, missing_ok: bool = False) -> Path:
    """The file of the paper's configuration ``name`` (``"t6-8192-16"``, with or without ``.toml``);
    a ``name`` that is a file is that file. Neither: a :class:`ConfigError` naming the known ones, or
    with ``missing_ok`` ``name`` as it is (for the reader to refuse)."""
    given = Path(name)
    if given.is_file():
        return given
    stem = given.name.removesuffix(".toml")
    if given.parent == Path(".") and (FOLDER / f"{stem}.toml").is_file():
        return FOLDER / f"{stem}.toml"
    if missing_ok:
        return given
    raise ConfigError(
        f"no config file {name!r}, and no paper's configuration of that name in {str(FOLDER)!r}; give a TOML or "
        f"JSON file, or one of {', '.join(names())}"
    )


def read(name: str) -> PaperConfig:
    """The paper's configuration ``name`` (or file): its settings and its ``[paper]`` table, checked."""
    path = find(name)
    table = paper_table(str(path))
    missing = [key for key in _REQUIRED if key not in table]
    wrong = [f"{k} ({v!r})" for k, v in table.items() if k not in _KEYS or not isinstance(v, _KEYS[k])]
    if missing or wrong:
        raise ConfigError(
            f"the [paper] table of {str(path)!r} lacks {', '.join(missing) or 'nothing'} and has wrong or unknown "
            f"entries {', '.join(wrong) or 'none'}: it needs {', '.join(_REQUIRED)} ('counted' an int, the rest "
            "strings), and may have gap and column"
        )
    if table["parameters"]:
        parse_count(table["parameters"], where=str(path))
    known = {f.name for f in fields(PaperConfig)}
    return PaperConfig(name=path.stem, path=path, settings=read_config_file(str(path)),
                       **{k: v for k, v in table.items() if k in known})  # fmt: skip


def parse_count(text: str, where: str = "") -> float:
    """``"282.2M"``, ``"1.05B"``, ``"400M"`` as a number; a :class:`ConfigError` otherwise."""
    unit = _UNITS.get(text[-1:])
    try:
        return float(text[:-1]) * unit if unit else float(text)
    except ValueError:
        place = f" in {where!r}" if where else ""
        raise ConfigError(
            f"cannot read the parameter count {text!r}{place}: write it as the paper does, e.g. '282.2M' or '1.05B'"
        ) from None


def meta_model(cfg: TrainConfig) -> nn.Module:
    """The model ``gpipe train`` builds for ``cfg``, on the meta device, without its data: a
    transformer's vocabulary is ``vocab_size`` where given (what ``--data FOLDER`` trains) and its
    positions ``max_length``, else the synthetic data's; AmoebaNet-D's images have ``classes`` classes
    and three channels; ``--model hf`` is its config's model (not cut into pipeline layers: the same
    parameters)."""
    if cfg.model == "amoebanet":
        with torch.device("meta"):
            return image_model(cfg, cfg.classes, 3)
    if cfg.model == "transformer" and cfg.vocab_size:
        with torch.device("meta"):
            return translation_model(cfg, cfg.vocab_size, cfg.max_length)
    if cfg.model == "hf" and (config := cfg.hf_model_config()) is not None:
        return hf.build(config)
    return make_model(cfg, make_data(cfg))  # (synthetic data: small, made at once)


def parameter_count(model: nn.Module) -> int:
    """The parameters of ``model`` (each counted once, shared ones too)."""
    return sum(p.numel() for p in model.parameters())
