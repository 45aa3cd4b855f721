"""`multigpu bench --predict`: its flags are checked before anything runs. The prediction itself, from a real bench
at 1 and 2 CPU ranks, is tested on the bench run tests/cli/test_bench_report_e2e.py shares (one run for both)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_predict_flags_are_checked_before_anything_runs(tmp_path, capsys):
    from multigpu.cli import main

    out = tmp_path / "never"
    for args, words in [
        (["--predict", "1"], "--predict '1' is invalid; valid: world sizes >= 2"),
        (["--predict", "2,4"], "needs a measured world size below 2"),
        (["--nproc", "1,2", "--interconnect", "ib-ndr"], "describe a prediction; valid: add --predict"),
        (["--predict", "8", "--bandwidth-gbs", "-3"], "--bandwidth-gbs -3.0 is invalid"),
        (["--nproc", "1,2", "--ranks-per-node", "4"], "describe a prediction; valid: add --predict"),
        (["--predict", "8", "--ranks-per-node", "0"], "--ranks-per-node 0 is invalid; valid: a positive whole"),
        (["--predict", "8", "--node-interconnect", "nvlink4"], "--node-interconnect nvlink4 needs a network between "
                                                               "the nodes; valid: --interconnect one of nvlink4"),
    ]:
        nproc = [] if "--nproc" in args else ["--nproc", "2"]
        code = main(["bench", *nproc, *args, "-o", str(out), "examples/allreduce_dp.py"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not out.exists()
