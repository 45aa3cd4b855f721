"""`multigpu train`: bad input fails in the launcher (one line, exit 2, nothing written); a real 2-rank run resumes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_bad_input, run_cli

TINY = ["steps=4", "batch_size=4", "eval_every=2", "eval_batches=2", "log_every=2", "checkpoint_every=2",
        "model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=32", "block_size=32", "data.kwargs.max_chars=60000",
        "sample_chars=40"]


@pytest.mark.parametrize(("argv", "gpus", "expected"), [
    (["stepz=3"], 0, "unknown config key 'stepz'. Did you mean 'steps'?"),
    (["--dtype", "fp64"], 0, "argument --dtype: invalid choice: 'fp64'"),
    (["model.kwargs.n_head=5"], 0, "model.kwargs.n_embd=192 must be divisible by model.kwargs.n_head=5"),
    (["--nproc-per-node", "2", "global_batch_size=3"], 0,
     "global_batch_size=3 is not divisible by world_size × grad_accum = 2 × 1 = 2"),
    (["--nproc-per-node", "2", "--grad-accum", "3", "grad_accum_scope=global"], 0,
     "grad_accum=3 is the job's total (grad_accum_scope=global) but is not divisible by world_size=2"),
    (["data.kwargs.path=/no/such/folder"], 0, "data.kwargs.path '/no/such/folder' does not exist"),
    (["--resume", "/no/such/ckpt.pt"], 0, "--resume /no/such/ckpt.pt: no such file"),
    (["--sync-backend", "nccl"], 0, "--sync-backend nccl needs GPUs, but this job runs on CPU ranks"),
    (["--precision", "bf16"], 1, "bf16 is not supported on this job's CUDA ranks"),
    (["--resume", "auto", "gradient_accumulation_steps=4"], 0, "Did you mean 'grad_accum'?"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, gpus, expected, tmp_path, capsys, fake_gpus):
    fake_gpus(gpus, capability=(7, 0))  # V100s, as NVML reports them: no bf16
    assert_bad_input(["train", "-f", "nano", "--run-dir", str(tmp_path / "run"), *argv], expected, capsys,
                     tmp_path / "run")


@pytest.mark.e2e
def test_bad_input_through_the_real_command_line(tmp_path):
    result = run_cli("train", "--run-dir", str(tmp_path / "run"), "lr=fast", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: config key 'lr' got 'fast'; expected a number"
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_train_two_ranks_checkpoint_resume_auto_continues_and_a_folder_rotation_does_not_understand_is_left_alone(
        tmp_path):
    """A 2-rank run writes its checkpoints; ``--resume auto`` continues from the newest, and no real checkpoint
    is deleted for a folder rotation does not understand (one launch sequence for both: train, plant, resume).

    A stray ``checkpoints/step_99999999/manifest.json`` holding ``{}`` once counted as the newest checkpoint
    for rotation (which then deleted every real one, each new one right after it was written, with keep_last=1)
    while resume skipped it as invalid: the next ``--resume auto`` started from step 0. Rotation now counts and
    deletes only valid checkpoints of the store's own layout, and names the folder it leaves alone, once.

    Also: a pre-existing --run-dir (a link to it) and --log-dir keep 0755, what the job writes there is private."""
    from multigpu.checkpoint import choose
    from tests.cli.test_launch_e2e import _open_to_others

    shared, logs = tmp_path / "shared", tmp_path / "logs"  # folders that exist, open to others (0755)
    for folder in (shared, logs):
        folder.mkdir()
        folder.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.symlink_to(shared)
    first = run_cli("train", "-f", "nano", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                    *TINY, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "effective batch: batch 4 × grad_accum 1 × world_size 2 = 8 samples (256 tokens) per step" in first.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert (run_dir / "sample.txt").read_text().startswith("def ")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_step"] == 4 and summary["unit"] == "tokens"

    planted = shared / "checkpoints" / "step_99999999"  # the ranks name the folder the link leads to
    planted.mkdir()
    (planted / "manifest.json").write_text("{}")
    # keep_last=2 (the nano preset): rotation that counted the stray as the newest would keep it and step 6 only
    again = run_cli("train", "-f", "nano", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--resume", "auto",
                    "--log-dir", str(logs), *TINY, "steps=6", "checkpoint_every=0", timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {shared}/checkpoints/step_00000004" in again.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]  # the resumed run logged step 6 only
    assert all(r["world_size"] == 2 and r["tokens_per_s"] > 0 and "val_loss" in r for r in records)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006",
                                                                           "step_99999999"]
    assert (planted / "manifest.json").read_text() == "{}"  # left as it was
    output = again.stdout + again.stderr
    left_alone = [line for line in output.splitlines() if "left alone" in line]
    assert len(left_alone) == 1 and str(planted) in left_alone[0], output[-3000:]
    said: list[str] = []
    assert choose("auto", str(run_dir), 0, say=said.append) == run_dir / "checkpoints" / "step_00000006"
    # a --run-dir (here a link to it) and a --log-dir that existed keep their mode; what the job wrote there
    # (run.json, metrics, checkpoints, logs, stack dumps) is 0700 / 0600, as in folders multigpu makes
    assert shared.stat().st_mode & 0o777 == logs.stat().st_mode & 0o777 == 0o755
    assert (shared / "run.json").exists() and (shared / "metrics.jsonl").exists() and any(logs.iterdir())
    planted.chmod(0o700)  # the test's own folder
    (planted / "manifest.json").chmod(0o600)
    assert _open_to_others(shared) == {} and _open_to_others(logs) == {}
