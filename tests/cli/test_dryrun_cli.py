"""``--dry-run --world-size N``: the job at scale in one process, in seconds, writing nothing."""

import re
import subprocess

import pytest

from tests.conftest import ROOT, assert_bad_input, run_cli

SMALL = ["model.kwargs.n_layer=2", "model.kwargs.n_embd=128", "data.kwargs.max_chars=200000", "batch_size=4"]
"""A small nano GPT on little text (the real runs below take seconds)."""


def _mib(text: str, name: str) -> float:
    size, unit = re.search(rf"^\s+{name}\s+([\d.]+) (KiB|MiB|GiB)\s+measured", text, re.M).groups()
    return float(size) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit]


def _dry(tmp_path, *args):
    """The dry run in a subprocess. Its speed is not asserted (the project measures speed in benchmarks; on an
    idle 2-core machine each of these took 10-15 s): the timeout only ends one that hangs."""
    return run_cli(*args, "--dry-run", cwd=tmp_path, timeout=180)


@pytest.fixture
def dry(tmp_path, monkeypatch, capsys):
    """The dry run through the command line's own entry point (``multigpu.cli.main``, as the bad-input suite calls
    it) in this process, run from ``tmp_path``: the same report, exit code and files as ``python -m multigpu``
    (the subprocess path is the one ``_dry`` takes below), without a new interpreter and torch import per call."""
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main([*args, "--dry-run"])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_train_at_64_ranks_measures_memory_in_seconds_and_writes_nothing(tmp_path, dry, strategy):
    out = dry("train", "--strategy", strategy, "--world-size", "64", "--dry-run-rank", "63",
                 "--device-memory", "H100", *SMALL)
    assert out.returncode == 0, out.stderr
    assert "rank 63 of 64 (8 node(s) × 8 GPUs)" in out.stdout
    assert re.search(r"rank 63 gets \d+ per epoch", out.stdout)
    for name in ("parameters", "gradients", "optimizer state", r"activations \(at peak\)", "peak of a training step"):
        assert _mib(out.stdout, name) > 0, name
    assert "fits H100 (81,559 MiB): yes" in out.stdout
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, nothing half-written


def test_a_config_that_cannot_fit_is_one_line_exit_2_naming_both_sizes(tmp_path, dry):
    out = dry("train", "--world-size", "64", "--device-memory", "10MiB", *SMALL, "batch_size=16")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert re.fullmatch(r"error: does not fit: rank 0 of 64 needs about [\d.]+ MiB \(peak of a training step, "
                        r"measured\) but --device-memory is 10MiB = 10 MiB; valid: .*", lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_every_size_error_of_the_real_run_is_listed(tmp_path, dry):
    # fsdp over more ranks than the largest parameter has rows, and more ranks than a batch per rank
    out = dry("train", "--strategy", "fsdp", "--world-size", "1024", *SMALL, "batch_size=512")
    assert out.returncode == 2
    assert "error: strategy=fsdp on 1024 ranks leaves rank" in out.stdout
    assert "error: each rank gets" in out.stdout and "fewer than batch_size=512" in out.stdout
    assert "(and 1 more error(s) listed above)" in out.stderr
    out = dry("train", "--world-size", "64", *SMALL, "global_batch_size=1000")  # does not split
    assert out.returncode == 2
    assert "global_batch_size=1000 is not divisible by world_size × grad_accum = 64 × 1 = 64" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_sim_at_1024_ranks_and_infer_at_64(tmp_path, dry):
    out = dry("sim", "--agents", "1_000_000_000", "--world-size", "1024", "--dry-run-rank", "1",
                 "--device-memory", "80GB")
    assert out.returncode == 0, out.stderr
    assert "rank 1 holds agents [976,563, 1,953,126): 976,563 of them" in out.stdout
    assert re.search(r"peak of a step\s+[\d.]+ MiB\s+estimated", out.stdout)
    out = dry("sim", "--strategy", "spatial", "--world-size", "1024")
    assert out.returncode == 2 and "sim.grid has 1000 rows, fewer than the 1024 ranks" in out.stderr
    out = dry("infer", "--world-size", "64", "--device-memory", "L4", "batch_size=2")
    assert out.returncode == 0, out.stderr
    assert "rank 0 runs windows [0, 2)" in out.stdout and "rank(s) get no window" in out.stdout
    assert re.search(r"peak of a model call\s+[\d.]+ MiB\s+measured", out.stdout)
    assert list(tmp_path.iterdir()) == []
    # a volume takes 3-D windows (the dry run planned 2-D ones: an internal ValueError from zip)
    import numpy as np

    volume = tmp_path.parent / f"{tmp_path.name}_volume.npy"
    np.save(volume, np.zeros((16, 16, 8), np.float32))
    out = dry("infer", "--input", str(volume), "--model", "torch.nn:Identity", "--roi", "8", "--world-size", "2")
    assert out.returncode == 0, out.stderr
    assert "1 image(s), 9 windows of 8x8x8 in 2 batches of 8; rank 0 runs windows [0, 8)" in out.stdout
    assert re.search(r"peak of a model call\s+[\d.]+ KiB\s+measured", out.stdout), out.stdout


def test_dry_run_flags_need_dry_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert_bad_input(["train", "--world-size", "64"], "add --dry-run", capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("strategy, nproc", [("ddp", 1), ("fsdp", 2)])
def test_per_rank_state_agrees_with_a_real_cpu_run(tmp_path, strategy, nproc, dry):
    """The dry run's measured parameters, gradients and optimizer state (fake tensors) against the trainer's own
    per-rank accounting in a real run of the same model on 1 and 2 CPU ranks: within 2% (the trainer prints
    one decimal of MiB). The 1-rank dry run goes through ``python -m multigpu`` in a subprocess (the command
    line users type), the 2-rank one through ``cli.main`` in this process (the same report, no second start-up)."""
    args = ["train", "--strategy", strategy, *SMALL]
    dry = (_dry(tmp_path, *args, "--world-size", str(nproc), "--cpu") if nproc == 1
           else dry(*args, "--world-size", str(nproc), "--cpu"))
    assert dry.returncode == 0, dry.stderr
    real = run_cli(*args, "--nproc-per-node", str(nproc), "--cpu", "--run-dir", str(tmp_path / "run"), "steps=1",
                   "eval_every=0", "checkpoint_every=0", "sample_chars=0", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert real.returncode == 0, real.stderr[-2000:]
    said = re.search(r"training state per rank .*: parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, "
                     r"optimizer \(Adam\) ([\d.]+) MiB", real.stdout)
    assert said, real.stdout[-2000:]
    for name, value in zip(("parameters", "gradients", "optimizer state"), said.groups(), strict=True):
        assert _mib(dry.stdout, name) == pytest.approx(float(value), rel=0.02), name


def test_the_clusters_pages_dry_run_block_says_what_the_page_says(tmp_path, dry):
    """The four commands of the clusters page's "Will it fit?", as written (the infer line on a big.tif made here):
    three fit, and the fsdp line at 1,024 ranks exits 2 with the two errors the page names."""
    import numpy as np
    import tifffile

    page = (ROOT / "docs" / "clusters.md").read_text(encoding="utf-8")
    block = page[page.index("### Will it fit? `--dry-run --world-size N`"):]
    block = re.search(r"<!-- no-run: needs an input image -->\n```bash\n(.*?)```", block, flags=re.S).group(1)
    lines = [line.split("#")[0].split()[1:] for line in block.strip().splitlines()]
    assert [argv[0] for argv in lines] == ["train", "train", "sim", "infer"]
    tifffile.imwrite(tmp_path / "big.tif", np.random.default_rng(0).random((512, 512, 3), dtype=np.float32),
                     photometric="rgb")
    for argv in lines:
        assert argv.count("--dry-run") == 1
        out = dry(*(a for a in argv if a != "--dry-run"))
        if argv[:3] == ["train", "--strategy", "fsdp"]:
            assert out.returncode == 2, out.stdout
            assert "leaves rank 768 with no parameters (the largest parameter has 768 rows)" in out.stdout
            assert "each rank gets 13 samples per epoch, fewer than batch_size=16" in out.stdout
        else:
            assert out.returncode == 0, out.stderr
            assert re.search(r"fits (H100|A100|L4) \([\d,]+ MiB\): yes", out.stdout), out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.tif"]  # nothing written
