"""One loader for every feature's config dataclass (used on both sides of the launch).

A config is a frozen ``@dataclass`` whose fields carry type hints and defaults,
validated in ``__post_init__`` (raise :class:`~multigpu.errors.ConfigError`).
This module turns YAML files, dictionaries and ``key=value`` overrides into
such dataclasses, rejecting unknown keys by name with a suggestion::

    cfg = load_config(TrainConfig, "my_run.yaml", overrides=["lr=3e-4"])
    # ConfigError: unknown config key 'train.lerning_rate'. Did you mean 'train.learning_rate'?
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from multigpu.errors import ConfigError
from multigpu.presets import find_config

__all__ = ["apply_overrides", "from_dict", "load_config", "load_yaml", "to_dict"]

C = TypeVar("C")

_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


_LAUNCHER_FLAGS = {
    "nproc_per_node": "--nproc-per-node N",
    "nnodes": "--nnodes N",
    "node_rank": "--node-rank I",
    "rdzv_endpoint": "--rdzv-endpoint HOST:PORT",
    "gpus": "--gpus all|N|I,J",
    "max_restarts": "--max-restarts K",
    "standalone": "--standalone",
}
"""Launcher settings, by the field name they have in ``LaunchConfig``: flags of the command, not keys of a workload."""

_KNOWN_NAMES: dict[str, tuple[str, ...]] = {
    # training: HF Trainer, accelerate, nanoGPT, Lightning
    "gradient_accumulation_steps": ("grad_accum",),
    "accumulate_grad_batches": ("grad_accum",),
    "mixed_precision": ("precision",),
    "bf16": ("precision=bf16",),
    "fp16": ("precision=fp16",),
    "learning_rate": ("lr",),
    "max_steps": ("steps",),
    "max_iters": ("steps",),
    "num_steps": ("steps",),
    "per_device_train_batch_size": ("batch_size",),
    "train_batch_size": ("batch_size",),
    "train_micro_batch_size_per_gpu": ("batch_size",),
    "max_grad_norm": ("grad_clip",),
    "gradient_clip_val": ("grad_clip",),
    "warmup_iters": ("warmup_steps",),
    "lr_decay_iters": ("lr_decay_steps",),
    "eval_interval": ("eval_every",),
    "eval_steps": ("eval_every",),
    "eval_iters": ("eval_batches",),
    "log_interval": ("log_every",),
    "logging_steps": ("log_every",),
    "log_every_n_steps": ("log_every",),
    "save_steps": ("checkpoint_every",),
    "save_total_limit": ("keep_last",),
    "dataloader_num_workers": ("num_workers",),
    "resume_from_checkpoint": ("resume",),
    "ckpt_path": ("resume",),
    # reinforcement learning (CleanRL and Stable-Baselines3 names; our rl config keeps CleanRL's)
    "lr": ("learning_rate",),
    "grad_clip": ("max_grad_norm",),
    "n_envs": ("num_envs",),
    "n_steps": ("num_steps",),
    "n_epochs": ("update_epochs",),
    "clip_range": ("clip_coef",),
    "total_timesteps": ("total_env_steps",),
    "env": ("env_id",),
    "env_name": ("env_id",),
    # simulation: the strategies are values of one key
    "adaptive_parallel": ("strategy=adaptive",),
    "data_parallel": ("strategy=data",),
    "spatial_parallel": ("strategy=spatial",),
    "num_agents": ("agents",),
    "n_agents": ("agents",),
    # the launcher (torchrun, accelerate, Lightning): a LaunchConfig field where there is one, else its flag
    **{name: (name,) for name in _LAUNCHER_FLAGS},
    "num_processes": ("nproc_per_node",),
    "num_machines": ("nnodes",),
    "num_nodes": ("nnodes",),
    "machine_rank": ("node_rank",),
    "master_addr": ("rdzv_endpoint",),
    "master_port": ("rdzv_endpoint",),
    "main_process_ip": ("rdzv_endpoint",),
    "main_process_port": ("rdzv_endpoint",),
    "gpu_ids": ("gpus",),
    "devices": ("gpus",),
}
"""Other tools' names for our keys, each with our candidates in order (a key, or ``key=value``).

Consulted before difflib, which matches spelling, not meaning
(``gradient_accumulation_steps`` is closer to ``grad_accum_scope`` than to ``grad_accum``).
A candidate counts only where it is a key of the section at hand; a launcher setting that
is not one is named as its flag."""


def _known_name(prefix: str, key: str, valid: list[str]) -> str | None:
    """The hint for another tool's name ``key`` in this section, if it has one."""
    for target in _KNOWN_NAMES.get(key, ()):
        if target.split("=", 1)[0] in valid:
            return f". Did you mean '{_dotted(prefix, target)}'?"
        if target in _LAUNCHER_FLAGS:
            return f"; that is a launcher flag: {_LAUNCHER_FLAGS[target]}."
    return None


def _hint(prefix: str, key: str, valid: list[str]) -> str:
    """What follows "unknown config key 'X'": a sentence ending in '.' or '?'."""
    known = _known_name(prefix, key, valid)
    if known:
        return known
    # a misspelt key may be closest to another tool's name for one of ours ('lerning_rate' -> 'lr')
    names = valid + [name for name in _KNOWN_NAMES if _known_name(prefix, name, valid)]
    close = difflib.get_close_matches(key, names, n=1)
    if not close:
        return "."
    return _known_name(prefix, close[0], valid) or f". Did you mean '{_dotted(prefix, close[0])}'?"


def _unknown_key(prefix: str, key: str, valid: Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    return ConfigError(
        f"unknown config key '{_dotted(prefix, key)}'{_hint(prefix, key, valid)} Valid keys here: {', '.join(valid)}"
    )


_NOUNS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", type(None): "null"}


def _is_scalar(tp: Any) -> bool:
    return tp in _NOUNS or typing.get_origin(tp) is Literal


def _noun(tp: Any) -> str:
    """What a value of type ``tp`` looks like, for messages: "an integer", "'auto'"."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return "a mapping"
    return _NOUNS.get(tp, getattr(tp, "__name__", str(tp).replace("typing.", "")))


def _finite_float(value: Any, key: str) -> float:
    """A number from YAML or a string; ``.inf``, ``nan``, ``-inf`` and ``1e999`` are refused."""
    number: Any = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"config key '{key}' got {value!r}; expected a number")
    try:
        number = float(number)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        # no knob means anything by inf or nan; they only turn a run's numbers into nan later
        raise ConfigError(f"config key '{key}' got {value!r}; valid: a finite number")
    return number


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
        arms = [a for a in args if a is not type(None)]
        errors = []
        for arm in arms:
            try:
                return _coerce(value, arm, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(arms) == 1 and not _is_scalar(arms[0]):  # a list or a section: its own message names the item
            raise errors[0]
        raise ConfigError(f"config key '{key}' got {value!r}; valid: {' or '.join(_noun(a) for a in args)}")
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
        return _finite_float(value, key)
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
        kwargs[key] = _coerce(_with_required_defaults(fields[key], hints[key], value), hints[key],
                              _dotted(prefix, key))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"config '{prefix or cls.__name__}': {exc}") from None


def _with_required_defaults(field: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` with the required keys it lacks taken from ``field``'s default, when the field is a dataclass
    with a default instance: ``model.kwargs.channels=1`` alone keeps the default ``model.factory`` (a Factory
    needs one) instead of failing. Keys with defaults of their own stay as given (a new factory does not inherit
    the default's kwargs)."""
    if not (isinstance(value, Mapping) and isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        return value
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    elif field.default is not dataclasses.MISSING:
        default = field.default
    else:
        return value
    if not dataclasses.is_dataclass(default):
        return value
    required = [f.name for f in dataclasses.fields(hint) if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    given = {str(k).replace("-", "_") for k in value}
    missing = {name: to_dict(getattr(default, name)) for name in required if name not in given}
    return {**missing, **value} if missing else value


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


MAX_ALIAS_VALUES = 100_000
"""Values YAML aliases (``*name``) may add to a config once expanded: a 1 KB file of nested aliases (a "billion
laughs") otherwise expands to billions of values when the config is copied and checked."""


def _alias_problem(data: Any) -> str | None:
    """Why ``data`` (as ``yaml.safe_load`` built it: aliases are shared objects) cannot be expanded: a list or
    mapping that contains itself, or more than :data:`MAX_ALIAS_VALUES` values added by aliases. Counted with
    each shared object's size computed once, so the count itself costs only the file's own size."""
    sizes: dict[int, int] = {}
    open_now: set[int] = set()
    unique = 0

    def size(value: Any) -> int:
        nonlocal unique
        if not isinstance(value, (dict, list)):
            unique += 1
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in open_now:
            raise ValueError("cycle")
        open_now.add(key)
        items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
        unique += 1
        sizes[key] = 1 + sum(size(x) for x in items)
        open_now.discard(key)
        return sizes[key]

    try:
        total = size(data)
    except ValueError:
        return "an alias (*name) refers to a list or mapping that contains it, which would never end"
    except RecursionError:
        return "it is nested too deeply"
    if total - unique > MAX_ALIAS_VALUES:
        return f"its aliases (*name) expand it to {total:,} values (aliases may add at most {MAX_ALIAS_VALUES:,})"
    return None


class _DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping gives a key twice (YAML says keys are unique; PyYAML keeps the last one, silently)."""

    def __init__(self, key: Any, first: int, second: int):
        super().__init__(f"the key {key!r} twice (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding a key twice (:class:`_DuplicateKeyError`)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys merged in may be given again
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: the base class says so
                    break
        return super().construct_mapping(node, deep=deep)


def _safe_load(text: str) -> Any:
    """``yaml.safe_load``, refusing a mapping that gives a key twice (:class:`_DuplicateKeyError`), and with a nesting
    too deep for the parser reported as bad YAML, not an internal error."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from a file or a packaged preset's name (``nano``, ``sir``: :mod:`multigpu.presets`),
    with one-line errors for a missing, unreadable or malformed file, and for aliases that would expand it
    beyond :data:`MAX_ALIAS_VALUES` values."""
    path = find_config(str(path))
    try:
        data = _safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror}") from None
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file '{path}' has the key {exc.key!r} twice (lines {exc.first} and {exc.second}); "
                          "valid: each key once") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{at}") from None
    problem = _alias_problem(data)
    if problem is not None:
        raise ConfigError(f"config file '{path}' is refused: {problem}; valid: a config with each value written "
                          "out, or aliases that repeat a few values")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def _copy_tree(value: Any) -> Any:
    """Mappings (as dicts) and lists copied at every depth; other values, immutable from YAML, shared."""
    if isinstance(value, Mapping):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    return value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides to a copy of a nested dict (values parsed as YAML scalars).

    ``data`` is left as it was, at every depth.
    """
    out: dict[str, Any] = _copy_tree(data)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value (e.g. steps=100)")
        key, raw = item.split("=", 1)
        try:
            value = _safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        problem = _alias_problem(value)
        if problem is not None:
            raise ConfigError(f"override '{key}=...' is refused: {problem}; valid: the value written out")
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
