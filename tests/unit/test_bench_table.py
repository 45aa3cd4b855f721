"""The scaling table and its verdicts (pure): they must name the measured cause when more ranks do not pay."""

from __future__ import annotations

import pytest

from multigpu.bench import BenchConfig, parse_nproc, resolve_target
from multigpu.bench.table import doubts, explain, scaling_rows
from multigpu.errors import ConfigError


def _run(world_size: int, throughput: float, *, comm: float = 0.0, imbalance: float = 1.0,
         busy_per_item: float = 0.001, step: float = 0.1, cpu: dict | None = None) -> dict:
    items_per_rank = 1000
    busy = busy_per_item * items_per_rank
    per_rank = [{"wall_s": 1.0, "comm_s": comm, "busy_s": busy, "items": items_per_rank, "steps": 10}
                for _ in range(world_size)]
    return {"world_size": world_size, "cpu": cpu, "summary": {
        "world_size": world_size, "throughput": throughput, "comm_share": comm, "imbalance": imbalance,
        "step_time_s": {"median": step, "min": step, "max": step}, "per_rank": per_rank, "unit": "samples"}}


def test_rows_take_min_and_median_over_repeats_and_derive_speedup_and_efficiency():
    rows = scaling_rows([_run(1, 100), _run(1, 120), _run(1, 110), _run(2, 150), _run(2, 210), _run(2, 180)])
    assert [r["world_size"] for r in rows] == [1, 2]
    one, two = rows
    assert (one["repeats"], one["throughput_min"], one["throughput_median"]) == (3, 100, 110)
    assert (two["throughput_min"], two["throughput_median"]) == (150, 180)
    assert two["speedup"] == pytest.approx(180 / 110) and two["ideal"] == 2
    assert two["efficiency"] == pytest.approx(180 / 110 / 2)


def test_slower_with_more_ranks_says_so_and_names_communication():
    rows = scaling_rows([_run(1, 1000), _run(2, 620, comm=0.61)])
    notes = explain(rows)
    assert len(notes) == 1 and notes[0].startswith("SLOWER: 2 ranks ran slower than 1 rank (0.62x")
    assert "communication is 61% of step time at 2 ranks (0% at 1 rank; time inside collectives" in notes[0]


def test_causes_are_ordered_by_size_imbalance_and_contention_included():
    rows = scaling_rows([_run(1, 1000), _run(2, 900, comm=0.25, imbalance=1.9, busy_per_item=0.0015)])
    note = explain(rows, cores=2)[0]
    assert note.startswith("SLOWER") and "slowest rank computed 1.90x" in note
    assert note.index("imbalance") < note.index("1.50x as much compute time") < note.index("communication is 25%")
    assert "this machine has 2 cores" in note


def test_poor_but_positive_scaling_is_explained_and_good_scaling_is_not_blamed():
    poor = explain(scaling_rows([_run(1, 1000), _run(4, 1500, comm=0.4)]))[0]
    assert poor.startswith("4 ranks: 1.50x speedup of an ideal 4x (38% efficiency)") and "communication is 40%" in poor
    good = explain(scaling_rows([_run(1, 1000), _run(2, 1900)]))[0]
    assert good == "2 ranks: 1.90x speedup (95% efficiency)."
    unexplained = explain(scaling_rows([_run(1, 1000), _run(2, 800)]))[0]
    assert unexplained.startswith("SLOWER") and "no single cause stands out" in unexplained


def test_faster_than_ideal_and_a_saturated_machine_are_called_out():
    busy = {"host_percent": 99.0, "rank_percent": 45.0}  # 45% of a core while computing all the time
    rows = scaling_rows([_run(1, 1000, busy_per_item=0.004, cpu=busy), _run(2, 4000, busy_per_item=0.001, cpu=busy)])
    notes = explain(rows)
    assert "faster than the ideal 2x" in notes[0] and "0.25x the compute time" in notes[0]
    assert notes[-1].startswith("CAUTION: ranks got less CPU than their work needed")
    assert "1 rank: 45% of a core per rank, host 99%" in notes[-1]
    assert not any(n.startswith("CAUTION") for n in explain(rows, cpu_ranks=False))  # GPU ranks: CPU use says little
    waiting = {"host_percent": 60.0, "rank_percent": 30.0}  # low, but half the time is spent waiting in collectives
    assert not any(n.startswith("CAUTION") for n in explain(scaling_rows([_run(1, 1000, cpu=waiting | {"rank_percent": 90.0}), _run(2, 1500, comm=0.6, cpu=waiting)])))
    assert explain(scaling_rows([_run(1, 1000)])) == []
    # 4 ranks on 2 cores: 46% of a core each is most of their 50% share: their own crowding, not other processes
    crowded = {"host_percent": 88.0, "rank_percent": 46.0}
    rows = scaling_rows([_run(1, 1000, cpu={"host_percent": 50.0, "rank_percent": 99.0}), _run(4, 2000, cpu=crowded)])
    assert not any(n.startswith("CAUTION") for n in explain(rows, cores=2))
    assert explain(rows, cores=8)[-1].startswith("CAUTION")  # on 8 cores each rank should have had a whole one


def test_nproc_and_bench_config_reject_bad_input_with_the_valid_form():
    assert parse_nproc("4, 1,2") == (1, 2, 4)
    for bad, words in [("1,x", "world sizes such as"), ("0,2", ">= 1"), ("1,1", "twice"), ("", "world sizes")]:
        with pytest.raises(ConfigError, match=words):
            parse_nproc(bad)
    with pytest.raises(ConfigError, match="valid: strong, weak"):
        BenchConfig(scaling="medium")
    with pytest.raises(ConfigError, match="repeat"):
        BenchConfig(repeat=0)


def test_workload_names_resolve_through_the_registry_and_unknown_ones_list_what_exists(tmp_path):
    t = resolve_target("train", ["steps=3"])
    assert (t.target, t.workload, t.name, t.args) == ("train", True, "train", ["steps=3"])
    custom = resolve_target("mypkg.count:WORKLOAD", ["n=5"])
    assert custom.workload and custom.name is None and custom.args == ["n=5"]
    with pytest.raises(ConfigError, match="script 'nope.py' does not exist"):
        resolve_target("nope.py", [])
    with pytest.raises(ConfigError, match=r"unknown workload 'tain'; built-in workloads: envs \(.*\), infer"):
        resolve_target("tain", [])
    script = tmp_path / "job.py"
    script.write_text("")
    assert resolve_target(str(script), ["a"]).args == ["a"] and not resolve_target(str(script), []).module


def _noisy_run(n, tput, **summary):
    run = _run(n, tput)
    run["summary"].update(summary)
    return run


def test_a_measurement_that_cannot_be_trusted_is_called_noisy_instead_of_a_speedup():
    """The demo once reported a super-linear 2.26x because the 1-rank run fell from 150k to 25k samples/s midway."""
    from multigpu.bench.table import doubts

    falling = _noisy_run(1, 1000, quarters=[150_000.0, 140_000.0, 30_000.0, 25_000.0], steps=40)
    assert doubts(falling)[0].startswith("its rate moved 6.0x during the run (150,000, 140,000, 30,000, 25,000")
    short = _noisy_run(2, 2000, steps=2)
    assert doubts(short) == ["only 2 measured step(s) after warm-up"]
    busy = {**_run(1, 1000), "cpu": {"host_percent": 100.0, "rank_percent": 50.0}}
    assert doubts(busy, cores=2) == ["the host was busy: 1.5 core(s) of other work beside the job"]
    assert doubts(_noisy_run(1, 1000, quarters=[100.0, 120.0, 90.0, 110.0], steps=40), cores=2) == []

    runs = [falling, _run(2, 4520)]
    for run in runs:
        run["doubts"] = doubts(run)
    notes = explain(scaling_rows(runs))
    assert len(notes) == 1 and notes[0].startswith("NOISY: 2 ranks vs 1 rank (4.52x measured) cannot be trusted: "
                                                   "1 rank: its rate moved 6.0x")
    assert "Rerun with --repeat 3" in notes[0] and "faster than the ideal" not in notes[0]


def _wall_run(world_size: int, seconds: float, *, rank_s: list[float] | None = None, skew: float = 0.0) -> dict:
    """What bench.runner.wall_summary makes of a script without a StepMeter."""
    rank_s = rank_s or [seconds] * world_size
    per_rank = [{"wall_s": s, "comm_s": None, "busy_s": None, "items": 1 / world_size, "steps": 1} for s in rank_s]
    summary = {"unit": "runs", "measure": "wall", "world_size": world_size, "steps": 1, "wall_s": seconds,
               "throughput": 1 / seconds, "step_time_s": {"median": seconds, "min": seconds, "max": seconds},
               "comm_share": None, "imbalance": None, "start_skew_s": skew, "per_rank": per_rank}
    run = {"world_size": world_size, "cpu": {"host_percent": 50.0, "rank_percent": 20.0}, "summary": summary}
    return run | {"doubts": doubts(run)}


def test_a_wall_clock_run_claims_no_communication_imbalance_or_starvation():
    rows = scaling_rows([_wall_run(1, 2.0), _wall_run(2, 1.2)])
    assert [(r["comm_share"], r["imbalance"], r["compute_per_item_s"]) for r in rows] == [(None, None, None)] * 2
    notes = explain(rows)
    assert notes == ["2 ranks: 1.67x speedup (83% efficiency)."]  # no CAUTION from CPU use judged against a guess
    assert explain(scaling_rows([_wall_run(1, 2.0), _wall_run(2, 4.0)]))[0].endswith(
        "no single cause stands out in the measurements: fixed per-step or start-up overheads dominate; "
        "try more steps or a larger problem.")


def test_a_meter_that_did_not_measure_communication_leaves_it_unmeasured_in_the_row():
    unmeasured = _run(2, 900, comm=0.5)
    unmeasured["summary"]["comm_share"] = None
    rows = scaling_rows([_run(1, 1000), _run(2, 950, comm=0.4), unmeasured])
    assert rows[1]["comm_share"] is None and rows[1]["imbalance"] == 1.0
    assert "communication" not in explain(rows)[0]


def test_wall_clock_timing_that_moved_between_sizes_repeats_or_ranks_is_noisy_with_its_reason():
    seen = explain(scaling_rows([_wall_run(1, 19.6), _wall_run(2, 0.9)]))[0]  # a reported 1 rank vs 2 ranks
    assert seen.startswith("NOISY: 2 ranks vs 1 rank (21.78x measured) cannot be trusted")
    assert "2 ranks ran 21.8x faster than 1 rank by the wall clock, beyond 2x the ideal" in seen
    repeats = explain(scaling_rows([_wall_run(1, 2.0), _wall_run(1, 6.0), _wall_run(2, 1.1), _wall_run(2, 1.0)]))[0]
    assert repeats.startswith("NOISY") and "1 rank: its rate moved 3.0x between repeats (0.5, 0.167)" in repeats
    ranks = explain(scaling_rows([_wall_run(1, 2.0), _wall_run(2, 5.0, rank_s=[5.0, 1.5])]))[0]
    assert ranks.startswith("NOISY") and "its ranks' run times ranged from 1.50 s to 5.00 s" in ranks
    skewed = explain(scaling_rows([_wall_run(1, 2.0), _wall_run(2, 3.0, skew=2.0)]))[0]
    assert skewed.startswith("NOISY") and "its ranks started 2.00 s apart, in a 3.00 s run" in skewed
    steady = explain(scaling_rows([_wall_run(1, 2.0), _wall_run(1, 2.2), _wall_run(2, 1.1), _wall_run(2, 1.2)]))[0]
    assert not steady.startswith("NOISY")


def test_faster_than_ideal_on_cpu_ranks_is_noisy_and_no_prediction_is_fitted_on_it():
    """2.82x on 2 ranks of 2 cores was reported as a speedup (141% efficiency): N processes sharing one host's
    cores cannot do more than N times one's work unless the one was held back. On GPUs it stays explained."""
    from multigpu.bench.table import distrust

    rows = scaling_rows([_run(1, 1000, busy_per_item=0.004), _run(2, 2820, busy_per_item=0.0014)])
    cpu = explain(rows, cores=2)
    assert len(cpu) == 1 and cpu[0].startswith("NOISY: 2 ranks: 2.82x speedup, faster than the ideal 2x")
    assert "a measurement problem until shown otherwise" in cpu[0] and "Rerun with --repeat 3" in cpu[0]
    gpu = explain(rows, cores=2, cpu_ranks=False)
    assert gpu[0].startswith("2 ranks: 2.82x speedup, faster than the ideal 2x") and "NOISY" not in gpu[0]
    assert distrust(rows, (1, 2), cpu_ranks=True) == [
        "2 ranks: 2.82x on 2 ranks of CPU ranks, beyond the ideal 2x: a measurement problem until shown otherwise"]
    assert distrust(rows, (1, 2), cpu_ranks=False) == []
    assert distrust(rows, (1,), cpu_ranks=True) == []  # a prediction fitted on 1 rank alone does not use it
    rows[0]["doubts"] = ["the host was busy: 1.5 core(s) of other work beside the job"]
    assert distrust(rows, (1,), cpu_ranks=False) == ["1 rank: the host was busy: 1.5 core(s) of other work beside the job"]
