"""The paper's configurations (``configs/``, :mod:`gpipe.train.paper`): every file is a ``gpipe train``
config whose model, built on the meta device, has the count its ``[paper]`` table states, within 1%
of the paper's figure unless the table says why not; the small ones train; the folder is found from
the package, and ``configs/`` at the top of the checkout is that folder."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.models.moe import active_parameters
from gpipe.train import ConfigError, paper, parse
from gpipe.train.config_file import read_config_file

ROOT = Path(__file__).resolve().parents[1]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NAMES = paper.names()
SMALL = ("t2-256-4", "amoebanet-d-6-16")


def _needs(name: str) -> list[pytest.MarkDecorator]:
    hf = paper.read(name).settings.get("model") == "hf"
    return [pytest.mark.skipif(hf and not HAS_TRANSFORMERS, reason="--model hf needs transformers (gpipe[hf])")]


CASES = [pytest.param(name, marks=_needs(name), id=name) for name in NAMES]


def test_the_folder_ships_in_the_package_and_is_configs_at_the_top() -> None:
    assert paper.FOLDER.is_dir() and paper.FOLDER.parent.name == "gpipe"
    assert (ROOT / "configs").resolve() == paper.FOLDER.resolve()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gpipe"]
    assert {"configs/*.toml", "configs/hf/*.json"} <= set(data)
    assert {"t6-8192-16", "t64-16384-32", "amoebanet-d-18-256", "transformer-l-1663", *SMALL} <= set(NAMES)


@pytest.mark.parametrize("name", CASES)
def test_the_model_has_the_stated_count_near_the_papers(name: str) -> None:
    """Built on the meta device (the 83.9B one costs nothing). Within 1% of the paper's figure, or the
    ``[paper]`` table's ``gap`` says why not (and the gap is real: a fixed model drops its note)."""
    config = paper.read(name)
    model = paper.meta_model(config.train_config())
    assert all(p.is_meta for p in model.parameters())
    count = paper.parameter_count(model)
    assert count == config.counted, f"{name}: gpipe counts {count}, the file says {config.counted}"
    active = active_parameters(model)
    assert active == (config.active or count), f"{name}: {active} parameters per token, the file says {config.active}"
    figure = config.paper_count
    if figure is None:
        assert not config.gap
        return
    off = abs(count / figure - 1)
    if config.gap:
        assert off > 0.01, f"{name}: within 1% of the paper's {config.parameters} ({off:.2%}); drop its gap note"
    else:
        assert off <= 0.01, f"{name}: {off:.2%} from the paper's {config.parameters}; say why in a gap note"


@pytest.mark.parametrize("name", CASES)
def test_every_file_is_a_train_config_by_path_and_by_name(name: str) -> None:
    by_path = parse(["--config", str(paper.FOLDER / f"{name}.toml"), "--no-progress"])
    by_name = parse(["--config", name, "--no-progress"])
    assert by_path == by_name
    text = (paper.FOLDER / f"{name}.toml").read_text()
    assert text.startswith("# ") and "# Parameters:" in text and "# Result:" in text and "# Pipeline:" in text


@pytest.mark.parametrize("name", SMALL)
def test_the_small_configs_train_on_synthetic_data(name: str, tmp_path: Path) -> None:
    argv = ["train", "--config", str(ROOT / "configs" / f"{name}.toml"), "--steps", "2", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2


def test_the_paper_table_is_no_setting_and_hf_config_is_found_beside_the_file(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "lm.json").write_text("{}")
    (tmp_path / "run.toml").write_text('model = "hf"\nhf_config = "hf/lm.json"\n\n[paper]\nmodel = "x"\n')
    assert read_config_file(str(tmp_path / "run.toml")) == {"model": "hf", "hf_config": str(tmp_path / "hf/lm.json")}
    (tmp_path / "bad.toml").write_text('[paper]\nmodel = "x"\nparameters = "many"\n')
    with pytest.raises(ConfigError, match=r"lacks source, result, counted"):
        paper.read(str(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match=r"cannot read the parameter count 'many'"):
        paper.parse_count("many")
    assert paper.parse_count("282.2M") == pytest.approx(282.2e6) and paper.parse_count("1.05B") == 1.05e9


def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"no config file 't7-8192-16'.*one of amoebanet-d-18-208, "):
        paper.find("t7-8192-16")
