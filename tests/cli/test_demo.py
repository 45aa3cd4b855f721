"""`make demo` (``examples/demo.py``): its driver runs a part through the real command line and sums up, and every
part's command is one the command line accepts (checked in-process, nothing spawned: the workloads' dry runs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("examples_demo", ROOT / "examples" / "demo.py")  # not a package
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

WORKLOADS = ("sim", "train", "infer", "rl")


@pytest.mark.e2e
def test_the_demo_runs_a_part_through_the_command_line_and_sums_up(tmp_path):
    """The hello part (two CPU ranks: no GPU is visible to it), as `python examples/demo.py hello` runs it."""
    proc = subprocess.run([sys.executable, "examples/demo.py", "--run-dir", str(tmp_path), "hello"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "=== hello: shard a list, compute on each rank, gather in order on rank 0" in out
    assert "$ multigpu launch --nproc-per-node 2 examples/hello.py" in out
    assert "rank 0/2 on cpu: items [1, 2, 3, 4, 5]" in out
    assert "rank 1/2 on cpu: items [6, 7, 8, 9, 10]" in out
    assert "gathered on rank 0: [1, 4, 9, 16, 25, 36, 49, 64, 81, 100] (sum 385)" in out
    summary = out.split("=== demo summary")[1].strip().splitlines()
    assert len(summary) == 1 and summary[0].split()[:2] == ["hello", "ok"], out


def test_every_demo_part_is_a_command_the_command_line_accepts(tmp_path, capsys):
    """A renamed flag or config key would break `make demo` and nothing else: each workload part's command passes
    its dry run (its whole config checked and planned at 2 ranks, nothing spawned, nothing written); the other
    tools' commands parse, and the scripts they name exist."""
    from multigpu.cli import build_parser, main

    every = demo.parts(tmp_path / "demo")
    assert [name for name, _, _ in every] == ["hello", "sim", "train", "infer", "envs", "bench", "report"]
    for name, _, argv in every:
        command = argv[0]
        if command in WORKLOADS:
            assert main([*argv, "--dry-run", "--world-size", "2"]) == 0, (name, capsys.readouterr().err)
        else:
            args = build_parser(command).parse_args(argv)
            assert command == "report" or (ROOT / args.target).is_file(), (name, args.target)
    assert not (tmp_path / "demo").exists()  # the dry runs wrote nothing
    bench, report = every[-2][2], every[-1][2]
    assert report[1] == bench[bench.index("-o") + 1]  # the report is of the bench's folder
    assert demo.main(["nope"]) == 2 and "unknown demo part(s) ['nope']" in capsys.readouterr().err
