"""torchrun's output controls (--tee, --redirects, --local-ranks-filter) and accelerate's --multi-gpu are accepted
with their meaning (before: "unrecognized arguments"), and --rank-prefix prefixes each worker line with its rank."""

from __future__ import annotations

from unittest import mock

import pytest
from torch.distributed.elastic.multiprocessing.api import Std

from multigpu.cli import main
from tests.conftest import SCRIPTS, run_cli

HELLO = str(SCRIPTS / "no_group.py")


def _specs(argv, capsys):
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=lambda c, e, a: seen.append(c)):
        assert main(["launch", "--nproc-per-node", "2", *argv, HELLO]) == 0
    config = seen[0]
    return config.logs_specs, config.log_line_prefix_template, capsys.readouterr().err


def test_torchruns_output_flags_reach_torchs_logs_specs(capsys):
    specs, prefix, _ = _specs([], capsys)
    assert (specs._tee, specs._redirects, specs._local_ranks_filter, prefix) == (Std.NONE, Std.NONE, None, None)
    specs, prefix, _ = _specs(["--tee", "3", "--local_ranks_filter", "0"], capsys)
    assert (specs._tee, specs._local_ranks_filter, prefix) == (Std.ALL, {0}, None)
    specs, _, _ = _specs(["--redirects", "0:3,1:1", "--tee", "2"], capsys)
    assert specs._redirects == {0: Std.ALL, 1: Std.OUT} and specs._tee == Std.ERR
    specs, prefix, _ = _specs(["--rank-prefix"], capsys)
    assert specs._tee == Std.ALL and prefix == "[rank${rank}]: "
    _, _, err = _specs(["--multi_gpu"], capsys)
    assert err.count("--multi-gpu is what multigpu does anyway") == 1


@pytest.mark.parametrize("argv,valid", [(["--tee", "4"], "valid: 0 (none), 1 (stdout)"),
                                        (["--redirects", "0:3,x"], "valid: 0 (none)"),
                                        (["--local-ranks-filter", "a"], "valid: local ranks")])
def test_bad_output_flags_are_one_line_and_exit_2(argv, valid, capsys):
    with mock.patch("multigpu.launch.agent._elastic_launch") as launched:
        assert main(["launch", *argv, HELLO]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and valid in err[0] and not launched.called


@pytest.mark.e2e
def test_rank_prefix_and_a_filter_show_one_ranks_lines_prefixed():
    proc = run_cli("launch", "--nproc-per-node", "2", "--rank-prefix", "--local-ranks-filter", "1", HELLO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "did its work alone" in line]
    assert lines == ["[rank1]: copy 1 of 2 did its work alone"], proc.stdout


@pytest.mark.e2e
def test_lines_printed_by_two_ranks_at_once_reach_the_console_whole():
    """Under ``python -u`` a print() wrote its text and its newline apart, and the two ranks broke each other's
    lines (1,100-9,000 of 40,000 printed at once, in three runs of this script before the wrapper's fix)."""
    import re

    proc = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "print_lines.py"), "20000",
                   env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    broken = [line for line in lines if not re.fullmatch(r"rank[01]-x{80}-\d+", line)]
    assert not broken, f"{len(broken)} broken lines, e.g. {broken[:2]}"
    assert sorted(lines) == sorted(f"rank{r}-" + "x" * 80 + f"-{i}" for r in (0, 1) for i in range(20000))
