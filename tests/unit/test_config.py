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


# other tools' names for our keys: meaning first, then spelling


def _unknown_key_message(cls, key, prefix=""):
    with pytest.raises(ConfigError, match="unknown config key") as info:
        from_dict(cls, {key: 1}, prefix=prefix)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "workload,key,suggested",
    [
        ("train", "gradient_accumulation_steps", "grad_accum"),  # difflib alone says grad_accum_scope
        ("train", "accumulate_grad_batches", "grad_accum"),
        ("train", "mixed_precision", "precision"),
        ("train", "learning_rate", "lr"),
        ("train", "max_steps", "steps"),
        ("train", "max_iters", "steps"),
        ("train", "per_device_train_batch_size", "batch_size"),
        ("train", "train_batch_size", "batch_size"),
        ("train", "max_grad_norm", "grad_clip"),
        ("train", "warmup_iters", "warmup_steps"),
        ("train", "lr_decay_iters", "lr_decay_steps"),
        ("train", "eval_interval", "eval_every"),
        ("train", "log_interval", "log_every"),
        ("train", "bf16", "precision=bf16"),
        ("train", "lerning_rate", "lr"),  # a misspelt other name
        ("rl", "n_envs", "rl.num_envs"),
        ("rl", "lr", "rl.learning_rate"),  # the rl config keeps CleanRL's names
        ("rl", "grad_clip", "rl.max_grad_norm"),
        ("rl", "total_timesteps", "rl.total_env_steps"),
        ("sim", "adaptive_parallel", "sim.strategy=adaptive"),
        ("sim", "num_agents", "sim.agents"),
        ("launch", "num_processes", "nproc_per_node"),  # a field where the section has one
        ("launch", "num_machines", "nnodes"),
    ],
)
def test_other_tools_names_suggest_ours(workload, key, suggested):
    from multigpu.launch.config import LaunchConfig
    from multigpu.rl import RLConfig
    from multigpu.sim import SimConfig
    from multigpu.train import TrainConfig

    cls = {"train": TrainConfig, "rl": RLConfig, "sim": SimConfig, "launch": LaunchConfig}[workload]
    prefix = "" if workload in ("train", "launch") else workload
    message = _unknown_key_message(cls, key, prefix)
    assert message.startswith(f"unknown config key '{_dotted(prefix, key)}'. Did you mean '{suggested}'? Valid keys here: ")


@pytest.mark.parametrize(
    "key,flag",
    [
        ("num_processes", "--nproc-per-node N"),
        ("nproc_per_node", "--nproc-per-node N"),
        ("num_machines", "--nnodes N"),
        ("nnodes", "--nnodes N"),
        ("machine_rank", "--node-rank I"),
        ("master_port", "--rdzv-endpoint HOST:PORT"),
        ("devices", "--gpus all|N|I,J"),
    ],
)
def test_launcher_settings_in_a_workload_config_are_named_as_flags(key, flag):
    from multigpu.sim import SimConfig
    from multigpu.train import TrainConfig

    assert _unknown_key_message(TrainConfig, key).startswith(
        f"unknown config key '{key}'; that is a launcher flag: {flag}. Valid keys here: activation_checkpointing, ")
    assert f"'sim.{key}'; that is a launcher flag: {flag}. Valid keys here: agents, " in _unknown_key_message(
        SimConfig, key, "sim")


def test_a_known_name_whose_key_is_missing_falls_back_to_spelling():
    # infer has no 'steps': max_steps is left to difflib, and nothing close is no hint at all
    from multigpu.infer.config import InferConfig

    assert "Did you mean" not in _unknown_key_message(InferConfig, "max_steps", "infer")
    assert "'infer.batch_sise'. Did you mean 'infer.batch_size'?" in _unknown_key_message(
        InferConfig, "batch_sise", "infer")


def _dotted(prefix, key):
    return f"{prefix}.{key}" if prefix else key


@dataclass(frozen=True, kw_only=True)
class _Unions:
    workers: int | Literal["auto"] = "auto"
    limit: int | None = None
    sizes: list[int] | None = None


@pytest.mark.parametrize(
    "data,message",
    [
        ({"workers": "four"}, "config key 'workers' got 'four'; valid: an integer or 'auto'"),
        ({"limit": "many"}, "config key 'limit' got 'many'; valid: an integer or null"),
        ({"sizes": [1, "x"]}, "config key 'sizes[1]' got 'x'; expected an integer"),  # the item's own message
    ],
)
def test_a_union_names_what_it_accepts_or_passes_on_an_items_error(data, message):
    with pytest.raises(ConfigError) as info:
        from_dict(_Unions, data)
    assert str(info.value) == message


def test_a_union_accepts_each_arm_and_null():
    assert from_dict(_Unions, {"workers": "3", "limit": "null", "sizes": "1,2"}) == _Unions(
        workers=3, limit=None, sizes=[1, 2])
    assert from_dict(_Unions, {"workers": "auto", "limit": 5}).workers == "auto"


def test_overrides_leave_the_input_untouched_at_every_depth():
    from types import MappingProxyType

    data = {"a": {"b": {"c": 0, "keep": [1, [2]]}}, "top": 1}
    out = apply_overrides(data, ["a.b.c=1", "a.b.new=2", "top=3"])
    assert data == {"a": {"b": {"c": 0, "keep": [1, [2]]}}, "top": 1}
    assert out == {"a": {"b": {"c": 1, "keep": [1, [2]], "new": 2}}, "top": 3}
    out["a"]["b"]["keep"][1].append(9)  # the copy shares no mapping or list with the input
    assert data["a"]["b"]["keep"] == [1, [2]]
    frozen = MappingProxyType({"a": MappingProxyType({"b": 0})})  # any Mapping, at any depth, is a section
    assert apply_overrides(frozen, ["a.b=1"]) == {"a": {"b": 1}} and frozen["a"]["b"] == 0


# non-finite numbers: no knob means anything by them


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "-inf", "nan", "1e999", 10**400])
def test_non_finite_numbers_are_refused_naming_the_key(value):
    from multigpu.train import TrainConfig

    with pytest.raises(ConfigError, match=r"^config key 'lr' got .*; valid: a finite number$"):
        from_dict(TrainConfig, {"lr": value})


def test_non_finite_numbers_are_refused_in_yaml_files_and_overrides(tmp_path):
    from multigpu.infer.config import InferConfig
    from multigpu.rl import RLConfig
    from multigpu.train import TrainConfig

    path = tmp_path / "run.yaml"
    path.write_text("lr: .inf\n")
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path)
    assert str(info.value) == "config key 'lr' got inf; valid: a finite number"
    path.write_text("lr: 3.0e-4\n")
    for override, shown in (("lr=nan", "'nan'"), ("lr=-inf", "'-inf'"), ("lr=-.inf", "-inf"), ("lr=.NaN", "nan")):
        with pytest.raises(ConfigError) as info:
            load_config(TrainConfig, path, [override])
        assert str(info.value) == f"config key 'lr' got {shown}; valid: a finite number"
    assert load_config(TrainConfig, path, ["lr=1e-3"]).lr == 1e-3
    path.write_text("target_return: .inf\n")  # float | None: null switches it off, inf is still refused
    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, path, prefix="rl")
    assert str(info.value) == "config key 'rl.target_return' got inf; valid: a finite number or null"
    with pytest.raises(ConfigError, match=r"^config key 'infer.overlap\[1\]' got 'nan'; valid: a finite number$"):
        from_dict(InferConfig, apply_overrides({}, ["overlap=0.25,nan"]), prefix="infer")


def test_an_argument_of_the_default_model_keeps_the_default_factory():
    """``multigpu infer --model-arg channels=1`` (``model.kwargs.channels=1``) without ``--model`` failed with
    "Factory.__init__() missing 1 required keyword-only argument: 'factory'"; a new factory takes none of the
    default's arguments."""
    from multigpu.infer.config import InferConfig

    cfg = load_config(InferConfig, None, ["model.kwargs.channels=1"])
    assert (cfg.model.factory, dict(cfg.model.kwargs)) == ("multigpu.infer.models:denoiser", {"channels": 1})
    cfg = load_config(InferConfig, None, ["model.factory=multigpu.infer.models:edges"])
    assert (cfg.model.factory, dict(cfg.model.kwargs)) == ("multigpu.infer.models:edges", {})
