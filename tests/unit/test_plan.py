"""multigpu plan's pieces (pure): the catalog and its sources, the user's prices, the transformer's counts, the
planner's choices and its one-line refusals."""

from __future__ import annotations

import math

import pytest

from multigpu.errors import ConfigError
from multigpu.plan import DescribedJob, ModelSpec, Size, load_catalog, load_prices, make_plan, parse_duration
from multigpu.plan.cases import GPT2_124M, LLAMA31_8B
from tests.conftest import ROOT

CAT = load_catalog()
EXAMPLE_PRICES = ROOT / "examples" / "plan" / "prices.example.yaml"


# ----------------------------------------------------------------------------- the catalog
def test_the_catalog_has_the_types_asked_for_each_with_sources():
    for key in ("H100-SXM", "H100-PCIe", "H200", "A100-40GB", "A100-80GB", "L40S", "L4", "MI300X", "B200"):
        gpu = CAT.gpu(key)
        assert gpu.sources and all(s["url"].startswith("https://") and s["says"] for s in gpu.sources)
        assert gpu.memory_gb > 0 and gpu.hbm_tbs > 0 and gpu.tdp_w > 0 and "bf16" in gpu.tflops
    for key in ("nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "eth100", "eth200", "eth400"):
        assert CAT.link(key).source["url"].startswith("https://")


def test_peaks_are_dense_not_sparse():
    """The datasheets' headline BF16 figures are with 2:4 sparsity (H100 SXM 1,979): the catalog halves them."""
    assert CAT.gpu("H100-SXM").tflops["bf16"] == pytest.approx(989.4)
    assert CAT.gpu("A100-80GB").tflops["bf16"] == 312
    assert CAT.gpu("h100-sxm") is CAT.gpu("NVIDIA H100 80GB HBM3")  # by key, any case, or by board name


def test_an_unknown_gpu_type_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"unknown GPU type 'H1000'; valid: H100-SXM, H100-PCIe, H200"):
        CAT.gpu("H1000")


def test_a_figure_without_a_source_is_absent_and_asking_for_it_says_why():
    with pytest.raises(ConfigError, match="no fp32 peak for L4"):
        CAT.gpu("L4").peak("fp32")


# ----------------------------------------------------------------------------- prices
def test_the_example_prices_say_they_are_an_example_with_their_date():
    prices = load_prices(EXAMPLE_PRICES)
    assert prices.example and prices.date and prices.currency == "USD"
    assert "AN EXAMPLE" in EXAMPLE_PRICES.read_text()


@pytest.mark.parametrize("text, match", [
    ("per_gpu_hour: {H1000: 2}", "unknown GPU type 'H1000'"),
    ("per_gpu_hour: {H100-SXM: -1}", "positive number"),
    ("currency: USD", "needs 'per_gpu_hour"),
    ("per_gpu_hour: [1,", "not YAML"),
])
def test_bad_prices_are_one_line(tmp_path, text, match):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_prices(path)


# ----------------------------------------------------------------------------- the transformer's counts
def test_gpt2_counts_its_parameters_and_the_mfu_convention():
    spec = ModelSpec(**GPT2_124M, batch=12)
    assert spec.total_params == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small, tied embedding, 1024 positions
    assert spec.model_flops_per_token() == 6 * spec.total_params + 12 * 12 * 768 * 1024


def test_llama_8b_counts_near_its_published_size():
    spec = ModelSpec(**{**LLAMA31_8B, "params": None}, batch=2)
    assert spec.total_params == pytest.approx(8.03e9, rel=0.01)


def test_collectives_ddp_all_reduces_the_gradients_fsdp_gathers_and_reduce_scatters():
    ddp = ModelSpec(**GPT2_124M, batch=12).traffic(8)
    assert set(ddp) == {"all_reduce"} and ddp["all_reduce"]["bytes"] == pytest.approx(4 * 124.4e6, rel=0.01)
    fsdp = ModelSpec(**LLAMA31_8B, batch=2, strategy="fsdp").traffic(8)
    assert fsdp["sharded_all_gather"]["bytes"] == 2 * 2 * 8.03e9  # bf16, forward and again in backward
    assert fsdp["reduce_scatter"]["bytes"] == 4 * 8.03e9
    hsdp = ModelSpec(**LLAMA31_8B, batch=2, strategy="hsdp", shard_size=8).traffic(32)
    assert set(hsdp) == {"sharded_all_gather:shard", "reduce_scatter:shard", "all_reduce:replicate"}
    assert ModelSpec(**GPT2_124M, batch=12).traffic(1) == {}


def test_memory_fsdp_shards_the_state_ddp_keeps_a_replica():
    spec = ModelSpec(**LLAMA31_8B, batch=2, strategy="fsdp", ac="selective")
    at8, at64 = spec.memory_per_rank(8), spec.memory_per_rank(64)
    assert at8["state"] == pytest.approx(16 * 8.03e9 / 8) and at64["state"] == pytest.approx(at8["state"] / 8)
    assert at8["activations"] == at64["activations"]
    ddp = ModelSpec(**GPT2_124M, batch=12)
    assert ddp.memory_per_rank(1)["state"] == ddp.memory_per_rank(8)["state"]


def test_checkpointing_trades_memory_for_recompute():
    kw = {**LLAMA31_8B, "batch": 2, "strategy": "fsdp"}
    none, sel, full = (ModelSpec(**kw, ac=a) for a in ("none", "selective", "full"))
    assert none.activation_bytes_per_token() > sel.activation_bytes_per_token() > full.activation_bytes_per_token()
    assert none.flops_per_token()["matmul"] < sel.flops_per_token()["matmul"] < full.flops_per_token()["matmul"]


def test_model_keys_are_checked():
    with pytest.raises(ConfigError, match="unknown model key 'layer'. Did you mean 'layers'"):
        ModelSpec.from_keys({"layer": 2, "hidden": 8, "seq": 8, "batch": 1})
    with pytest.raises(ConfigError, match="needs layers"):
        ModelSpec.from_keys({"hidden": 8, "seq": 8, "batch": 1})
    with pytest.raises(ConfigError, match="model.ac='some' is invalid; valid: none, selective, full"):
        ModelSpec.from_keys({"layers": 2, "hidden": 8, "seq": 8, "batch": 1, "ac": "some"})


# ----------------------------------------------------------------------------- the planner
def _plan(**kw):
    spec = ModelSpec(**LLAMA31_8B, batch=2, ac="selective", strategy="fsdp")
    args = {"gpus": [CAT.gpu("H100-SXM"), CAT.gpu("H200"), CAT.gpu("MI300X")], "counts": [8, 16, 64],
            "network": CAT.link("ib-ndr"), "size": Size(items=1e12), "catalog": CAT} | kw
    return make_plan(DescribedJob(spec), **args)


def test_options_say_what_does_not_fit_and_sort_by_time():
    result = _plan()
    h100_8 = next(o for o in result["options"] if (o["gpu"], o["count"]) == ("H100-SXM", 8))
    assert h100_8["fits"] is False and h100_8["need_bytes"] > h100_8["have_bytes"]
    fitting = [o for o in result["options"] if o["fits"]]
    assert [o["time_s"] for o in fitting] == sorted(o["time_s"] for o in fitting)
    assert result["options"][-1]["fits"] is False  # the ones that do not fit come last
    for o in fitting:
        assert o["time_low_s"] < o["time_s"] < o["time_high_s"]
        assert o["kwh"] == pytest.approx(o["count"] * CAT.gpu(o["gpu"]).tdp_w * o["time_s"] / 3600 / 1000)


def test_the_best_is_the_cheapest_that_meets_the_deadline():
    prices = load_prices(EXAMPLE_PRICES)
    result = _plan(prices=prices, deadline_s=parse_duration("60d"))
    best = result["best"]
    meeting = [o for o in result["options"] if o["fits"] and o["time_s"] <= 60 * 86400 and o["cost"] is not None]
    assert best == min(meeting, key=lambda o: o["cost"])
    assert result["sort"] == "cost" and any("AN EXAMPLE FILE" in a for a in result["assumptions"])


def test_a_deadline_nothing_meets_names_the_fastest_option():
    result = _plan()
    fastest = min((o for o in result["options"] if o["fits"]), key=lambda o: o["time_s"])
    with pytest.raises(ConfigError, match=rf"no option meets --deadline 1.0 h: the fastest that fits is "
                                          rf"{fastest['count']} x {fastest['gpu']} at"):
        _plan(deadline_s=3600)


def test_cost_needs_prices():
    with pytest.raises(ConfigError, match="--budget needs prices: --prices FILE"):
        _plan(budget=100)
    with pytest.raises(ConfigError, match="--sort cost needs prices"):
        _plan(sort="cost")


def test_a_budget_nothing_meets_names_the_cheapest():
    with pytest.raises(ConfigError, match="no option fits --budget 1: the cheapest is"):
        _plan(prices=load_prices(EXAMPLE_PRICES), budget=1)


@pytest.mark.parametrize("text, seconds", [("24h", 86400), ("90m", 5400), ("1.5d", 129600), ("30s", 30)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["24", "h", "-1h", "0h", "1w", "1e3h"])
def test_bad_durations(text):
    with pytest.raises(ConfigError, match="--deadline .* is invalid; valid: a duration such as 90m, 24h, 3d"):
        parse_duration(text)


def test_the_interval_comes_from_the_residuals():
    from multigpu.plan.planner import interval_factor

    assert interval_factor([0.1])[0] == 1.0
    factor, how = interval_factor([0.1, -0.1, 0.05, -0.05])
    assert factor == pytest.approx(math.exp(3.18 * math.sqrt(0.00625) * math.sqrt(1.25)))
    assert "4 residuals" in how


def test_hsdp_runs_its_shard_collectives_within_a_node_and_refuses_a_count_that_does_not_split():
    """HSDP's all-gathers and reduce-scatters stay inside a replica (one node of 8 here, on NVLink): across 4 nodes
    they cost what they cost on one node, FSDP's cross the network."""
    from multigpu.plan.model import Cluster, describe_step

    kw = {**LLAMA31_8B, "batch": 2, "ac": "selective"}
    net = CAT.link("eth100")
    hsdp = describe_step(ModelSpec(**kw, strategy="hsdp", shard_size=8), Cluster(CAT.gpu("H200"), 32, net), CAT)
    fsdp = describe_step(ModelSpec(**kw, strategy="fsdp"), Cluster(CAT.gpu("H200"), 32, net), CAT)
    assert hsdp["comm_s"] < fsdp["comm_s"] / 3
    with pytest.raises(ConfigError, match="12 GPUs do not split into replicas of 8"):
        ModelSpec(**kw, strategy="hsdp", shard_size=8).traffic(12)
