"""bench --predict's alpha-beta model and fit, against hand-computed cases (pure)."""

from __future__ import annotations

import pytest

from multigpu.bench.predict import LINKS, Link, busy_cores, cost, fit_sizes, parse_predict, predict, resolve_link
from multigpu.doctor.pingpong import fit_alpha_beta
from multigpu.errors import ConfigError

# 10 us per message, 1 GB/s: a byte costs 1 ns
LINK = Link("test", 10e-6, 1e9)


@pytest.mark.parametrize(("kind", "n", "nbytes", "expected"), [
    # ring: 2(n-1) a = 2*3*10us; 2(n-1)/n S b = 1.5 * 1 MB * 1 ns  (tree: 2*2*(10us + 1ms) is slower)
    ("all_reduce", 4, 1e6, (60e-6, 1.5e-3)),
    # tiny message: tree 2 log2(8) a = 60 us beats ring 2*7*10 = 140 us; its bytes: 2*3*8 ns
    ("all_reduce", 8, 8, (60e-6, 48e-9)),
    # recursive doubling: log2(4) a = 20 us, (n-1) s b = 3 * 1 ms
    ("all_gather", 4, 1e6, (20e-6, 3e-3)),
    ("gather", 5, 1e3, (30e-6, 4e-6)),  # ceil(log2 5) = 3 hops
    ("broadcast", 4, 1e6, (20e-6, 2e-3)),
    ("reduce_scatter", 4, 1e6, (30e-6, 0.75e-3)),
    ("all_to_all", 4, 1e6, (30e-6, 0.75e-3)),
    ("p2p", 64, 1e6, (10e-6, 1e-3)),
    ("all_reduce", 1, 1e9, (0.0, 0.0)),  # one rank: an identity
])
def test_collective_costs_match_hand_computed_values(kind, n, nbytes, expected):
    assert cost(kind, n, nbytes, LINK) == pytest.approx(expected)


def test_unknown_collective_kind_is_an_error():
    with pytest.raises(ValueError, match="no cost formula"):
        cost("scatter_gather", 4, 1, LINK)


def test_alpha_beta_from_a_ping_pong_sweep():
    one_way = {8: 35e-6, 1024: 20e-6, 1_000_000: 1.02e-3, 2_000_000: 2.02e-3}  # 8 B waited for a core
    alpha, bandwidth = fit_alpha_beta(one_way)
    assert alpha == 20e-6 and bandwidth == pytest.approx(1e9)


def _run(n: int, step_s: float, items: int, busy: list[float], traffic: dict | None = None) -> dict:
    steps = 10
    return {"world_size": n, "summary": {
        "step_time_s": {"median": step_s}, "items": items * steps, "steps": steps,
        "per_rank": [{"busy_s": b * steps, "steps": steps} for b in busy], "traffic": traffic or {}}}


def test_strong_scaling_prediction_by_hand():
    # 1 rank: 100 ms; 2 ranks: 60 ms, of which one 1 MB all-reduce (ring at 2: 2 a + S b = 20 us + 1 ms)
    comm2 = 20e-6 + 1e-3
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.060, 64, [0.050, 0.050],
                                              {"all_reduce": {"calls": 1, "bytes": 1e6}})]
    pred = predict(runs, [4], LINK, scaling="strong")
    # compute = a + b/N through (1, 0.100) and (2, 0.060 - comm2)
    b = 2 * (0.100 - (0.060 - comm2))
    a = 0.100 - b
    row = pred["rows"][0]
    comm4 = 6 * 10e-6 + 1.5 * 1e-3
    assert row["step_time_s"] == pytest.approx(a + b / 4 + comm4)
    assert row["latency_s"] == pytest.approx(60e-6) and row["bandwidth_s"] == pytest.approx(1.5e-3)
    assert row["speedup"] == pytest.approx(0.100 / row["step_time_s"])  # the same 64 items per step
    assert row["efficiency"] == pytest.approx(row["speedup"] / 4)
    assert row["bottleneck"] == "compute" and row["measured_step_time_s"] is None
    assert pred["fit_on"] == [1, 2] and pred["traffic_at"] == 2


def test_a_measured_size_is_left_out_of_the_fit_and_compared():
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.050, 64, [0.050, 0.050]), _run(4, 0.040, 64, [0.03] * 4)]
    row = predict(runs, [4], LINK)["rows"][0]
    assert row["step_time_s"] == pytest.approx(0.025)  # 0.1 / 4: the 4-rank run did not move the fit
    assert row["measured_step_time_s"] == 0.040 and row["error"] == pytest.approx(0.025 / 0.040 - 1)


def test_fit_on_fits_every_measured_size_and_predicts_inside_them():
    """``multigpu plan`` fits on every measured size and asks for any size, a measured one or a smaller one."""
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.050, 64, [0.050, 0.050]), _run(4, 0.040, 64, [0.03] * 4)]
    pred = predict(runs, [2, 4], LINK, fit_on=[1, 2, 4])
    assert pred["fit_on"] == [1, 2, 4]
    assert all(r["error"] is not None for r in pred["rows"])  # every predicted size was also measured
    assert pred["rows"][1]["step_time_s"] != pytest.approx(0.025)  # the 4-rank run moved the fit this time


def test_imbalance_and_bandwidth_bottlenecks_are_named():
    # the slowest of 2 ranks computes 1.5x the mean; an all-reduce of 1 GB dominates the step
    runs = [_run(1, 0.100, 8, [0.100]), _run(2, 0.060 + 1.00002, 8, [0.040, 0.060],
                                            {"all_reduce": {"calls": 1, "bytes": 1e9}})]
    row = predict(runs, [8], LINK)["rows"][0]
    assert row["bottleneck"] == "bandwidth" and row["imbalance_s"] == pytest.approx(row["compute_s"] * 0.2 / 1.0)


def test_items_per_step_growing_with_the_world_size_are_followed():
    # each rank keeps its batch of 16 (a per-rank batch): items per step double from 1 to 2 ranks
    runs = [_run(1, 0.100, 16, [0.100]), _run(2, 0.100, 32, [0.100, 0.100])]
    row = predict(runs, [8], LINK)["rows"][0]
    assert row["throughput"] == pytest.approx(128 / row["step_time_s"]) and row["speedup"] == pytest.approx(8.0)


def test_on_this_host_ranks_beyond_the_cores_share_them():
    link = Link("this host's gloo over loopback", 1e-9, 1e15, "measured")
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.050, 64, [0.050, 0.050])]
    row = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1)["rows"][0]
    assert row["step_time_s"] == pytest.approx(0.025 * 2, rel=1e-3)  # 4 ranks on 2 cores: each at half speed
    # a core busy with other work: 2 ranks compute at 2/3 speed (75 ms for 50), 4 ranks at 2/5 (25 ms -> 62.5)
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.075, 64, [0.075, 0.075])]
    busy = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1, other_work=1.0)["rows"][0]
    assert busy["step_time_s"] == pytest.approx(0.0625, rel=1e-3)
    # ranks that wait in collectives half of their step hold the cores half the time: 4 x 1/2 + 1 = 3 of 2 cores
    runs = [_run(1, 0.100, 64, [0.100]), _run(2, 0.075, 64, [0.0375, 0.0375])]
    half = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1, other_work=1.0)
    assert half["compute_fit"]["held_share"] == pytest.approx(0.5)
    # 2 ranks: (2 x 1/2 + 1) / 2 = no crowding, so a + b x through (64, 0.1) and (32, 0.075): a = 0.05,
    # b = 0.025 / 32; at 4 ranks x = 16, crowded 1.5x
    assert half["rows"][0]["step_time_s"] == pytest.approx((0.05 + 16 * 0.025 / 32) * 1.5, rel=1e-3)
    sampled = [dict(r, cpu={"host_percent": 100.0, "rank_percent": 50.0 * (2 // r["world_size"])}) for r in runs]
    assert busy_cores(sampled, [1, 2], cores=2) == pytest.approx(1.0)  # 2 cores busy, the ranks used 1


def test_flags_and_bad_input():
    assert parse_predict("64, 8,512") == (8, 64, 512)
    for bad in ("1", "x", ""):
        with pytest.raises(ConfigError, match="--predict"):
            parse_predict(bad)
    assert fit_sizes([1, 2, 4], [4, 8]) == (1, 2)
    with pytest.raises(ConfigError, match="needs a measured world size below 2"):
        fit_sizes([2, 4], [2])
    link = resolve_link("ib-ndr", alpha_us=2.0)
    assert link.alpha_s == 2e-6 and link.bandwidth == LINKS["ib-ndr"].bandwidth and link.source == "flags"
    with pytest.raises(ConfigError, match="valid: nvlink4"):
        resolve_link("token-ring")


def test_fsdp_step_traffic_from_the_sharding():
    import torch

    from multigpu.runtime import collectives
    from multigpu.train.strategies import StepTraffic

    blocks = [torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)]  # 110 weights each
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(10, 1))  # the root's own: 11
    plan = StepTraffic(model, blocks, reshard_after_forward=True, param_dtype=torch.bfloat16)
    assert plan.units == [(220, 440, 2), (220, 440, 2), (22, 44, 1)]  # bf16 gathered, fp32 reduced
    before = collectives.traffic()
    plan.record(micro_steps=3)  # gathers on every micro-step, one reduce-scatter per step
    after = collectives.traffic()

    def moved(kind):
        c0, b0 = before.get(kind, (0, 0))
        return after[kind][0] - c0, after[kind][1] - b0

    assert moved("sharded_all_gather") == (2 * 2 * 3 + 3, 2 * 220 * 2 * 3 + 22 * 3)
    assert moved("reduce_scatter") == (3, 440 + 440 + 44)
    # (n-1) a + (n-1)/n S b: 3 x 10 us + 3/4 x 1 ms
    assert cost("sharded_all_gather", 4, 1e6, LINK) == pytest.approx((20e-6, 0.75e-3))


def _cpu_run(n: int, step_s: float, items: int, busy: list[float], cpu: list[float], traffic: dict | None = None):
    """A run whose meter also measured each rank's CPU seconds per step, and its wall time (the mean step)."""
    run = _run(n, step_s, items, busy, traffic)
    summary = run["summary"]
    summary["wall_s"] = step_s * summary["steps"]
    for rank, seconds in zip(summary["per_rank"], cpu, strict=True):
        rank["cpu_s"] = seconds * summary["steps"]
    return run


def test_ranks_beyond_the_cores_take_at_least_the_cpu_they_need_over_the_cores():
    from multigpu.bench.predict import LOOPBACK_NAME

    # a per-rank batch of 64 items. 1 rank: 100 ms computing, 100 ms of CPU. 2 ranks: 100 ms busy + 10 ms in one
    # small all-reduce, 110 ms of CPU: the all-reduce's own CPU is 10 ms, for 2 messages (2 x 1 ms latency)
    traffic = {"all_reduce": {"calls": 1, "bytes": 8}}
    runs = [_cpu_run(1, 0.100, 64, [0.100], [0.100]),
            _cpu_run(2, 0.110, 128, [0.100, 0.100], [0.110, 0.110], traffic)]
    link = Link(LOOPBACK_NAME, 1e-3, 1e15, "measured")
    row = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1)["rows"][0]
    # at 4 ranks a rank waits for 4 messages (tree: 2 log2 4): its collective CPU doubles to 20 ms, so the step is
    # at least 4 ranks x 120 ms of CPU / 2 cores
    assert row["step_time_s"] == pytest.approx(4 * 0.120 / 2)
    # without that bound: the compute fitted through 100 and 110 - 2 ms (per item), crowded by 4 ranks holding
    # their core 100/110 of the step, plus the 4 ms latency
    unbound = 0.104 * (4 * (0.100 / 0.110) / 2) + 0.004
    assert row["cores_s"] == pytest.approx(0.240 - unbound)
    assert row["compute_s"] + row["imbalance_s"] + row["latency_s"] + row["bandwidth_s"] + row["cores_s"] == \
        pytest.approx(row["step_time_s"])
    # the same runs without CPU figures (bench.json files written before they were measured): no such bound
    for run in runs:
        for rank in run["summary"]["per_rank"]:
            del rank["cpu_s"]
    old = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1)["rows"][0]
    assert old["cores_s"] == 0.0 and old["step_time_s"] == pytest.approx(unbound)
    # and never on ranks with a device each (the bound is this host's cores)
    other = predict(runs, [4], LINK, cores=2, cpu_ranks=False)["rows"][0]
    assert other["cores_s"] == 0.0


def test_the_step_is_the_slowest_ranks_mean_pace_not_the_median_of_per_step_maxima():
    # ranks late in turns: each step's slowest rank took 150 ms (the median), yet the job kept 100 ms a step
    runs = [_cpu_run(1, 0.100, 64, [0.100], [0.100]), _cpu_run(2, 0.050, 64, [0.050] * 2, [0.050] * 2),
            _cpu_run(4, 0.040, 64, [0.030] * 4, [0.030] * 4)]
    runs[2]["summary"]["step_time_s"]["median"] = 0.060
    row = predict(runs, [4], LINK)["rows"][0]
    assert row["measured_step_time_s"] == pytest.approx(0.040)  # wall_s / steps, not the 60 ms median


def test_hsdp_step_traffic_runs_over_the_groups_of_its_mesh():
    import torch

    from multigpu.runtime import collectives
    from multigpu.train.strategies import StepTraffic

    blocks = [torch.nn.Linear(10, 10)]
    plan = StepTraffic(torch.nn.Sequential(*blocks), blocks, reshard_after_forward=False, param_dtype=None,
                       shard_size=2)
    before = collectives.traffic()
    plan.record(micro_steps=1)
    after = collectives.traffic()
    moved = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1]) for k in after
             if after[k] != before.get(k)}
    assert moved == {"sharded_all_gather:shard": (1, 440), "reduce_scatter:shard": (1, 440),
                     "all_reduce:replicate": (1, 440)}
    with pytest.raises(ValueError, match="valid: shard, replicate"):
        collectives.record_traffic("all_reduce", 8, group="node")


def _hsdp_run(n: int, step_s: float, shard_size: int, chosen: bool = False) -> dict:
    run = _run(n, step_s, 64, [step_s] * n, {"sharded_all_gather:shard": {"calls": 1, "bytes": 1e6},
                                             "reduce_scatter:shard": {"calls": 1, "bytes": 1e6},
                                             "all_reduce:replicate": {"calls": 1, "bytes": 1e6}} if n > 1 else None)
    run["summary"]["hsdp"] = {"shard_size": shard_size, "set": chosen}
    return run


def test_hsdp_prediction_by_hand_shards_within_a_node_and_all_reduces_across_replicas():
    runs = [_hsdp_run(1, 0.100, 1), _hsdp_run(2, 0.060, 2)]  # 2 ranks on one node: one replica, no all-reduce
    row = predict(runs, [8], LINK, ranks_per_node=4)["rows"][0]
    # 8 ranks = 2 replicas x 4: all-gather over 4 (log2(4) a, 3/4 S b), reduce-scatter over 4 (3 a, 3/4 S b),
    # the 1/4 shard all-reduced over 2 replicas (ring: 2 a, S/4 b)
    assert row["hsdp"] == [2, 4]
    assert row["latency_s"] == pytest.approx(7 * 10e-6) and row["bandwidth_s"] == pytest.approx(1.75e-3)
    # the fit's 2-rank run took its own layout (shards over 2, nothing to all-reduce): a = 0, b = 2 x 0.1 ...
    comm2 = 10e-6 + 0.5e-3 + 10e-6 + 0.5e-3
    b = 2 * (0.100 - (0.060 - comm2))
    assert row["step_time_s"] == pytest.approx(0.100 - b + b / 8 + 7e-5 + 1.75e-3)
    # a chosen hsdp_shard_size stays at every size: 4 replicas of 2 ranks
    runs = [_hsdp_run(1, 0.100, 2, True), _hsdp_run(2, 0.060, 2, True)]  # a 1-rank run keeps the size it was given
    pred = predict(runs, [8], LINK, ranks_per_node=4)
    assert pred["rows"][0]["hsdp"] == [4, 2] and "hsdp_shard_size=2, as the job sets it" in pred["assumptions"][-1]
    # one host (loopback): every rank shards the one replica, as fsdp does
    host = Link("this host's gloo over loopback", 10e-6, 1e9, "measured")
    assert predict([_hsdp_run(1, 0.1, 1), _hsdp_run(2, 0.06, 2)], [4], host)["rows"][0]["hsdp"] == [1, 4]
    # a GPU interconnect without --ranks-per-node: nodes of 8
    assert predict([_hsdp_run(1, 0.1, 1), _hsdp_run(2, 0.06, 2)], [64], LINK)["rows"][0]["hsdp"] == [8, 8]
    with pytest.raises(ConfigError, match=r"--predict 12: an hsdp replica is sharded over 8 ranks .* valid: world "
                                          r"sizes that are multiples of 8"):
        predict([_hsdp_run(1, 0.1, 1), _hsdp_run(2, 0.06, 2)], [12], LINK)


def test_collectives_within_a_node_run_on_its_link_and_across_nodes_on_the_network():
    node = Link("node", 1e-6, 100e9)  # 1 us, 100 GB/s: a byte costs 0.01 ns
    runs = [_hsdp_run(1, 0.100, 1), _hsdp_run(2, 0.060, 2)]
    # 16 ranks = 2 replicas x 8 (nodes of 8): the replica's all-gather and reduce-scatter within a node (node link),
    # the 1/8 gradient shard all-reduced across the 2 replicas, which span the nodes (LINK: 10 us, 1 GB/s)
    pred = predict(runs, [16], LINK, ranks_per_node=8, node_link=node)
    row = pred["rows"][0]
    within = (3 * 1e-6 + 7 * 1e-6, 2 * 7 / 8 * 1e6 * 1e-11)  # log2(8) a + (n-1) a; (n-1)/n S b twice
    across = (2 * 10e-6, 1e6 / 8 * 1e-9)  # ring over 2: 2 a, 2 (1/2) s b with s = S/8
    assert row["latency_s"] == pytest.approx(within[0] + across[0])
    assert row["bandwidth_s"] == pytest.approx(within[1] + across[1])
    assert "nodes of 8 ranks: a collective among the ranks of one node runs on node" in " ".join(pred["assumptions"])
    # a plain (ddp) job: its all-reduce within a node at 8 ranks, across nodes at 16
    flat = [_run(1, 0.1, 64, [0.1]), _run(2, 0.06, 64, [0.05] * 2, {"all_reduce": {"calls": 1, "bytes": 1e6}})]
    rows = predict(flat, [8, 16], LINK, ranks_per_node=8, node_link=node)["rows"]
    assert rows[0]["bandwidth_s"] == pytest.approx(2 * 7 / 8 * 1e6 * 1e-11)
    assert rows[1]["bandwidth_s"] == pytest.approx(2 * 15 / 16 * 1e6 * 1e-9)
    # without a node link every collective is on the one link, as before
    assert predict(runs, [16], LINK, ranks_per_node=8)["rows"][0]["latency_s"] == pytest.approx((3 + 7 + 2) * 10e-6)


def test_collectives_the_busy_time_holds_untimed_count_as_the_collectives_cpu():
    """FSDP's all-gathers and reduce-scatters run inside autograd, untimed: a rank's busy time is its whole step. The
    CPU that grew from 1 to 2 ranks is then the collectives' (the per-rank work is the same), not computing's."""
    from multigpu.bench.predict import LOOPBACK_NAME

    # 1 rank: 100 ms computing and CPU; 2 ranks: 110 ms busy (one 8-byte reduce-scatter inside it), 110 ms of CPU
    runs = [_cpu_run(1, 0.100, 64, [0.100], [0.100]),
            _cpu_run(2, 0.110, 128, [0.110, 0.110], [0.110, 0.110], {"reduce_scatter": {"calls": 1, "bytes": 8}})]
    link = Link(LOOPBACK_NAME, 1e-3, 1e15, "measured")
    row = predict(runs, [4], link, cores=2, cpu_ranks=True, threads=1)["rows"][0]
    # the reduce-scatter's 10 ms of CPU for 1 message at 2 ranks grows to 3 messages at 4 (ring: n - 1): each rank
    # needs 100 + 30 ms of CPU, and 4 of them on 2 cores take at least 260 ms
    assert row["step_time_s"] == pytest.approx(4 * 0.130 / 2)
    # over the step without that bound: compute fitted through 100 and 110 - 1 ms, doubled by 4 ranks on 2 cores,
    # plus 3 ms of latency
    assert row["cores_s"] == pytest.approx(0.260 - (0.1045 * 2 + 0.003))
    # the same step with a timed collective (an all-reduce, outside the busy time) keeps the busy-time account:
    # 110 ms busy x 1 CPU second per busy second leaves the all-reduce no CPU of its own
    timed = [_cpu_run(1, 0.100, 64, [0.100], [0.100]),
             _cpu_run(2, 0.110, 128, [0.110, 0.110], [0.110, 0.110], {"all_reduce": {"calls": 1, "bytes": 8}})]
    assert predict(timed, [4], link, cores=2, cpu_ranks=True, threads=1)["rows"][0]["cores_s"] == 0.0
