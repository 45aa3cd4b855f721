"""The bad-input suite: random and malformed input to every command, each answered by one line and exit 2.

For each command a *valid* base command line is corrupted in one place, drawn by
hypothesis: an unknown flag, a typed flag with a malformed value, a choice
outside its choices, a missing/unreadable/malformed/misspelt config file, a bad
``key=value`` override, a missing input file, a flag with no value, a
``--resume`` checkpoint crafted to run code when unpickled, a rendezvous
endpoint this machine cannot host (not its address, a name that does not
resolve, a port in use, ``is_host`` neither true nor false). Every case must end
with exit code 2, exactly one line on stderr starting ``error:``, no traceback,
nothing launched (torch's launcher is replaced by a tripwire), nothing written
where the command would have written, and no payload run. The count of cases is
printed at the end of the test session.

A new command must get a base line here: the first test fails until it does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import string
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multigpu.cli import build_parser, commands, main
from tests.conftest import ROOT, SCRIPTS
from tests.payloads import evil_checkpoint, evil_sim_checkpoint, nifti_gz_bomb, png_bomb

COMMANDS = commands()
"""Every command of ``multigpu --help`` (the tools and the built-in workloads that are commands)."""

CASES: Counter = Counter()
"""Cases tried per command (read by conftest's terminal summary)."""

KINDS: Counter = Counter()
"""Cases tried per kind of corruption (read by conftest's terminal summary)."""

SCRIPT = str(SCRIPTS / "fail_rank1.py")  # exists; never runs here
_IMAGE = ROOT / "tests" / "fuzz" / "_tiny.png"


def _image() -> str:
    if not _IMAGE.exists():
        from PIL import Image

        Image.new("RGB", (32, 32), (90, 120, 200)).save(_IMAGE)
    return str(_IMAGE)


PRESETS = "src/multigpu/presets"

# command -> (valid argv after the command name, config file or None, how overrides are given, output flag)
BASES: dict[str, dict] = {
    "launch": {"argv": [SCRIPT], "out": "--log-dir"},
    "info": {"argv": []},
    "doctor": {"argv": ["--skip-bandwidth"]},
    "train": {"argv": ["-f", "nano"], "config": f"{PRESETS}/nano.yaml", "overrides": "positional",
              "out": "--run-dir", "resume": "file"},
    "infer": {"argv": ["--model", "multigpu.infer.models:denoiser", "--input", "@image", "--roi", "16"],
              "overrides": "--set", "out": "--output", "missing_file_flag": "--input"},
    "bench": {"argv": ["--nproc", "1,2", SCRIPT], "out": "--run-dir"},
    "verify": {"argv": ["--nproc", "1,2", SCRIPT], "out": "--run-dir"},
    "report": {"argv": ["@rundir"], "out": "-o"},
    "sim": {"argv": ["-f", "sir"], "config": f"{PRESETS}/sir.yaml",
            "overrides": "positional", "out": "--run-dir", "resume": "folder"},
    "rl": {"argv": ["-f", "ppo-cartpole"], "config": f"{PRESETS}/ppo-cartpole.yaml", "overrides": "positional",
           "out": "--run-dir"},
    # the workload's own flags come after its name, so --run-dir cannot lead; the run dir is made only after checks
    "run": {"argv": ["sim", "-f", "sir"], "config": f"{PRESETS}/sir.yaml", "overrides": "positional"},
    # a model description (its sizes are the key=value overrides); plan.json is written into -o only at the end
    "plan": {"argv": ["train", "layers=12", "hidden=768", "seq=1024", "batch=12", "--steps", "100", "--count", "1,8"],
             "overrides": "positional", "out": "-o"},
}

_TAKES_SCRIPT = ("launch", "bench", "verify")
"""Commands whose arguments after the script belong to the script."""

_PAYLOAD_MARKER = "PAYLOAD_RAN"
"""What a crafted checkpoint's payload would create in the case's folder if anything unpickled it."""

_BAD_NUMBERS = ["", "abc", "1e", "--", "0x1g", "½", "NaN?", "1,5", "two", "-", "1.2.3"]

_BUSY = socket.create_server(("127.0.0.1", 0))
"""A port something already listens on: a rendezvous store cannot bind it."""


def _unusable_endpoint(kind: str, token: str) -> list[str]:
    """Launcher flags whose rendezvous endpoint this machine cannot host (it must: node 0 of the job)."""
    node0 = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint"]
    return {
        "not_here": [*node0, "203.0.113.7:29400"],  # TEST-NET-3: no machine's own address
        "unresolvable": [*node0, f"no-such-host-{token}.invalid:29400"],
        "in_use": ["--rdzv-endpoint", f"127.0.0.1:{_BUSY.getsockname()[1]}"],
        "is_host": ["--rdzv-conf", f"is_host=zz{token}"],  # neither true nor false
    }[kind]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(name: str) -> list[argparse.Action]:
    return [a for a in _subparser(name)._actions if a.option_strings and a.dest not in ("help", "debug")]


def _all_option_strings(name: str) -> list[str]:
    return [s for a in _subparser(name)._actions for s in a.option_strings]


def _bad_value(action: argparse.Action) -> st.SearchStrategy[str]:
    """Values this option must reject."""
    type_name = getattr(action.type, "__name__", "")
    if action.choices:
        valid = {str(c) for c in action.choices}
        return st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=8).filter(
            lambda v: v not in valid and not v.startswith("-"))
    if type_name in ("positive_int", "_nproc"):
        extra = ["0", "-3", "1.5"] + (["autox"] if type_name == "_nproc" else [])
        return st.sampled_from(_BAD_NUMBERS + extra).filter(lambda v: not v.startswith("-") or v[1:].isdigit())
    if type_name == "non_negative_int":
        return st.sampled_from(_BAD_NUMBERS + ["-1", "2.5"]).filter(lambda v: v != "-")
    if type_name in ("positive_float", "_tolerance", "float"):
        extra = {"positive_float": ["0", "-2.5"], "_tolerance": ["-1e-3"], "float": []}[type_name]
        return st.sampled_from([v for v in _BAD_NUMBERS if v not in ("", "-")] + extra)
    return st.nothing()


def _typed_options(name: str) -> list[argparse.Action]:
    return [a for a in _options(name) if a.nargs != 0 and (a.choices or getattr(a.type, "__name__", "") in (
        "positive_int", "non_negative_int", "positive_float", "_tolerance", "float", "_nproc"))]


@st.composite
def corruption(draw, name: str, tmp: Path) -> tuple[list[str], list[str], str]:
    """(flags to put right after the command, a replacement base argv or None, what kind of case)."""
    base = BASES[name]
    kinds = ["unknown_flag", "flag_without_value"]
    typed = _typed_options(name)
    if typed:
        kinds.append("bad_typed_value")
    if base.get("config"):
        kinds += ["config_missing", "config_is_dir", "config_malformed", "config_unknown_key", "config_wrong_type"]
    if base.get("overrides"):
        kinds += ["override_unknown_key", "override_malformed"]
    if name in _TAKES_SCRIPT:
        kinds.append("missing_script")
    if base.get("missing_file_flag"):
        kinds.append("missing_input_file")
    if base.get("resume"):
        kinds.append("resume_untrusted")
    if "--rdzv-endpoint" in _all_option_strings(name):
        kinds += ["unusable_endpoint", "rdzv_secret"]
    kind = draw(st.sampled_from(kinds))
    argv = list(base["argv"])
    token = draw(st.text(string.ascii_lowercase, min_size=3, max_size=10))

    if kind == "unknown_flag":
        known = _all_option_strings(name)
        flag = "--" + token
        if any(k.startswith(flag) for k in known):  # argparse accepts unambiguous prefixes
            flag = "--zz" + token
        return [flag], argv, kind
    if kind == "flag_without_value":
        valued = [a for a in _options(name) if a.nargs is None and a.option_strings[0].startswith("--")]
        if not valued:
            return ["--zz" + token], argv, "unknown_flag"
        action = draw(st.sampled_from(valued))
        if name in _TAKES_SCRIPT:  # after the script it would be the script's own argument: put it before
            return [], [action.option_strings[0], *argv], kind
        return [], argv + [action.option_strings[0]], kind  # the value is missing at the end
    if kind == "bad_typed_value":
        action = draw(st.sampled_from(typed))
        return [f"{action.option_strings[0]}={draw(_bad_value(action))}"], argv, kind
    if kind.startswith("config_"):
        cfg = tmp / f"cfg_{token}.yaml"
        if kind == "config_missing":
            cfg = tmp / "no" / f"{token}.yaml"
        elif kind == "config_is_dir":
            cfg.mkdir()
        elif kind == "config_malformed":
            cfg.write_text(draw(st.sampled_from(["steps: [1,\n", "a: b: c\n", "- x\n- y\n", ": :\n", "\t- bad\n"])))
        else:
            data = yaml.safe_load((ROOT / base["config"]).read_text())
            if kind == "config_unknown_key":
                data["zz" + token] = 1
            else:
                numeric = [k for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
                data[draw(st.sampled_from(numeric))] = "zz-" + token
            cfg.write_text(yaml.safe_dump(data))
        argv[argv.index("-f") + 1] = str(cfg)
        return [], argv, kind
    if kind in ("unusable_endpoint", "rdzv_secret"):
        if kind == "rdzv_secret":  # several nodes, and MULTIGPU_RDZV_SECRET unset or too short
            flags = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29400"]
            os.environ["MULTIGPU_RDZV_SECRET"] = draw(st.sampled_from(["", token[:8]]))  # the test restores it
        else:
            flags = _unusable_endpoint(draw(st.sampled_from(["not_here", "unresolvable", "in_use", "is_host"])),
                                       token)
        if name in _TAKES_SCRIPT:  # after the script they would be the script's own arguments
            return flags, argv, kind
        return [], argv + flags, kind
    if kind == "override_unknown_key":
        item = f"zz{token}=1"
    else:
        item = draw(st.sampled_from([token, f"={token}", f"{token}="])) if kind == "override_malformed" else token
        if item.endswith("=") and not item.startswith("="):
            item = f"zz{item}"  # an unknown key with an empty value
    if kind in ("override_unknown_key", "override_malformed"):
        extra = [item] if base["overrides"] == "positional" else ["--set", item]
        return [], argv + extra, kind
    if kind == "missing_script":
        return [], [f"no_such_{token}.py"], kind
    if kind == "resume_untrusted":  # never unpickled: not listed in a manifest / no or a stale checksum
        marker = tmp / _PAYLOAD_MARKER
        if base["resume"] == "file":  # a folder without a manifest, or with a forged one (its globals refused)
            folder = tmp / "checkpoints"
            crafted = evil_checkpoint(folder / draw(st.sampled_from([f"step_{token}", "step_99999999"])), marker,
                                      listed=draw(st.booleans()))
        else:
            crafted = evil_sim_checkpoint(tmp / f"step_{token}", marker, checksum=draw(st.sampled_from(["none", "stale"])))
        return [], argv + ["--resume", str(crafted)], kind
    flag = base["missing_file_flag"]  # missing_input_file
    argv[argv.index(flag) + 1] = str(tmp / f"missing_{token}.png")
    return [], argv, kind


def _resolve_placeholders(argv: list[str], tmp: Path) -> list[str]:
    out = []
    for item in argv:
        if item == "@image":
            item = _image()
        elif item == "@rundir":
            run_dir = tmp / "bench_run"
            run_dir.mkdir(exist_ok=True)
            item = str(run_dir)
        out.append(item)
    return out


def test_every_command_has_a_base_line():
    assert set(COMMANDS) <= set(BASES), f"add a base command line for {sorted(set(COMMANDS) - set(BASES))}"


_COUNTER = itertools.count()


@pytest.mark.parametrize("name", [c for c in COMMANDS if c in BASES])
def test_bad_input_gets_one_line_and_exit_2(name, tmp_path_factory, monkeypatch, capsys, fake_gpus):
    fake_gpus(0)
    tripwire = mock.Mock(side_effect=AssertionError("bad input reached torch's launcher"))
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", tripwire)
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "")  # a case that needs another value sets it; restored after

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def run(data):
        tmp = tmp_path_factory.mktemp(f"{name}{next(_COUNTER)}")
        os.environ["MULTIGPU_RDZV_SECRET"] = ""  # an rdzv_secret case sets its own
        flags, argv, kind = data.draw(corruption(name, tmp), label="corruption")
        argv = _resolve_placeholders(argv, tmp)
        out = BASES[name].get("out")
        target = tmp / "out" / "here"
        out_args = [out, str(target)] if out else []
        command = [name, *flags, *out_args, *argv]
        capsys.readouterr()
        code = main(command)
        err = capsys.readouterr().err.strip()
        CASES[name] += 1
        KINDS[kind] += 1
        assert code == 2, f"{command} ({kind}) exited {code}: {err}"
        assert err.startswith("error: ") and "\n" not in err, f"{command} ({kind}) printed: {err!r}"
        assert "Traceback" not in err
        assert not target.exists(), f"{command} ({kind}) wrote {target}"
        assert not (tmp / _PAYLOAD_MARKER).exists(), f"{command} ({kind}) ran a crafted checkpoint's payload"
        tripwire.assert_not_called()

    run()


# ----------------------------------------------------------------------------- what cannot fit, folders in use
def _png(path: Path, side: int) -> str:
    from PIL import Image

    if not path.exists():
        Image.new("RGB", (side, side), (90, 120, 200)).save(path)
    return str(path)


def _used(tmp: Path) -> Path:
    """A run directory that already holds a run."""
    run = tmp / "used"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "manifest.json").write_text('{"format": 1, "checkpoints": []}')
    (run / "logs").mkdir()  # an empty folder holds nothing: not named
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _busy(tmp: Path) -> Path:
    """A run directory whose lock a live process holds (this one: same pid and start time)."""
    import os
    import socket

    import psutil

    run = tmp / "busy"
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "started": psutil.Process().create_time(), "since": "12:00:00"}))
    return run


def _deep_manifest(tmp: Path) -> Path:
    """A run folder whose one checkpoint's manifest.json is 200,000 lists deep."""
    step = tmp / "deep" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    return tmp / "deep"


def _truncated_run(tmp: Path) -> Path:
    """A train run whose every checkpoint has a file shorter than its manifest records (a copy cut short)."""
    run = tmp / "cut"
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"cut short")
        manifest = {"format": 2, "step": step, "world_size": 1, "time": "", "meta": {},
                    "files": {"state.pt": {"bytes": 4096, "sha256": "0" * 64}}}
        (folder / "manifest.json").write_text(json.dumps(manifest))
    (run / "run.json").write_text(json.dumps({"workload": "train", "config": {}}))
    return run


def _lock_folder(tmp: Path) -> Path:
    """A run directory whose lock's name is taken by a folder."""
    run = tmp / "locked"
    (run / ".lock").mkdir(parents=True)
    return run


def _other_models_run(tmp: Path) -> Path:
    """A train run whose checkpoint (never opened: the launcher reads its manifest) holds a narrower model."""
    run = tmp / "narrow"
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"not opened")
    manifest = {"format": 2, "step": 4, "world_size": 1, "time": "", "files": {"state.pt": {"bytes": 10, "sha256": "0" * 64}},
                "meta": {"params": {"tok.weight": [98, 32], "pos.weight": [256, 32]}}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    model = {"factory": "multigpu.train.nano:gpt", "kwargs": {"n_layer": 4, "n_head": 4, "n_embd": 32}}
    (run / "run.json").write_text(json.dumps({"workload": "train", "config": {"model": model}}))
    return run


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tokens(tmp: Path, train: list[int] | bytes, val: list[int] | None = None) -> str:
    """A nanoGPT token folder (uint16 ids; bytes: written as they are)."""
    import numpy as np

    folder = tmp / "tokens"
    folder.mkdir()
    if isinstance(train, bytes):
        (folder / "train.bin").write_bytes(train)
    else:
        np.array(train, dtype=np.uint16).tofile(folder / "train.bin")
    if val is not None:
        np.array(val, dtype=np.uint16).tofile(folder / "val.bin")
    return f"data.kwargs.path={folder}"


def _cut_population(tmp: Path) -> str:
    """An .npz population whose ``y`` member holds 500 of the 3000 rows its header declares."""
    import zipfile

    import numpy as np

    path = tmp / "pop.npz"
    np.savez(path, x=np.zeros(3000, np.int16), y=np.zeros(3000, np.int16))
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data[: 128 + 1000] if name == "y.npy" else data)
    return str(path)


def _edges(tmp: Path, src: list, dst: list) -> str:
    """An .npz edge list for ``network.kind=file`` (numpy picks the dtype: a float anywhere makes it float64)."""
    import numpy as np

    path = tmp / "edges.npz"
    np.savez(path, src=np.array(src), dst=np.array(dst))
    return f"network.path={path}"


def _exposed_in_sir(tmp: Path) -> str:
    """An .npz population for plain SIR in which one agent is in state 1 (E, a state only SEIR has)."""
    import numpy as np

    path = tmp / "pop.npz"
    state = np.zeros(3000, np.uint8)
    state[1234] = 1
    np.savez(path, x=np.zeros(3000, np.int16), y=np.zeros(3000, np.int16), state=state)
    return str(path)


def _cut_png(tmp: Path) -> str:
    """A PNG of noise (so its data is most of the file) cut in half, as a copy that stopped half-way leaves it."""
    import numpy as np
    from PIL import Image

    whole, cut = tmp / "whole.png", tmp / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    whole.unlink()
    return str(cut)


def _link(path: Path, to: Path) -> str:
    path.symlink_to(to)
    return str(path)


def _users_folder(tmp: Path) -> str:
    """A folder of the user's that an output flag names: never replaced."""
    folder = tmp / "thesis"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.txt").write_text("four years")
    return str(folder)


def _file(path: Path) -> str:
    path.write_text("a file, not a folder")
    return str(path)


def _nan_affine_nifti(tmp: Path) -> str:
    """A NIfTI volume whose voxel-to-world matrix (sform) holds a NaN: nibabel reads it, and refuses to write it."""
    import nibabel as nib
    import numpy as np

    header = nib.Nifti1Header()
    header.set_data_shape((20, 20, 20))
    header.set_data_dtype(np.float32)
    header["sform_code"], header["qform_code"], header["vox_offset"] = 1, 0, 352
    header["srow_x"], header["srow_y"], header["srow_z"] = [np.nan, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]
    path = tmp / "nan.nii"
    path.write_bytes(header.binaryblock + bytes(4) + bytes(20 * 20 * 20 * 4))
    return str(path)


def _report_dir(tmp: Path, files: dict[str, str]) -> str:
    folder = tmp / "report_in"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return str(folder)


_MADE: dict[tuple[str, ...], Path] = {}
"""Runs made once for this module: {the run's command line: its folder}. A case copies what it needs of one."""


def _made_once(*argv: str) -> Path:
    """The run folder of ``multigpu ARGV --run-dir FOLDER --nproc-per-node 1``, run once for the module (read it or
    copy from it; a case changes only its own copy)."""
    import atexit
    import shutil
    import subprocess
    import sys
    import tempfile

    if argv not in _MADE:
        folder = Path(tempfile.mkdtemp(prefix="mg-bad-input-"))
        atexit.register(shutil.rmtree, folder, True)
        subprocess.run([sys.executable, "-m", "multigpu", *argv, "--run-dir", str(folder / "run"),
                        "--nproc-per-node", "1"], check=True, capture_output=True, timeout=180, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
        _MADE[argv] = folder / "run"
    return _MADE[argv]


def _ensemble_with_a_changed_digit(tmp: Path) -> Path:
    """A finished ensemble run (4 replicates) whose replicate r000002.csv had one digit changed since it was written,
    its shape intact (a band mean of 13,751 instead of 2,501 passed unnoticed)."""
    import shutil

    run = tmp / "ens"
    shutil.copytree(_made_once("sim", "-f", "sir", "--agents", "2000", "--steps", "10", "grid=[20,20]", "plot=false",
                               "compile=false", "--replicates", "4"), run, symlinks=True)
    victim = run / "ensemble" / "replicates" / "p000000" / "r000002.csv"
    text = victim.read_text()
    at = max(i for i, c in enumerate(text) if c.isdigit())
    victim.write_text(text[:at] + str((int(text[at]) + 5) % 10) + text[at + 1:])
    return run


def _loose_checkpoint(tmp: Path, workload: str, *args: str) -> str:
    """A checkpoint of a short ``workload`` run copied away from its run folder (no run.json beside it)."""
    import shutil

    first = min((_made_once(workload, *args) / "checkpoints").glob("step_*"))
    shutil.copytree(first, tmp / "ck")
    return str(tmp / "ck")


_RL_RUN = ("-f", "ppo-cartpole", "num_envs=64", "total_env_steps=2048", "target_return=null", "checkpoint_every=1")
_SIM_RUN = ("-f", "sir", "--agents", "2000", "--steps", "4", "grid=[20,20]", "plot=false", "compile=false",
            "--checkpoint-every", "2")

GIB = 1 << 30
_SUMMARY_WITHOUT_STEPS = json.dumps({"unit": "items", "world_size": 1, "throughput": 1.0})
_BENCH_OUTSIDE = json.dumps({"rows": [], "runs": [{"run_dir": "../elsewhere"}]})

# (kind, made-up free memory, argv builder over the case's folder, what the line must say)
LIMIT_CASES = [
    ("limits", 4 * GIB, lambda t: ["launch", "--nproc-per-node", "100000", SCRIPT],
     "--nproc-per-node 100000: 100,000 ranks need at least 19.1 TiB"),
    ("limits", 4 * GIB, lambda t: ["train", "-f", "nano", "--nproc-per-node", "100000", "--run-dir", str(t / "r")],
     "valid: --nproc-per-node at most 20 on this machine"),
    ("limits", 8 * GIB, lambda t: ["sim", "-f", "sir", "--agents", "2_000_000_000", "--nproc-per-node", "2",
                                   "--run-dir", str(t / "r")],
     "sim.agents=2_000_000_000 does not fit: 1,000,000,000 agents per rank need about 33.5 GiB"),
    ("limits", None, lambda t: ["sim", "-f", "sir", "--agents", str(10**12), "--run-dir", str(t / "r")],
     "sim.agents=1_000_000_000_000 is more than the 2_147_483_647 agent ids (int32) allow"),
    ("limits", None, lambda t: ["bench", "--weak", "--nproc", "1,2", "--run-dir", str(t / "r"), "sim",
                                "agents=1_500_000_000"],
     "sim.agents=1_500_000_000 × 2 ranks (weak scaling) = 3_000_000_000 is more than"),
    ("limits", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--input",
                                _png(t / "big.png", 1024), "--roi", "256", "--overlap", "0.999999",
                                "--run-dir", str(t / "r")],
     "--overlap 0.999999 with --roi 256 makes 591,361 windows for the 1024x1024 image"),
    ("limits", 250 << 20, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--input",
                                     _png(t / "huge.png", 2048), "--roi", "64", "--run-dir", str(t / "r")],
     "the output of 1 image(s) does not fit on rank 0: it needs about 179 MiB (reading the inputs 67 MiB"),
    ("run dir", None, lambda t: ["train", "-f", "nano", "--run-dir", str(_used(t))],
     "already exists and is not empty (checkpoints/, metrics.jsonl); valid: --resume auto to continue that run"),
    ("run dir", None, lambda t: ["sim", "-f", "sir", "--run-dir", str(_busy(t)), "--resume", "auto"],
     "is in use by another run: pid"),
    # launch --log-dir onto a run's folder: its run.json would be replaced (while it runs, or for its resume)
    ("run dir", None, lambda t: ["launch", "--log-dir", str(_busy(t)), SCRIPT], "--log-dir {t}/busy is in use by "
     "another run: pid"),
    ("run dir", None, lambda t: ["launch", "--log-dir", str(_other_models_run(t)), SCRIPT],
     "--log-dir {t}/narrow is the run folder of a train run (its run.json would be replaced); valid: another "
     "--log-dir"),
    # every checkpoint cut short: the ranks found none usable and one of them ended the job (exit 1)
    ("run dir", None, lambda t: ["train", "-f", "nano", "--run-dir", str(_truncated_run(t)), "--resume", "auto"],
     "cut/checkpoints holds 2 checkpoint folder(s) and none can be used (step_00000004: state.pt is truncated (9 "
     "bytes on disk, 4,096 written)"),
    # a manifest nested too deeply for the JSON reader: an internal RecursionError, for auto and a path alike
    ("run dir", None, lambda t: ["train", "-f", "nano", "--run-dir", str(_deep_manifest(t)), "--resume", "auto"],
     "step_00000002: its manifest.json is nested too deeply to read"),
    ("run dir", None, lambda t: ["train", "-f", "nano", "--resume", str(_deep_manifest(t) / "checkpoints" /
                                                                       "step_00000002"), "--run-dir", str(t / "r")],
     "step_00000002: its manifest.json is nested too deeply to read; valid: an intact checkpoint"),
    ("run dir", None, lambda t: ["sim", "-f", "sir", "--run-dir", str(_lock_folder(t)), "--resume", "auto"],
     "--run-dir {t}/locked: {t}/locked/.lock is a folder, not the run's lock file; valid: remove that folder, or "
     "another --run-dir"),
    ("run dir", None, lambda t: ["train", "-f", "nano", "--run-dir", str(_other_models_run(t)), "--resume", "auto"],
     "step_00000004 does not fit this model: tok.weight is (98, 32) in the checkpoint and (98, 192) in the model"),
    ("run dir", None, lambda t: ["bench", "--nproc", "1,2", "--run-dir", str(_used(t)), SCRIPT],
     "already exists and is not empty (checkpoints/, metrics.jsonl); give a new folder"),
    ("run dir", None, lambda t: ["verify", "--nproc", "1,2", "--run-dir", str(_used(t)), SCRIPT],
     "already exists and is not empty"),
    # a replicate changed since it was written: refused by its checksum, naming it (continued or copied)
    ("ensemble files", None, lambda t: ["sim", "--resume", "auto", "--run-dir", str(_ensemble_with_a_changed_digit(t))],
     "ens/ensemble/replicates/p000000/r000002.csv is not the replicate this ensemble wrote (it does not match its "
     "checksum in"),
    ("ensemble files", None, lambda t: ["sim", "--resume", str(_ensemble_with_a_changed_digit(t) / "ensemble"),
                                        "--run-dir", str(t / "r")],
     "r000002.csv is not the replicate this ensemble wrote (it does not match its checksum in {t}/ens/ensemble/"
     "checksums.jsonl"),
    # a checkpoint away from its run folder, resumed with a setting the run must keep: checked against the checkpoint
    ("resumed settings", None, lambda t: ["rl", "--resume", _loose_checkpoint(t, "rl", *_RL_RUN), "num_steps=8",
                                          "--run-dir", str(t / "r")],
     "error: --resume: rl.num_steps is 8 here but 16 in the checkpoint {t}/ck, and a resumed rl run keeps"),
    ("resumed settings", None, lambda t: ["rl", "--resume", _loose_checkpoint(t, "rl", *_RL_RUN), "seed=5",
                                          "--run-dir", str(t / "r")],
     "error: --resume: rl.seed is 5 here but 1 in the checkpoint {t}/ck"),
    # another model on a resumed run: the old model's parameters were blamed ("unknown config key sim.params.move_prob")
    ("resumed settings", None, lambda t: ["sim", "--resume", _loose_checkpoint(t, "sim", *_SIM_RUN), "--model",
                                          "market", "--run-dir", str(t / "r")],
     "error: --resume: sim.model is 'market' here but 'sir' in the checkpoint {t}/ck, and a resumed sim run keeps"),
    # fewer steps than the checkpoint has done: nothing ran, and the run ended as if it had
    ("resumed settings", None, lambda t: ["sim", "--resume", _loose_checkpoint(t, "sim", *_SIM_RUN), "--steps", "1",
                                          "--run-dir", str(t / "r")],
     "error: --resume: {t}/ck is at step 2, past the 1 steps this sim run is set to: nothing would run; valid: more "
     "steps than 2"),
    ("resumed settings", None, lambda t: ["sim", "--resume", _loose_checkpoint(t, "sim", *_SIM_RUN), "--agents",
                                          "3000", "--run-dir", str(t / "r")],
     "error: --resume: sim.agents is 3000 here but 2000 in the checkpoint {t}/ck"),
    ("foreign files", None, lambda t: ["sim", "-f", "sir", "--run-dir", str(t / "r"), "--save-agents",
                                       _users_folder(t)],
     "thesis' holds files that are not agent files (sub/, thesis.txt), so it is not replaced"),
    ("foreign files", None, lambda t: ["sim", "-f", "sir", "--run-dir", str(t / "r"), "--save-agents",
                                       str(_used(t))],
     "used' holds files that are not agent files (checkpoints/, logs/, metrics.jsonl)"),
    ("limits", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--input",
                                str(png_bomb(t / "bomb.png", 12000)), "--run-dir", str(t / "r")],
     "is 12000x12000 and would decode to 412 MiB from a "),
    ("limits", None, lambda t: ["infer", "--model", "tests.cli.test_infer_formats_e2e:smooth3d", "--roi", "64",
                                "--input", str(nifti_gz_bomb(t / "bomb.nii.gz")), "--run-dir", str(t / "r")],
     "bomb.nii.gz' would decompress to 320 MiB of voxels from a 324 KiB file (1,011x its size, more than "
     "max_decode_ratio=100)"),
    # the bomb guard turned off: the memory check now counts what decoding costs (the old count, 5.4 GiB, passed)
    ("limits", int(5.8 * GIB), lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--input",
                                          str(png_bomb(t / "bomb.png", 12000)), "--set", "max_decode_ratio=0",
                                          "--run-dir", str(t / "r")],
     "it needs about 5.81 GiB (reading the inputs 2.05 GiB"),
    ("infer outputs", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--roi", "16",
                                       "--input", _png(_folder(t / "inplace") / "ok.png", 32),
                                       "--output", str(t / "inplace"), "--run-dir", str(t / "r")],
     "--input '{t}/inplace/ok.png' would be overwritten by its own output {t}/inplace/ok.png; valid: an --output"),
    ("infer outputs", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--roi", "16", "--input",
                                       _png(_folder(t / "coll" / "a") / "x.png", 32),
                                       _png(_folder(t / "coll" / "b") / "x.png", 32), "--output", str(t / "out"),
                                       "--run-dir", str(t / "r")],
     "--input '{t}/coll/a/x.png' and '{t}/coll/b/x.png' would both be written to {t}/out/x.png; valid:"),
    ("infer outputs", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--roi", "16", "--input",
                                       _png(_folder(t / "same") / "x.png", 32), "--run-dir", str(t / "r"),
                                       "--output", _link(t / "link", t / "same")],
     "would be overwritten by its own output"),
    # bad values inside user data, named in the launcher
    ("data values", None, lambda t: ["train", "--data", "multigpu.train.data:token_files",
                                     _tokens(t, bytes(2 * 600 + 1)), "--run-dir", str(t / "r")],
     "train.bin is 1,201 bytes, not a whole number of uint16 token ids (2 bytes each)"),
    ("data values", None, lambda t: ["train", "--data", "multigpu.train.data:token_files",
                                     _tokens(t, list(range(50)) * 12, [3, 70, 5] * 100), "--run-dir", str(t / "r")],
     "val.bin holds token id 70 but the vocabulary has 50 ids (the largest id in train.bin plus one); valid: ids "
     "below 50, or data.kwargs.vocab_size=71 or more"),
    ("data values", None, lambda t: ["train", "--data", "multigpu.train.data:token_files",
                                     _tokens(t, list(range(50)) * 12), "data.kwargs.vocab_size=40",
                                     "--run-dir", str(t / "r")],
     "train.bin holds token id 49 but the vocabulary has 40 ids (data.kwargs.vocab_size)"),
    ("data values", None, lambda t: ["sim", "-f", "sir", "--population", _cut_population(t), "--run-dir", str(t / "r")],
     "pop.npz': column 'y' declares 3,000 rows but holds 500 (1,128 of 6,128 bytes): the file is cut short"),
    # float edge ids, refused by the launcher (the ranks read them as a "population" with a wrong range, exit 1)
    ("data values", None, lambda t: ["sim", "--model", "network_sir", "--agents", "10", "network.kind=file",
                                     _edges(t, [0, 1.5, 2], [1, 2, 3]), "--run-dir", str(t / "r")],
     "edges.npz': column 'src' holds float64 values; valid: agent ids as integers"),
    ("data values", None, lambda t: ["sim", "--model", "network_sir", "--agents", "10", "network.kind=file",
                                     _edges(t, [0, 1, 2], [1.0, 2.0, 3.0]), "--run-dir", str(t / "r")],
     "edges.npz': column 'dst' holds float64 values; valid: agent ids as integers"),
    ("data values", None, lambda t: ["sim", "-f", "sir", "--population", _exposed_in_sir(t), "--run-dir", str(t / "r")],
     "pop.npz': column 'state' holds 1 in row 1,234, a value model 'sir' does not use; valid: 0 (S), 2 (I), 3 (R)"),
    ("data values", None, lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--roi", "16", "--input",
                                     _cut_png(t), "--run-dir", str(t / "r")],
     "error: input '{t}/cut.png' is cut short or damaged (Truncated File Read); valid: a complete PNG file"),
    # a NaN in a NIfTI's affine: every window was computed, then nibabel refused to write the output (exit 1)
    ("data values", None, lambda t: ["infer", "--model", "tests.cli.test_infer_formats_e2e:smooth3d", "--roi", "16",
                                     "--input", _nan_affine_nifti(t), "--run-dir", str(t / "r")],
     "NIfTI '{t}/nan.nii' has an affine (its voxel-to-world matrix) that is not finite (nan in row 0); valid: a "
     "NIfTI whose qform/sform holds finite numbers"),
    # a --log-dir that is a file (torch's NotADirectoryError, an internal error), a rendezvous setting torch reads
    # as a number (its error came as the job started: two lines, exit 1)
    ("log dir", None, lambda t: ["launch", "--log-dir", _file(t / "afile"), SCRIPT],
     "error: --log-dir {t}/afile is a file, not a folder; valid: a folder (it is created if missing)"),
    ("log dir", None, lambda t: ["train", "-f", "nano", "--log-dir", _file(t / "afile"), "--run-dir", str(t / "r")],
     "error: --log-dir {t}/afile is a file, not a folder"),
    ("rdzv conf", None, lambda t: ["launch", "--rdzv-conf", "join_timeout=abc", SCRIPT],
     "error: --rdzv-conf join_timeout=abc is invalid; valid: a whole number of seconds, 1 or more"),
    ("rdzv conf", None, lambda t: ["sim", "-f", "sir", "--rdzv-conf", "is_host=true,keep_alive_max_attempt=0",
                                   "--run-dir", str(t / "r")],
     "error: --rdzv-conf keep_alive_max_attempt=0 is invalid; valid: a whole number of attempts, 1 or more"),
    # a key given twice in a YAML mapping: the last one won, silently
    ("config files", None, lambda t: ["train", "-f", _config(t, "steps: 4\nlr: 0.001\nsteps: 8\n"),
                                      "--run-dir", str(t / "r")],
     "error: config file '{t}/cfg.yaml' has the key 'steps' twice (lines 1 and 3); valid: each key once"),
    ("config files", None, lambda t: ["sim", "-f", _config(t, "params:\n  beta: 0.1\n  beta: 0.2\n"),
                                      "--run-dir", str(t / "r")],
     "has the key 'beta' twice (lines 2 and 3)"),
    # a --local-ranks-filter beyond the node's workers: every line hidden, silently
    ("launch flags", None, lambda t: ["launch", "--nproc-per-node", "1", "--local-ranks-filter", "5", SCRIPT],
     "error: --local-ranks-filter 5 names local rank(s) 5, but this node runs 1 worker(s); valid: local ranks 0 to 0"),
    # a thread count no rank can start: "exited with code 130 without a Python exception"
    ("launch flags", None, lambda t: ["launch", "--threads", "100000", SCRIPT],
     "error: --threads 100000 asks each rank for 100,000 compute threads on 2 core(s); valid: at most 1,024"),
    # a misspelt --rdzv-conf key: ignored (torch reads the keys it knows, the join waited its default 600 s)
    ("rdzv conf", None, lambda t: ["launch", "--rdzv-conf", "join_timout=5", SCRIPT],
     "error: --rdzv-conf join_timout=5: unknown key 'join_timout' (did you mean join_timeout?); valid keys: "),
    ("report files", None, lambda t: ["report", _report_dir(t, {"summary.json": _SUMMARY_WITHOUT_STEPS})],
     "summary.json has no 'steps' entry"),
    ("report files", None, lambda t: ["report", _report_dir(t, {"summary.json": '{"steps": 3,'})],
     "summary.json is not valid JSON"),
    ("report files", None, lambda t: ["report", _report_dir(t, {"bench.json": _BENCH_OUTSIDE})],
     "names the run folder '../elsewhere', which is not a folder inside"),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("kind", "memory", "argv", "expected"), LIMIT_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(LIMIT_CASES)])
def test_what_cannot_fit_or_is_in_use_gets_one_line_and_exit_2(kind, memory, argv, expected, tmp_path, monkeypatch,
                                                                 capsys, fake_gpus):
    """Nothing starts that cannot fit (made-up memory figures), run folders are never shared or reused
    without --resume, and report files that multigpu did not write are named, not a KeyError."""
    fake_gpus(0, available_bytes=memory)
    tripwire = mock.Mock(side_effect=AssertionError("bad input reached torch's launcher"))
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", tripwire)
    command = argv(tmp_path)
    before = _snapshot(tmp_path)
    code = main(command)
    err = capsys.readouterr().err.strip()
    CASES[kind] += 1
    assert code == 2, f"{command} exited {code}: {err}"
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert expected.format(t=tmp_path) in err, err
    assert _snapshot(tmp_path) == before and not (tmp_path / "r").exists(), f"{command} wrote something"
    tripwire.assert_not_called()


# ----------------------------------------------------------------------------- tiny inputs, unbounded work
def _npy_header_only(path: Path, shape: tuple[int, ...], data: bytes = b"") -> str:
    """A .npy of a 128-byte header saying ``shape`` float32, and ``data``: as much as ``np.prod(shape)``, which
    wraps around in int64, says the shape holds (0 elements for (2**32, 2**32), 4 for (2**62 + 1, 4))."""
    import io

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    path.write_bytes(header.getvalue() + data)
    return str(path)


def _npz_header_only(path: Path, shape: tuple[int, ...]) -> str:
    """An .npz population whose column ``x`` is a header saying ``shape`` int16, and no data."""
    import io
    import zipfile

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i2", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", header.getvalue())
        zf.writestr("y.npy", header.getvalue())
    return str(path)


def _alias_bomb(levels: int = 9) -> str:
    """A "billion laughs" in YAML: each level lists the previous one nine times (342 bytes, 9**9 values)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _config(tmp: Path, text: str) -> str:
    path = tmp / "cfg.yaml"
    path.write_text(text)
    return str(path)


# (argv builder over the case's folder, what the line must say); each used to take minutes or end in a MemoryError
TINY_INPUT_CASES = [
    (lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--model-arg", "channels=1", "--input",
                _npy_header_only(t / "huge.npy", (2**32, 2**32)), "--run-dir", str(t / "r")],
     "huge.npy' is truncated: its header says shape (4294967296, 4294967296) float32 "
     "(73,786,976,294,838,206,464 bytes of data) but the file holds 0"),
    (lambda t: ["infer", "--model", "multigpu.infer.models:denoiser", "--model-arg", "channels=1", "--input",
                _npy_header_only(t / "huge.npy", (2**62 + 1, 4), bytes(16)), "--run-dir", str(t / "r")],
     "huge.npy' is truncated: its header says shape (4611686018427387905, 4) float32 "
     "(73,786,976,294,838,206,480 bytes of data) but the file holds 16"),
    (lambda t: ["sim", "-f", "sir", "--population", _npz_header_only(t / "pop.npz", (2**32, 2**32)),
                "--run-dir", str(t / "r")],
     "column 'x' declares 4,294,967,296 rows but holds 0"),
    (lambda t: ["train", "-f", _config(t, _alias_bomb()), "--run-dir", str(t / "r")],
     "cfg.yaml' is refused: its aliases (*name) expand it to 490,329,064 values (aliases may add at most 100,000)"),
    (lambda t: ["sim", "-f", _config(t, "agents: 1000\ngrid: &g [64, *g]\n"), "--run-dir", str(t / "r")],
     "cfg.yaml' is refused: an alias (*name) refers to a list or mapping that contains it"),
    (lambda t: ["train", "-f", "nano", "--run-dir", str(t / "r"),
                "x=" + "[" + ", ".join([f"&a0 [{','.join(['1'] * 9)}]"] + [
                    f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]) + "]"],
     "override 'x=...' is refused: its aliases (*name) expand it to"),
    (lambda t: ["train", "-f", "nano", "--dry-run", "--world-size", "1000000000"],
     "--world-size 1000000000: a dry run plans at most 1,048,576 ranks"),
    # an ensemble's size, counted before a replicate or a point is listed (5 GB after 25 s; 1.4 GB, nothing run)
    (lambda t: ["sim", "-f", "sir", "--replicates", "1000000000000", "--run-dir", str(t / "r")],
     "sim.ensemble.replicates=1000000000000 is more than one ensemble runs: valid: at most 1,000,000 replicates "
     "in all"),
    (lambda t: ["sim", "-f", "sir", "--replicates", "200", "--sweep", "params.beta=0.1:0.5:10000", "--run-dir",
                str(t / "r")],
     "10,000 points x 200 replicates = 2,000,000 replicates; valid: at most 1,000,000 replicates in all"),
    (lambda t: ["sim", "-f", "sir", "--sweep", "params.beta=0.1:0.5:100000000", "--run-dir", str(t / "r")],
     "--sweep params.beta=0.1:0.5:100000000 makes 100,000,000 points; valid: at most 10,000 sweep points"),
    (lambda t: ["sim", "-f", "sir", "--sweep", "params.beta=0.1:0.5:5000", "--sweep", "agents=1000:2000:5000",
                "--run-dir", str(t / "r")],
     "--sweep makes 25,000,000 points (5,000 x 5,000); valid: at most 10,000 sweep points"),
]


@pytest.mark.parametrize(("argv", "expected"), TINY_INPUT_CASES, ids=[f"tiny-{i}" for i in range(len(TINY_INPUT_CASES))])
def test_a_tiny_input_that_would_cost_unbounded_work_gets_one_line_within_seconds(argv, expected, tmp_path, capsys,
                                                                                   monkeypatch, fake_gpus):
    """A 128-byte .npy whose header's shape overflows ``np.prod`` to 0 (150 s and 2.8 GB of window planning), a 1 KB
    YAML alias bomb in a config file or an override (a hang), ``--dry-run --world-size 1000000000`` (a MemoryError
    after 27 s): each is refused in one line, exit 2, before any work that grows with what it declares."""
    import time

    fake_gpus(0)
    tripwire = mock.Mock(side_effect=AssertionError("bad input reached torch's launcher"))
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", tripwire)
    command = argv(tmp_path)
    before = _snapshot(tmp_path)
    start = time.monotonic()
    code = main(command)
    took = time.monotonic() - start
    err = capsys.readouterr().err.strip()
    CASES["tiny inputs"] += 1
    assert code == 2, f"{command} exited {code}: {err}"
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert expected in err, err
    assert took < 10, f"{command} took {took:.1f} s to refuse"  # seconds, not minutes: nothing was expanded or planned
    assert _snapshot(tmp_path) == before and not (tmp_path / "r").exists(), f"{command} wrote something"
    tripwire.assert_not_called()


def test_a_log_dir_on_a_read_only_file_system_gets_one_line_and_exit_2(tmp_path):
    """A --log-dir on a read-only file system (to be made in it, or the folder itself) ended in an internal OSError,
    exit 1. Mounted read-only in a mount namespace of its own (root only), so nothing outside the test sees it."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a read-only file system needs root and unshare; CI runs as root")
    ro = tmp_path / "ro"
    ro.mkdir()
    run = tmp_path / "run"
    python = f"{sys.executable} -m multigpu"
    script = (f"mount -t tmpfs -o ro,size=1m tmpfs {ro} || exit 99; "
              f"{python} launch --log-dir {ro}/logs {SCRIPT}; echo rc=$?; "
              f"{python} train -f nano --log-dir {ro} --run-dir {run}; echo rc=$?; "
              f"{python} sim -f sir --run-dir {ro}/run; echo rc=$?")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if proc.returncode == 99:
        pytest.skip(f"this machine does not let a mount namespace mount tmpfs: {proc.stderr.strip()}")
    assert proc.stdout.split() == ["rc=2", "rc=2", "rc=2"], (proc.stdout, proc.stderr)
    # the run folder on it: read-only, not "only 1 MiB free" (issue 48: the free-space check spoke first)
    assert proc.stderr.splitlines() == [f"error: could not create --log-dir {ro}/logs: Read-only file system (EROFS)",
                                        f"error: cannot write into --log-dir {ro}: Read-only file system (EROFS)",
                                        f"error: could not create --run-dir {ro}/run: Read-only file system (EROFS)"]
    assert not run.exists()
