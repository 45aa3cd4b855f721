"""karpathy/nanoGPT's own train.py, model.py and config/train_shakespeare_char.py (tests/third_party/nanogpt, the real
files) under ``multigpu launch``, ``verify`` and ``train``, the way docs/migration/nanogpt.md tells users.

These pin the page's claims: the edits it shows (read from the page and applied to a copy), the hint for each error
a user meets on the way (the config's accumulation steps at 2 ranks, ``'cuda' in device`` given a torch.device,
``DDP(device_ids=...)`` on a CPU rank), verify's result, and its model under ``multigpu train`` with the token-file
loader (its ``forward(idx, targets)`` returning ``(logits, loss)``, its ``generate()`` without a generator). The
data are nanoGPT's prepared files (``train.bin``, ``val.bin``, ``meta.pkl``), made here as its
``data/shakespeare_char/prepare.py`` makes them, from local text instead of the downloaded one. Sizes are tiny
(one layer, 16-token blocks, two iterations): each run takes seconds.
"""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest

from tests import guide_edits
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.e2e

NANOGPT = ROOT / "tests" / "third_party" / "nanogpt"
GUIDE = ROOT / "docs" / "migration" / "nanogpt.md"
CONFIG = "config/train_shakespeare_char.py"
TINY = ["--compile=False", "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1",
        "--batch_size=2", "--block_size=16", "--n_layer=1", "--n_head=2", "--n_embd=16", "--dropout=0.0"]
"""What the tests add to the page's commands: the config's model and run, shrunk to seconds on a CPU."""
ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200"}


@pytest.fixture
def nanogpt(tmp_path):
    """A clone's folder: nanoGPT's files, and data/shakespeare_char prepared as its prepare.py does (characters
    sorted into a vocabulary, ids as uint16, the first 90% to train.bin, meta.pkl with vocab_size/itos/stoi)."""
    for name in ("train.py", "model.py", "configurator.py", CONFIG):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(NANOGPT / name, tmp_path / name)
    text = "".join((NANOGPT / name).read_text() for name in ("train.py", "model.py", "configurator.py"))
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    data = tmp_path / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    split = int(0.9 * len(ids))
    ids[:split].tofile(data / "train.bin")
    ids[split:].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, fh)
    return tmp_path


def _launch(folder, *args: str):
    return run_cli("launch", "--nproc-per-node", "2", "train.py", CONFIG, *TINY, "--backend=gloo", *args, env=ENV,
                   cwd=folder, timeout=180)


def _error(proc) -> str:
    return proc.stderr[proc.stderr.index("error: "):]


def test_nanogpt_step_1_as_it_is_it_stops_at_cuda_on_a_cpu_rank_with_the_hint(nanogpt):
    """nanoGPT as it is, with --backend=gloo: torch.cuda.set_device on a CPU rank, and the hint to use mg.device()."""
    error = _error(_launch(nanogpt))
    assert "torch.cuda.set_device(device)" in error and "hint: the script calls CUDA" in error, error


def test_nanogpt_step_2_the_configs_accumulation_steps_at_two_ranks_get_the_flag_to_change(nanogpt):
    """With the page's edits, the config's gradient_accumulation_steps=1 trips nanoGPT's own assert at 2 ranks. The
    hint said to read the world size from the environment, which nanoGPT does already; it names the flag now."""
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt")
    proc = _launch(nanogpt)
    assert proc.returncode == 1
    error = _error(proc)
    assert 'File "train.py", line 94' in error and "assert gradient_accumulation_steps % ddp_world_size == 0" in error
    assert ("hint: the script needs gradient_accumulation_steps to be a multiple of the number of ranks: give it "
            "one (--gradient_accumulation_steps=2 at 2 ranks" in error), error


def test_nanogpt_step_2_a_torch_device_where_nanogpt_wants_a_string_gets_a_hint(nanogpt):
    """``device = mg.device()`` (the line the page used to show): nanoGPT tests ``'cuda' in device``."""
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt")
    text = (nanogpt / "train.py").read_text().replace("device = str(mg.device())", "device = mg.device()")
    (nanogpt / "train.py").write_text(text)
    proc = _launch(nanogpt, "--gradient_accumulation_steps=2")
    error = _error(proc)
    assert "TypeError: argument of type 'torch.device' is not iterable" in error, error
    assert "hint: the script uses its device as a string ('cuda' in device): use str(mg.device())" in error, error


def test_nanogpt_step_2_ddp_device_ids_on_a_cpu_rank_gets_a_hint(nanogpt):
    """``DDP(model, device_ids=[ddp_local_rank])`` kept: torch's ValueError on a CPU rank, now with what to write."""
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt")
    text = (nanogpt / "train.py").read_text().replace("model = DDP(model)", "model = DDP(model, device_ids=[ddp_local_rank])")
    (nanogpt / "train.py").write_text(text)
    proc = _launch(nanogpt, "--gradient_accumulation_steps=2")
    error = _error(proc)
    assert "DistributedDataParallel device_ids and output_device arguments only work" in error, error
    assert "hint: DDP's device_ids name a GPU, and this rank's model is on the CPU: write DDP(model)" in error, error


def test_nanogpt_step_2_with_the_pages_edits_trains_on_two_cpu_ranks(nanogpt):
    """The page's three edits and its command: nanoGPT's loop runs to its end on 2 CPU ranks."""
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt")
    proc = _launch(nanogpt, "--gradient_accumulation_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iter 2: loss" in proc.stdout and "step 2: train loss" in proc.stdout, proc.stdout[-2000:]
    assert "warning" not in proc.stderr.replace("Warning", ""), proc.stderr[-2000:]
    assert (nanogpt / "out-shakespeare-char" / "ckpt.pt").is_file()


def test_nanogpt_step_3_verify_fails_and_names_its_lines_as_the_page_shows(nanogpt):
    """The page's record line, then verify at 1 and 2 ranks: nanoGPT seeds each rank differently and divides the
    accumulation steps, so the final losses differ; the causes printed are the ones the page shows."""
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt")
    guide_edits.apply(nanogpt / "train.py", GUIDE, "nanogpt verify")
    proc = run_cli("verify", "--nproc", "1,2", "train.py", CONFIG, *TINY, "--backend=gloo",
                   "--gradient_accumulation_steps=2", env=ENV, cwd=nanogpt, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: verify failed: 'final_loss' at 2 ranks vs 1" in proc.stderr
    page = GUIDE.read_text()
    causes = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("- train.py:")]
    assert len(causes) == 3, proc.stdout[-3000:]
    for cause in causes:
        where = cause.split(": a ")[0].split(": the ")[0]  # "- train.py:91: `seed_offset = ddp_rank`"
        assert where in page, f"the page does not show {where!r}"


def test_nanogpt_step_4_its_model_trains_under_multigpu_train_on_its_prepared_files(nanogpt):
    """nanoGPT's GPT behind the page's factory, on its prepared .bin files through the token-file loader: the
    default loss passes the targets to ``forward(idx, targets)`` (called without them, nanoGPT returns the last
    position's logits only: "Expected input batch_size (4) to match target batch_size (64)")."""
    guide_edits.apply(nanogpt / "model.py", GUIDE, "nanogpt model")
    proc = run_cli("train", "--model", "model:gpt", "--data", "multigpu.train.data:token_files",
                   "data.kwargs.path=data/shakespeare_char", "data.kwargs.block_size=16", "--nproc-per-node", "2",
                   "--run-dir", str(nanogpt / "run"), "steps=4", "eval_every=4", "batch_size=4",
                   env=ENV, cwd=nanogpt, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((nanogpt / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and 0 < summary["val_loss"] < 5.0, summary  # ln 90 = 4.5 at random weights


def test_nanogpt_step_4_the_sample_after_training_calls_its_own_generate(nanogpt):
    """On text data (the default characters), the run ends with a sample drawn by the model's own
    ``generate(idx, max_new_tokens)``: it was called with our ``generator=`` keyword, and the job exited 1 after
    training ("GPT.generate() got an unexpected keyword argument 'generator'")."""
    guide_edits.apply(nanogpt / "model.py", GUIDE, "nanogpt model")
    proc = run_cli("train", "--model", "model:gpt", "--nproc-per-node", "1", "--run-dir", str(nanogpt / "run"),
                   "steps=2", "eval_every=2", "batch_size=4", "block_size=16", "sample_chars=20",
                   env=ENV, cwd=nanogpt, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--- sample ---" in proc.stdout and len((nanogpt / "run" / "sample.txt").read_text()) > 20, proc.stdout


def test_nanogpt_step_4_verify_at_one_and_two_ranks_passes_within_the_pages_tolerance(nanogpt):
    """The page's verify of its model: equal within the tolerance it states (DDP averages two ranks' gradients,
    in another order of float additions than one rank's batch), not exactly."""
    guide_edits.apply(nanogpt / "model.py", GUIDE, "nanogpt model")
    proc = run_cli("verify", "--nproc", "1,2", "--rtol", "1e-5", "train", "--model", "model:gpt", "--data",
                   "multigpu.train.data:token_files", "data.kwargs.path=data/shakespeare_char",
                   "data.kwargs.block_size=16", "steps=4", "eval_every=4", "batch_size=4", "log_every=0",
                   env=ENV, cwd=nanogpt, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    passed = next(line for line in proc.stdout.splitlines() if "verify passed" in line)
    assert "(atol 0, rtol 1e-05)" in passed, passed
    assert "multigpu verify --nproc 1,2 --rtol 1e-5 train --model model:gpt" in GUIDE.read_text()
