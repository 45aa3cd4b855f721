"""`multigpu bench --strong/--weak` on every built-in workload at 1 and 2 CPU ranks: the global work per step
is what the label says (strong: the same at both; weak: twice at 2 ranks), read from each run's summary.json."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = {
    "train": ["steps=6", "batch_size=4", "block_size=32", "model.kwargs.n_layer=1", "model.kwargs.n_embd=32",
              "model.kwargs.n_head=2"],
    "sim": ["agents=2000", "steps=6"],
    "infer": ["roi=[64]"],
    "rl": ["num_envs=16", "num_steps=8", "total_env_steps=1024"],
    "envs": ["num_envs=256", "steps=8"],
}


def _work_per_step(folder) -> float:
    summary = json.loads((folder / "summary.json").read_text())
    if "num_windows" in summary:  # infer: a step is one batch on each rank; its global work is every window
        return summary["num_windows"]
    return summary["items"] / summary["steps"]


# Four of the ten pairs, to keep `make test` within its 15-minute budget (all ten passed when written, about 7
# minutes): train both ways (its global batch is what the bench layer sets; tests/unit/test_bench_scaling.py checks
# those overrides without processes), and one strong and one weak run through problem_scale, which rl and envs
# share with sim and infer.
CASES = [("train", "strong"), ("train", "weak"), ("sim", "weak"), ("infer", "strong")]


@pytest.mark.parametrize("workload,scaling", CASES)
def test_the_global_work_at_one_and_two_ranks_is_what_the_label_says(workload, scaling, tmp_path):
    out = tmp_path / "b"
    proc = run_cli("bench", workload, "--nproc", "1,2", f"--{scaling}", "--cpu", "--sample-interval-s", "0",
                   "-o", str(out), *TINY[workload], env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"multigpu bench: {scaling} scaling" in proc.stdout
    one, two = _work_per_step(out / "np1_r0"), _work_per_step(out / "np2_r0")
    assert two / one == pytest.approx(1.0 if scaling == "strong" else 2.0, rel=0.05), (one, two)
