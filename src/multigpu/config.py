"""One loader for every feature's config dataclass (used on both sides of the launch).

A config is a frozen ``@dataclass`` whose fields carry type hints and defaults,
validated in ``__post_init__`` (raise :class:`~multigpu.errors.ConfigError`).
This module turns YAML files, dictionaries and ``key=value`` overrides into
such dataclasses, rejecting unknown keys by name with a suggestion::

    cfg = load_config(TrainConfig, "configs/nano.yaml", overrides=["lr=3e-4"])
    # ConfigError: unknown config key 'train.lerning_rate'. Did you mean 'train.learning_rate'?
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from multigpu.errors import ConfigError

__all__ = ["apply_overrides", "from_dict", "load_config", "load_yaml", "to_dict"]

C = TypeVar("C")

_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(prefix: str, key: str, valid: Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{_dotted(prefix, close[0])}'?" if close else ""
    return ConfigError(
        f"unknown config key '{_dotted(prefix, key)}'.{hint} Valid keys here: {', '.join(valid)}"
    )


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or a ``key=value`` string) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"config key '{key}' got {value!r}; expected {' or '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ConfigError(f"config key '{key}' got {value!r}; valid choices: {', '.join(repr(a) for a in args)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise ConfigError(f"config key '{key}' got {value!r}; expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' got {value!r}; expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ConfigError(f"config key '{key}' got {value!r}; expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' got {value!r}; expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' got {value!r}; expected a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' got {value!r}; expected a string")
    return value


def from_dict(cls: type[C], data: Mapping[str, Any], *, prefix: str = "") -> C:
    """Build the dataclass ``cls`` from ``data``, converting types and rejecting unknown keys.

    Raises:
        ConfigError: an unknown key (with a "did you mean"), a value of the wrong type,
            or whatever ``cls.__post_init__`` rejects.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config section '{prefix or '<top>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key not in fields:
            raise _unknown_key(prefix, key, fields)
        kwargs[key] = _coerce(value, hints[key], _dotted(prefix, key))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"config '{prefix or cls.__name__}': {exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (tuples become lists), ready for JSON or YAML."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with one-line errors for a missing, unreadable or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides to a nested dict (values parsed as YAML scalars)."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value (e.g. steps=100)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {} if child is None else child
                if not isinstance(child, dict):
                    raise ConfigError(f"override '{item}': '{part}' is not a section")
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    prefix: str = "",
) -> C:
    """Build ``cls`` from an optional YAML file plus ``key=value`` overrides (later wins)."""
    data = load_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides), prefix=prefix)
