"""Every workload's ``--help``: its examples are ones the workload accepts, and no internal name shows."""

from __future__ import annotations

import re

import pytest

from multigpu.cli import build_parser
from multigpu.jobs.command import load_workload_config
from multigpu.jobs.registry import builtin, commands

EXAMPLE = re.compile(r"(?<![\w.-])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)=([^\s,;)]+)")


def _help(name: str) -> str:
    parser = build_parser(name)
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    return sub.format_help()


@pytest.mark.parametrize("name", commands())
def test_every_key_value_example_in_a_workloads_help_parses(name):
    workload = builtin(name)
    text = _help(name)
    fields = {f for f in workload.config.__dataclass_fields__}
    examples = [f"{k}={v}" for k, v in EXAMPLE.findall(" ".join(text.split()))
                if k.split(".")[0] in fields and v != "..." and "NAME" not in k and not v.isupper()]
    line = re.search(r"config overrides, e\.g\. (.+)", " ".join(text.split())).group(1).split("  ")[0]
    assert examples and all(e in examples for e in line.split()[:2])  # the overrides line's own examples
    for example in examples:
        load_workload_config(workload, None, [example])  # raises ConfigError if the example were rejected


@pytest.mark.parametrize("name", commands())
def test_no_internal_placeholder_shows_in_a_workloads_help(name):
    text = _help(name)
    assert "FLAG__" not in text and "flag__" not in text
