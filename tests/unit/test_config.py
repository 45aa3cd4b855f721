"""The shared config loader: types, unknown keys with suggestions, overrides, YAML errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from multigpu.config import apply_overrides, from_dict, load_config, to_dict
from multigpu.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class _Inner:
    size: tuple[int, ...] = (1, 2)


@dataclass(frozen=True, kw_only=True)
class _Cfg:
    learning_rate: float = 1e-3
    steps: int = 10
    dtype: Literal["fp32", "bf16"] = "fp32"
    name: str | None = None
    compile: bool = False
    inner: _Inner = field(default_factory=_Inner)

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} must be >= 1")


def test_types_are_converted_from_yaml_and_strings():
    cfg = from_dict(_Cfg, {"learning_rate": "3e-4", "steps": "1_000", "compile": "yes", "inner": {"size": "4,5"}})
    assert cfg.learning_rate == 3e-4 and cfg.steps == 1000 and cfg.compile is True
    assert cfg.inner.size == (4, 5)
    assert to_dict(cfg)["inner"] == {"size": [4, 5]}


def test_unknown_key_names_the_dotted_key_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'lerning_rate'. Did you mean 'learning_rate'\?"):
        from_dict(_Cfg, {"lerning_rate": 1})
    with pytest.raises(ConfigError, match=r"'inner.sise'. Did you mean 'inner.size'"):
        from_dict(_Cfg, {"inner": {"sise": [1]}})


@pytest.mark.parametrize(
    "data,match",
    [
        ({"dtype": "fp8"}, "valid choices: 'fp32', 'bf16'"),
        ({"steps": "many"}, "expected an integer"),
        ({"steps": 0}, "steps=0 must be >= 1"),
        ({"compile": "maybe"}, "expected true or false"),
        ({"inner": 3}, "must be a mapping"),
    ],
)
def test_bad_values_are_one_line_config_errors(data, match):
    with pytest.raises(ConfigError, match=match) as info:
        from_dict(_Cfg, data)
    assert "\n" not in str(info.value)


def test_overrides_apply_dotted_keys_and_parse_scalars():
    out = apply_overrides({"a": 1, "inner": {"size": [1]}}, ["a=2", "inner.size=[3, 4]", "new.deep=x"])
    assert out == {"a": 2, "inner": {"size": [3, 4]}, "new": {"deep": "x"}}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["novalue"])


def test_load_config_reads_yaml_and_reports_bad_files(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("steps: 5\ninner:\n  size: [7]\n")
    assert load_config(_Cfg, good, ["steps=6"]) == _Cfg(steps=6, inner=_Inner(size=(7,)))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(_Cfg, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_Cfg, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_Cfg, listy)
