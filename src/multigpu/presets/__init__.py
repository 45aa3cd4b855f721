"""Configs that ship inside the package, beside this file: ``-f nano`` finds ``multigpu/presets/nano.yaml``
(runs in the launcher; below everything but :mod:`multigpu.errors`, so the config loader can use it).

``-f`` takes a path first (``-f configs/mine.yaml``); a name that is no file is
looked up among the presets, with or without ``.yaml``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from multigpu.errors import ConfigError

__all__ = ["find_config", "preset_names"]


def _folder():
    return resources.files("multigpu.presets")


def preset_names() -> list[str]:
    """The packaged presets, by name."""
    return sorted(p.name.removesuffix(".yaml") for p in _folder().iterdir() if p.name.endswith(".yaml"))


def find_config(spec: str) -> Path:
    """A config file path, or a packaged preset's name -> the file to read."""
    path = Path(spec)
    if path.is_file():
        return path
    name = spec.removesuffix(".yaml").removesuffix(".yml")
    if "/" not in spec and name in preset_names():
        return Path(str(_folder() / f"{name}.yaml"))
    raise ConfigError(f"config file '{spec}' does not exist; valid: a YAML path, or a packaged preset: "
                      f"{', '.join(preset_names())}")
