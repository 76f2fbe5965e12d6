"""A ``gpipe train --config`` file: TOML or JSON whose keys are :class:`~gpipe.train.config.TrainConfig`
fields (``partitions = 4`` or ``"partitions": 4``; a dash may stand for an underscore), each checked
for its field's type; flags on the command line override them.

Two things beyond the settings, for the paper's configurations (``configs/``, :mod:`gpipe.train.paper`):
a ``[paper]`` table (what the paper reports of the configuration) is no setting, and
:func:`read_config_file` leaves it to :func:`paper_table`; and a relative ``hf_config`` that is not
there from the working directory but is beside the file is taken from beside the file (the
transformers configs that ship with the files: ``hf_config = "hf/transformer-l-3.json"``)."""

from __future__ import annotations

import difflib
import json
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpipe.train.checks import ConfigError, typed
from gpipe.train.config import TrainConfig

__all__ = ["PAPER", "paper_table", "read_config_file"]

PAPER = "paper"  # the table of what the paper reports; not a setting


def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a TOML or JSON file, each a known setting of its field's type (its ``[paper]``
    table left out; a relative ``hf_config`` found beside the file where it is not found here)."""
    data = _read(path)
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    settings = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == PAPER:
            continue
        if name not in kinds:
            close = difflib.get_close_matches(name, kinds, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {', '.join(kinds)}"
            raise ConfigError(f"unknown setting {key!r} in the config file {path!r}; {hint}")
        settings[name] = typed(key, value, kinds[name], where=path)
    beside = Path(path).parent / settings.get("hf_config", "")
    if settings.get("hf_config") and not Path(settings["hf_config"]).exists() and beside.exists():
        settings["hf_config"] = str(beside)
    return settings


def paper_table(path: str) -> dict[str, Any]:
    """The ``[paper]`` table of a config file (empty where it has none)."""
    table = _read(path).get(PAPER, {})
    if not isinstance(table, dict):
        raise ConfigError(
            f"'{PAPER}' in the config file {path!r} is a {type(table).__name__}; it is the table of what the paper "
            "reports ([paper] with model, parameters, source, ...), or leave it out"
        )
    return table


def _read(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config file {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"the config file {path!r} holds a {type(data).__name__}; it must hold an object of settings, "
            'e.g. {"steps": 500, "partitions": 4}'
        )
    return data
