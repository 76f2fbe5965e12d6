"""A ``gpipe train --config`` file: TOML or JSON whose keys are :class:`~gpipe.train.config.TrainConfig`
fields (``partitions = 4`` or ``"partitions": 4``; a dash may stand for an underscore), each checked
for its field's type; flags on the command line override them."""

from __future__ import annotations

import difflib
import json
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpipe.train.checks import ConfigError, typed
from gpipe.train.config import TrainConfig

__all__ = ["read_config_file"]


def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a TOML or JSON file, each a known setting of its field's type."""
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
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    settings = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in kinds:
            close = difflib.get_close_matches(name, kinds, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {', '.join(kinds)}"
            raise ConfigError(f"unknown setting {key!r} in the config file {path!r}; {hint}")
        settings[name] = typed(key, value, kinds[name], where=path)
    return settings
