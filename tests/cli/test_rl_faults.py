"""`multigpu rl` resumes: a rank SIGKILLed mid-run is restarted by the agent and the run ends
bit-identical to an uninterrupted one; ``--resume auto`` reuses the run's own config and refuses a changed key;
the trained policy loads back as a module (``load_policy``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import fault_callback, logged_steps, run_cli, stopped_by_signal

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

UPDATES = 8
ARGS = ["-f", "ppo-cartpole", "--nproc-per-node", "2", "num_envs=16", "num_steps=16",
        f"total_env_steps={16 * 16 * UPDATES}", "target_return=null", "checkpoint_every=2", "num_minibatches=2",
        "obs_norm=true", "log_every=1"]


def _run(run_dir, *extra, env=None):
    proc = run_cli("rl", *ARGS, "--run-dir", str(run_dir), *extra, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((run_dir / "summary.json").read_text())


def _final(run_dir):
    return torch.load(run_dir / "checkpoints" / f"step_{UPDATES:08d}" / "state.pt", weights_only=True)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One uninterrupted run of ARGS, shared: the fault test's reference, the run the resume test resumes (a copy)."""
    run_dir = tmp_path_factory.mktemp("rl") / "clean"
    return run_dir, _run(run_dir)[1]


def test_a_killed_rank_is_restarted_and_ppo_ends_bit_identical(tmp_path, fault_rng, clean):
    clean_dir, clean = clean
    kill_at = fault_rng.randint(3, UPDATES - 1)  # after the first checkpoint (update 2)
    fault, env = fault_callback(tmp_path, rank=1, step=kill_at)
    proc, faulty = _run(tmp_path / "faulty", "--max-restarts", "1", fault, env=env)
    last = (kill_at - 1) // 2 * 2  # callbacks run before their step's checkpoint: the kill comes before it
    assert f"restart 1: resuming from {tmp_path}/faulty/checkpoints/step_{last:08d}" in proc.stdout, proc.stdout
    assert faulty["rl"]["resumed_from"] == str(tmp_path / "faulty" / "checkpoints" / f"step_{last:08d}")
    for key in ("mean_return", "episodes", "env_steps", "obs_norm"):
        assert faulty["rl"][key] == clean["rl"][key], (key, kill_at)
    a, b = _final(clean_dir), _final(tmp_path / "faulty")
    for name in ("policy", "optimizer", "normalizer", "progress", "rank"):
        assert repr(a[name]) == repr(b[name]) or _same(a[name], b[name]), (name, kill_at)
    assert logged_steps(tmp_path / "faulty") == list(range(1, UPDATES + 1))  # each update once, as the run counts
    # the kept checkpoints rotate (keep_last 3) and nothing temporary is left
    assert sorted(p.name for p in (tmp_path / "faulty" / "checkpoints").iterdir()) == [
        "step_00000004", "step_00000006", "step_00000008"]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_resume_auto_reuses_the_runs_config_refuses_a_kept_key_and_leaves_a_loadable_policy(tmp_path, clean):
    from multigpu.rl import load_policy

    run_dir = tmp_path / "run"
    shutil.copytree(clean[0], run_dir)  # the finished run of ARGS, resumed here (the shared one stays as it ended)
    # no flags but the budget: the run's own config (16 envs, obs_norm, ...) is used, not the preset's 1024 envs
    again = run_cli("rl", "--run-dir", str(run_dir), "--resume", "auto", "--nproc-per-node", "2",
                    f"total_env_steps={16 * 16 * (UPDATES + 2)}", timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/step_{UPDATES:08d}" in again.stdout
    assert f"resumed at update {UPDATES} of {UPDATES + 2}" in again.stdout
    assert json.loads((run_dir / "run.json").read_text())["config"]["num_envs"] == 16
    assert (run_dir / "checkpoints" / f"step_{UPDATES + 2:08d}").is_dir()
    refused = run_cli("rl", "--run-dir", str(run_dir), "--resume", "auto", "num_envs=32", timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--resume: rl.num_envs is 32 here but 16 in the run being resumed" in refused.stderr

    policy = load_policy(run_dir)
    assert isinstance(policy, torch.nn.Module)
    actions = policy(torch.zeros(5, 4))
    assert actions.shape == (5,) and actions.dtype == torch.int64 and set(actions.tolist()) <= {0, 1}


def test_infer_refuses_resume_in_one_line_before_anything_starts(tmp_path):
    proc = run_cli("infer", "--run-dir", str(tmp_path / "run"), "--resume", "auto", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --resume auto: the infer workload cannot resume (it writes no "
                                   "checkpoints); valid: run it again without --resume")
    assert not (tmp_path / "run").exists()


def test_sigterm_ends_ppo_after_its_update_with_a_checkpoint_that_resumes_bit_identical(tmp_path, clean):
    """A pre-emption's SIGTERM while rank 0 is at update 3 (no cadence checkpoint there): before, `multigpu rl`
    had no --checkpoint-on-interrupt and its ranks died where they stood. Now the update's checkpoint is written,
    the launcher exits 143, and --resume auto ends where an uninterrupted run does, bit for bit."""
    run_dir = tmp_path / "stopped"
    done, env = stopped_by_signal(tmp_path, ["rl", *ARGS, "--run-dir", str(run_dir), "--checkpoint-on-interrupt"],
                                  step=3)
    assert done.returncode == 143, done.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert f"interrupted after update 3: checkpoint {checkpoint}" in done.stdout, done.stdout[-2000:]
    resumed, summary = _run(run_dir, "--resume", "auto", env=env)
    assert f"resuming from {checkpoint}" in resumed.stdout, resumed.stdout[-2000:]
    clean_dir, clean = clean  # the uninterrupted run of the same ARGS
    a, b = _final(run_dir), _final(clean_dir)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in b["policy"])
    for key in ("mean_return", "episodes", "env_steps"):
        assert summary["rl"][key] == clean["rl"][key], key
    assert logged_steps(run_dir) == list(range(1, UPDATES + 1))  # the resumed run's updates after the first's


def test_a_checkpoint_without_its_config_still_refuses_another_hidden_size_in_one_line(tmp_path, clean):
    """issue 48: a checkpoint whose manifest records no config (an older one, or one copied without it) resumed with
    another ``hidden_size``: the launcher had nothing to compare, and the rank printed torch's state_dict page
    ("size mismatch for actor.0.weight ..."), though its state.pt records the network's sizes (``spec``). The rank
    reads them before loading: one line naming the key, the checkpoint's value and the one given."""
    clean_dir, _ = clean
    loose = tmp_path / "loose" / "step_00000004"
    shutil.copytree(clean_dir / "checkpoints" / "step_00000004", loose)
    manifest = json.loads((loose / "manifest.json").read_text())
    manifest["meta"].pop("config")
    (loose / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("rl", *ARGS, "hidden_size=32", "--resume", str(loose), "--run-dir", str(tmp_path / "again"),
                   timeout=240)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert "rl.hidden_size is 32 here but 64 in the checkpoint " + str(loose) in errors[0], proc.stderr
    assert "size mismatch" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
