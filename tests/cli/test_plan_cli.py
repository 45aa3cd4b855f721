"""`multigpu plan` end to end in this process: a model description, a preset, a measured bench folder (training on
GPUs, a simulation that counts no FLOPs), the JSON, the plot and the report's section, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multigpu.cli import main
from tests.conftest import ROOT

LLAMA = ["train", "arch=llama", "layers=32", "hidden=4096", "ffn=14336", "heads=32", "kv_heads=8", "vocab=128256",
         "seq=8192", "batch=2", "ac=selective", "strategy=fsdp"]
PRICES = str(ROOT / "examples" / "plan" / "prices.example.yaml")


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "H1000"], "error: unknown GPU type 'H1000'; valid: H100-SXM, H100-PCIe, H200, A100-40GB"),
    (["--budget", "500"], "error: --budget needs prices: --prices FILE"),
    (["--deadline", "1h"], "error: no option meets --deadline 1.0 h: the fastest that fits is 64 x B200 at"),
    (["--network", "ib-xdr"], "error: unknown link 'ib-xdr'; valid: nvlink3"),
    (["--prices", "/no/such.yaml"], "error: --prices /no/such.yaml: cannot read it"),
    (["--count", "0,8"], "error: --count '0,8' is invalid"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    code, out, err = _run(capsys, "plan", *LLAMA, "--items", "1e12", "-o", str(tmp_path / "out"), *argv)
    assert code == 2 and err.startswith(message) and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_size_is_required_and_a_workload_needs_its_measurement(capsys):
    code, _, err = _run(capsys, "plan", *LLAMA)
    assert code == 2 and err.startswith("error: plan needs the job's size: --steps N or --items N")
    code, _, err = _run(capsys, "plan", "sim", "--steps", "10")
    assert code == 2 and "run `multigpu bench --nproc 1,2 sim ...`" in err and "\n" not in err


def test_the_table_names_the_best_and_what_does_not_fit(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    code, out, _ = _run(capsys, "plan", *LLAMA, "--gpus", "H100-SXM,MI300X", "--count", "8,32", "--items", "1e12",
                        "--prices", PRICES, "--deadline", "60d")
    assert code == 0
    assert "does not fit: needs 80.4 of 79.6" in out  # 8 x H100 80GB: torchtitan's 82.4 GiB ran on 96 GB cards
    assert "best that meets the deadline: 32 x MI300X" in out
    assert "AN EXAMPLE FILE, not a quote" in out


def test_json_holds_the_options_the_best_and_the_sources(capsys):
    code, out, _ = _run(capsys, "plan", *LLAMA, "--gpus", "H200", "--count", "8,16", "--items", "1e12", "--json")
    result = json.loads(out)
    assert code == 0 and [o["count"] for o in result["options"]] == [16, 8]
    assert result["best"]["gpu"] == "H200" and result["sources"]["H200"][0]["url"].startswith("https://")
    assert result["unit"] == "tokens" and result["assumptions"] and result["cannot_know"]


def test_a_preset_is_planned_from_its_model_built_on_meta(capsys):
    code, out, _ = _run(capsys, "plan", "train", "-f", "nano", "--gpus", "A100-40GB", "--count", "1", "--steps",
                        "1000", "--json")
    result = json.loads(out)  # the data factory's own lines went to stderr
    assert code == 0 and "-f nano" in result["assumptions"][0] and "0.00181B parameters" in result["assumptions"][0]


def test_out_writes_plan_json_and_the_plot_and_report_shows_them(capsys, tmp_path):
    out_dir = tmp_path / "plan"
    code, _, _ = _run(capsys, "plan", *LLAMA, "--gpus", "H100-SXM,MI300X", "--count", "8,16", "--items", "1e12",
                      "--prices", PRICES, "-o", str(out_dir), "--plot", str(tmp_path / "p.png"))
    assert code == 0 and (out_dir / "plan.json").is_file() and (out_dir / "plan.png").stat().st_size > 10_000
    assert (tmp_path / "p.png").is_file()
    code, _, _ = _run(capsys, "report", str(out_dir))
    page = (out_dir / "report.html").read_text()
    assert code == 0 and "<h2>Plan: 1,000,000,000,000 tokens</h2>" in page and "data:image/png;base64" in page
    assert "does not fit: needs" in page and "Assumptions" in page


def _bench_folder(root: Path, *, unit: str, gpus: list[str], extra: dict) -> Path:
    runs = []
    for n, step in ((1, 0.100), (2, 0.105)):
        per_rank = [{"wall_s": step * 20, "cpu_s": None, "comm_s": 0.004 * 20 * (n - 1), "busy_s": None,
                     "items": 1000 * 20, "steps": 20}] * n
        summary = {"unit": unit, "world_size": n, "steps": 20, "items": 1000 * 20 * n, "wall_s": step * 20,
                   "step_time_s": {"median": step}, "per_rank": per_rank,
                   "traffic": {"all_reduce": {"calls": 1, "bytes": 4e8}} if n > 1 else {}, **extra}
        runs.append({"world_size": n, "summary": summary})
    root.mkdir()
    (root / "bench.json").write_text(json.dumps({"unit": unit, "host": {"hostname": "x", "cores": 16, "gpus": gpus},
                                                 "command": [], "runs": runs}))
    return root


def test_a_measured_training_run_carries_to_faster_gpus_by_the_roofline(capsys, tmp_path):
    folder = _bench_folder(tmp_path / "b", unit="tokens", gpus=["NVIDIA A100-SXM4-80GB"],
                           extra={"flops_per_token": 7.5e8, "strategy": "ddp", "precision": "bf16",
                                  "peak_memory_bytes": [20 * 2**30], "params": 1.24e8})
    code, out, err = _run(capsys, "plan", str(folder), "--gpus", "A100-80GB,H100-SXM,L4", "--count", "1,8",
                          "--steps", "1000", "--json")
    assert code == 0, err
    result = json.loads(out)
    at = {(o["gpu"], o["count"]): o for o in result["options"]}
    assert at[("A100-80GB", 1)]["step_s"] == pytest.approx(0.100, rel=0.05)  # the device it was measured on
    assert at[("H100-SXM", 1)]["step_s"] < at[("A100-80GB", 1)]["step_s"] < at[("L4", 1)]["step_s"]
    assert at[("L4", 8)]["fits"] is True and at[("L4", 8)]["need_bytes"] == 20 * 2**30
    assert "FLOP-bound" in at[("H100-SXM", 1)]["roofline"]


def test_a_measured_run_without_flops_spans_both_roofline_bounds(capsys, tmp_path):
    folder = _bench_folder(tmp_path / "s", unit="agent-steps", gpus=["NVIDIA H100 80GB HBM3"], extra={})
    code, out, err = _run(capsys, "plan", str(folder), "--gpus", "A100-40GB", "--count", "2", "--items", "1e9",
                          "--json")
    assert code == 0, err
    (o,) = json.loads(out)["options"]
    assert o["fits"] is None and o["time_low_s"] < o["time_s"] < o["time_high_s"]
    assert "between all FLOP-bound and all memory-bound" in o["roofline"]


def test_a_folder_from_an_unknown_device_asks_which(capsys, tmp_path):
    folder = _bench_folder(tmp_path / "u", unit="windows", gpus=["NVIDIA GeForce GTX 480"], extra={})
    code, _, err = _run(capsys, "plan", str(folder), "--steps", "10")
    assert code == 2 and "which the catalog does not list; valid: --measured-on one of cpu, H100-SXM" in err
    code, _, err = _run(capsys, "plan", str(tmp_path), "--steps", "10")
    assert code == 2 and "holds neither bench.json nor summary.json" in err
