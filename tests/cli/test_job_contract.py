"""The job contract: a new workload is only its config, ``check`` and ``main``.

``WORKLOAD`` below is a fifth workload defined here, outside the package. It
goes through the same pipeline as the built-in ones — config file and
overrides, the device plan, ``check`` before anything is written, the run
directory, ``run.json``, the rank entry point, ``mg.init``/``mg.shutdown`` —
with nothing registered anywhere: ``multigpu run tests.cli.test_job_contract:WORKLOAD``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from multigpu.cli import main as cli_main
from multigpu.errors import ConfigError
from multigpu.jobs import JobPlan, RunContext, Workload
from tests.conftest import ROOT, assert_bad_input, run_cli

SPEC = "tests.cli.test_job_contract:WORKLOAD"


@dataclass(frozen=True, kw_only=True)
class CountConfig:
    n: int = 100
    """Sum the squares of 0..n-1, split over the ranks."""
    steps: int = 3

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"count.n={self.n} is invalid; valid: a whole number >= 1")


def check(cfg: CountConfig, plan: JobPlan) -> None:
    if cfg.n < plan.world_size:
        raise ConfigError(f"count.n={cfg.n} leaves a rank empty on {plan.world_size} ranks; valid: n >= {plan.world_size}")


def main(cfg: CountConfig, ctx: RunContext) -> int:
    import torch

    import multigpu as mg
    from multigpu.monitor import StepMeter

    n = cfg.n * ctx.problem_scale(mg.world_size())
    mine = mg.shard_range(n)
    meter = StepMeter.from_context("numbers", ctx, total_steps=cfg.steps, warmup_steps=0, progress=False)
    for _ in range(cfg.steps):
        with meter.step(items=len(mine)):
            total = mg.all_reduce(torch.tensor([sum(i * i for i in mine)], dtype=torch.int64), "sum")
    meter.close({"total": int(total.item())})
    if mg.is_main():
        Path(ctx.run_dir, "count.json").write_text(json.dumps({"total": int(total.item()), "world": mg.world_size(),
                                                               "run_file": os.environ.get("MULTIGPU_RUN_FILE"),
                                                               "preloaded": "wave" in sys.modules,
                                                               "umask": _umask()}))
    return 0


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


WORKLOAD = Workload(name="count", config=CountConfig, check=check, main=main, help="sum of squares", prefix="count",
                    preload=("wave",))  # imported by nothing else here: the fork server's preload, seen by the ranks


def test_a_new_workloads_bad_input_fails_in_its_check_before_anything_is_written(tmp_path, capsys, fake_gpus):
    fake_gpus(0)
    for argv, message in [(["n=1", "--nproc-per-node", "2"], "count.n=1 leaves a rank empty on 2 ranks"),
                          (["n=0"], "count.n=0 is invalid"),
                          (["m=3"], "unknown config key 'count.m'"),
                          (["-f", str(tmp_path / "none.yaml")], "does not exist")]:
        assert_bad_input(["run", SPEC, "--run-dir", str(tmp_path / "run"), *argv], message, capsys, tmp_path / "run")
    assert cli_main(["run", "tests.cli.test_job_contract:main"]) == 2
    assert "is a function, not a multigpu.jobs.Workload" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_workload_defined_in_a_test_file_runs_and_benches_on_two_ranks(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    (tmp_path / "count.yaml").write_text("n: 1000\nsteps: 4\n")
    proc = run_cli("run", SPEC, "-f", str(tmp_path / "count.yaml"), "steps=5", "--nproc-per-node", "2",
                   "--run-dir", str(tmp_path / "run"), env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "run" / "count.json").read_text())
    assert out["total"] == sum(i * i for i in range(1000)) and out["world"] == 2
    assert out["preloaded"]  # the command line's fork server imported it once, before forking the ranks
    # a workload's ranks run under the command's private umask, forked or not (the fork server was made before the
    # command set it): what they write in the run folder is the user's only
    assert out["umask"] == 0o077 and (tmp_path / "run" / "count.json").stat().st_mode & 0o777 == 0o600
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["workload"] == SPEC and run["config"] == {"n": 1000, "steps": 5}
    assert run["run"]["run_dir"] == str((tmp_path / "run").resolve()) and out["run_file"].endswith("run.json")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unit"] == "numbers" and summary["items"] == 5 * 1000 and summary["world_size"] == 2

    bench = run_cli("bench", "--nproc", "1,2", "--weak", "-o", str(tmp_path / "bench"), SPEC, "n=500", env=env,
                    timeout=240)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [r["summary"]["total"] for r in result["runs"]] == [sum(i * i for i in range(500 * w)) for w in (1, 2)]
    assert result["unit"] == "numbers" and [r["world_size"] for r in result["rows"]] == [1, 2]


def test_a_built_in_workload_is_one_entry_that_the_commands_and_the_help_derive_from(tmp_path, capsys, monkeypatch,
                                                                                      fake_gpus):
    """One line in the registry makes a workload built in: ``multigpu <name>``, ``--help``'s command list and
    the ``bench``/``verify``/``run`` help follow from it; a ``Workload(command=False)`` stays out of the commands."""
    import dataclasses

    from multigpu.cli import commands
    from multigpu.jobs import registry

    fake_gpus(0)
    hidden = dataclasses.replace(WORKLOAD, name="hidden", command=False)
    monkeypatch.setitem(registry.BUILTIN, "count", SPEC)
    monkeypatch.setitem(registry.BUILTIN, "hidden", "tests.cli.test_job_contract:HIDDEN")
    monkeypatch.setitem(globals(), "HIDDEN", hidden)
    assert commands()[-7:] == ["count", "run", "bench", "verify", "plan", "doctor", "report"]
    assert "hidden" not in commands()
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "sum of squares" in capsys.readouterr().out  # the entry's help, in the command list
    assert_bad_input(["count", "n=1", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")],
                     "count.n=1 leaves a rank empty on 2 ranks", capsys, tmp_path / "run")
    for command in ("bench", "verify", "run"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        assert "envs, count, hidden)" in " ".join(capsys.readouterr().out.split()), command
    assert cli_main(["hidden", "n=5"]) == 2
    assert "invalid choice: 'hidden'" in capsys.readouterr().err
