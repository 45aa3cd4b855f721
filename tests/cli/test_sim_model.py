"""A model defined in this test file runs through ``multigpu sim --model`` with the same agents on 1, 2 and 3 ranks.

``MODEL`` uses every kind of field a user's model can read (a per-cell count,
a global sum, a float field of the agent's own) and the built-in movement
substep. ``--check-split`` compares 1 and 2 ranks (every strategy) agent by
agent; a 3-rank run's final-state digest must equal a one-process run's.
``RANK_MODEL`` breaks the rules (its random numbers depend on the rank), and
``--check-split`` must say so, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.sim import Model, Substep
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import spawn_on_grid
from multigpu.sim.rng import threshold
from tests.conftest import ROOT, assert_bad_input, run_cli

SPEC = "tests.cli.test_sim_model:MODEL"


@dataclass(frozen=True, kw_only=True)
class RumourParams:
    move_prob: float = 0.6
    """Read by the built-in movement substep."""
    q: float = 0.2
    """Chance that one informed agent in the cell tells an uninformed one, per step."""
    seeded: float = 0.05
    """Share informed at step 0."""
    cost: float = 0.01
    """Energy an informed agent spends per step, scaled by the informed share."""


def _init(ctx, ids):
    agents = spawn_on_grid(ids, ctx.seed, ctx.grid)
    agents["informed"] = ctx.bernoulli(ids, ctx.params.seeded, "seed").to(torch.uint8)
    agents["energy"] = 1.0 + ctx.uniform(ids, "energy")
    return agents


def _count(ctx, agents, acc):
    cell = ctx.cell(agents)
    cells = acc.numel() - 1
    keep = (agents["informed"] == 1) & (cell >= 0) & (cell < cells)
    acc.index_add_(0, cell[keep], torch.ones(int(keep.sum()), dtype=acc.dtype))


def _thresholds(ctx, counts):
    table = torch.tensor([threshold(1 - (1 - ctx.params.q) ** k) for k in range(65)], dtype=torch.int32)
    return table[counts.reshape(-1).clamp(max=64).to(torch.int64)]


def _spread(ctx, agents, thr):
    told = ctx.bernoulli(agents["id"], thr[ctx.cell(agents)], "tell")
    agents["informed"] |= told.to(torch.uint8)
    return agents["informed"].sum(dtype=torch.int64).reshape(1)


def _total(ctx, agents, acc):
    acc += torch.stack([agents["informed"].sum(dtype=torch.int64)])


def _share(ctx, total):
    ctx.env["series"] = {"share": int(total[0]) / ctx.num_agents}
    return int(total[0]) / ctx.num_agents


def _spend(ctx, agents, share):
    agents["energy"] -= agents["informed"].to(torch.float32) * (ctx.params.cost * share)


MODEL = Model(
    name="rumour",
    fields={"id": torch.int32, "x": torch.int16, "y": torch.int16, "informed": torch.uint8, "energy": torch.float32},
    params=RumourParams,
    init=_init,
    substeps=[
        "movement",
        Substep("spread", needs=("id", "x", "y", "informed"), apply=_spread, field="cell", contribute=_count,
                prepare=_thresholds, series=["informed"]),
        Substep("spend", needs=("informed", "energy"), apply=_spend, field="global", field_size=1,
                contribute=_total, prepare=_share, globals=["share"]),
    ],
)


def _rank_dependent(ctx, agents, _):
    import multigpu as mg

    # WRONG on purpose: a decision that depends on the rank, not only on the agent
    agents["informed"] |= (ctx.bernoulli(agents["id"], 0.1, "x") & (mg.rank() == 1)).to(torch.uint8)


RANK_MODEL = Model(name="rank-dependent", fields=MODEL.fields, params=RumourParams, init=_init,
                   substeps=["movement", Substep("oops", apply=_rank_dependent)])


def _bit_init(ctx, ids):
    return {"id": ids, "bit": ctx.bernoulli(ids, 0.5, "init").to(torch.uint8)}


def _ones(ctx, agents, acc):
    acc += agents["bit"].sum(dtype=torch.int64).reshape(1)


def _count_ones(ctx, agents, total):
    # WRONG on purpose: ``total`` is the global count every rank holds; returned as a series it is summed again
    return total.reshape(1)


GLOBAL_AS_SERIES = Model(name="global-as-series", fields={"id": torch.int32, "bit": torch.uint8}, init=_bit_init,
                         substeps=[Substep("count", apply=_count_ones, field="global", field_size=1,
                                           contribute=_ones, series=["ones"])])


def make_model() -> Model:
    """A factory works as well as the object: ``--model tests.cli.test_sim_model:make_model``."""
    return MODEL


NOT_A_MODEL = 42


def test_the_model_runs_in_process_and_every_strategy_agrees():
    cfg = SimConfig(model=SPEC, agents=3000, grid=(20, 18), steps=6, chunk_size=1024, params={"q": 0.3})
    assert cfg.params == {"move_prob": 0.6, "q": 0.3, "seeded": 0.05, "cost": 0.01}
    ref = SimEngine(cfg)
    series = ref.run()
    assert list(series) == ["step", "moved", "informed", "share"] and series["informed"][-1] > series["informed"][0]
    for strategy in ("spatial", "adaptive"):
        engine = SimEngine(dataclasses.replace(cfg, strategy=strategy, rebalance_every=2))
        assert engine.run() == series
        a, b = engine.state.sorted_by_id(), ref.state.sorted_by_id()
        assert all(torch.equal(a[k], b[k]) for k in a), strategy
    assert SimConfig(model="tests.cli.test_sim_model:make_model").model.endswith("make_model")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "tests.cli.test_sim_model:NOT_A_MODEL"], "is of type int; valid: a multigpu.sim.Model"),
        (["--model", "tests.cli.no_such_module:MODEL"], "module 'tests.cli.no_such_module' does not import"),
        (["--model", "tests.cli.test_sim_model:MODLE"], "has no 'MODLE'"),
        (["--model", SPEC, "params.qq=0.1"], "Did you mean 'sim.params.q'"),
        (["--model", SPEC, "substeps=[movement,sir]"], "needs agent fields ['state']"),
        (["--model", "sri"], "valid: market, movement, network_sir, sir, or pkg.module:MODEL"),
    ],
)
def test_bad_model_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    assert_bad_input(["sim", *args, "--run-dir", str(tmp_path / "run")], message, capsys, tmp_path / "run")


def test_a_model_that_breaks_the_contract_is_refused_when_defined():
    for kwargs, message in [
        (dict(fields={"x": torch.int16}), "needs an 'id' field"),
        (dict(fields={"id": torch.int32, "x": torch.int16, "y": torch.int32}), "fields 'x' and 'y' of dtype torch.int16"),
        (dict(fields={"id": torch.int32, "w": torch.complex64}), "field 'w'"),
        (dict(substeps=[]), "needs a list of substeps"),
        (dict(substeps=["movment"]), "unknown substep 'movment'"),
        (dict(substeps=["movement", "movement"]), "substep names repeat"),
        (dict(params=dict), "params must be a dataclass"),
        (dict(init=None), "has no init function"),
    ]:
        base = dict(name="m", fields=MODEL.fields, substeps=["movement"], params=RumourParams, init=_init)
        with pytest.raises(ConfigError, match=None) as err:
            Model(**{**base, **kwargs})
        assert message in str(err.value), (kwargs, str(err.value))
    with pytest.raises(ConfigError, match="reads a cell field but has no contribute"):
        Substep("s", apply=_spread, field="cell")
    with pytest.raises(ConfigError, match="has no apply function"):
        Substep("s")
    bad_init = Model(name="rumour-bad-init", fields=MODEL.fields, substeps=["movement"], params=RumourParams,
                     init=lambda ctx, ids: {**_init(ctx, ids), "energy": torch.zeros(ids.shape[0], dtype=torch.float64)})
    from multigpu.sim import MODELS, register_model

    try:
        register_model(bad_init)
        with pytest.raises(ValueError, match=r"field 'energy' is torch.float64 \(10,\); want torch.float32"):
            SimEngine(SimConfig(model="rumour-bad-init", agents=10, grid=(4, 4)))
    finally:
        MODELS.pop("rumour-bad-init", None)  # the registry is global: leave it as the other tests expect


@pytest.mark.e2e
def test_check_split_passes_and_three_ranks_give_one_process_agents(tmp_path):
    check = run_cli("sim", "--model", SPEC, "--check-split", "--run-dir", str(tmp_path / "check"), timeout=240)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "check-split passed" in check.stdout and "data, spatial, adaptive" in check.stdout

    three = run_cli("sim", "--model", SPEC, "--agents", "5000", "--steps", "7", "--nproc-per-node", "3",
                    "--strategy", "adaptive", "--run-dir", str(tmp_path / "three"),
                    "grid=[30,20]", "plot=false", "params.q=0.3", "rebalance_every=2", timeout=240)
    assert three.returncode == 0, three.stderr[-3000:]
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    engine = SimEngine(SimConfig(model=SPEC, agents=5000, steps=7, grid=(30, 20), params={"q": 0.3}))
    series = engine.run()
    assert summary["state_digest"] == f"{engine.state.digest_sum() & (2**64 - 1):016x}-5000"
    lines = (tmp_path / "three" / "series.csv").read_text().splitlines()
    assert lines[0] == ",".join(series) and lines[-1] == ",".join(str(v[-1]) for v in series.values())


@pytest.mark.e2e
@pytest.mark.slow
def test_check_split_names_the_field_of_a_model_that_depends_on_the_rank(tmp_path):
    proc = run_cli("sim", "--model", "tests.cli.test_sim_model:RANK_MODEL", "--check-split",
                   "--run-dir", str(tmp_path / "check"), timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: check-split failed") and "field 'informed' differs" in last, last
    assert "after substep 'oops' of step 1" in last, last  # the first substep and step where it differs


@pytest.mark.e2e
def test_check_split_says_a_global_count_returned_as_a_series_is_counted_per_chunk_and_rank(tmp_path):
    # 3000 agents in chunks of 1024: apply runs 3 times on 1 rank, 2 + 2 times on 2 ranks (4000 would hide it: 4 and 4)
    proc = run_cli("sim", "--model", "tests.cli.test_sim_model:GLOBAL_AS_SERIES", "--check-split", "--agents", "3000",
                   "--run-dir", str(tmp_path / "check"), timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert ("data strategy on 2 rank(s) vs data on 1: the series 'ones' (substep 'count') is 1.33333x the 1-rank "
            "series on 2 ranks at every step") in last, last
    assert "named in globals=, not returned as a series" in last, last


def test_sim_help_lists_every_built_in_model_and_where_a_relative_agents_file_goes(capsys):
    from multigpu.cli import main

    with pytest.raises(SystemExit) as done:
        main(["sim", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "movement | sir | network_sir | market, or your model" in text, text
    assert "(a relative path is inside the run directory)" in text, text


@pytest.mark.e2e
def test_calibrating_against_a_flat_target_says_no_fit_instead_of_a_fit(tmp_path):
    """The README's old recipe fitted 0.032 to a target whose epidemic never started; now: no fit, and why
    (the run itself did not fail: exit 0, and calibration.json says "fitted": false)."""
    flat = tmp_path / "flat.csv"
    flat.write_text("step,moved,informed,forgot\n" + "".join(f"{s},250,3,0\n" for s in range(1, 6)))
    proc = run_cli("sim", "--model", "examples.sim_rumour:MODEL", "--agents", "500", "--steps", "5", "grid=[8,8]",
                   "--calibrate", str(flat), "--run-dir", str(tmp_path / "fit"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "calibrate: no fit: the target series vary by less than 1% of the 500 agents (moved by 0, informed by 0, "
        "forgot by 0): too little signal to learn from"), proc.stdout[-2000:]
    assert json.loads((tmp_path / "fit" / "calibration.json").read_text())["fitted"] is False
    assert "calibrated in" not in proc.stdout


@pytest.mark.e2e
def test_check_split_checks_at_the_users_agents_and_steps_and_says_so(tmp_path):
    """--check-split ran at 4,000 agents and 10 steps whatever --agents and --steps said (a modeller's 6,000 and 12
    were silently not what it checked). It checks at the sizes given, and its lines say which it used and why;
    without them, the check's own small sizes, said as such."""
    proc = run_cli("sim", "--model", SPEC, "--check-split", "--agents", "6000", "--steps", "12",
                   "--run-dir", str(tmp_path / "given"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check-split: at 6,000 agents and 12 steps (your --agents and --steps)" in proc.stderr, proc.stderr
    assert "check-split passed: model tests.cli.test_sim_model:MODEL, 6,000 agents, 12 steps" in proc.stdout
    assert "4,000" not in proc.stderr + proc.stdout
    from multigpu.sim.config import SimConfig
    from multigpu.sim.splitcheck import check_sizes

    assert check_sizes(SimConfig(model=SPEC))[:2] == (4000, 10)  # no sizes given: the check's own
    assert "the check's own sizes" in check_sizes(SimConfig(model=SPEC))[2]
    agents, steps, note = check_sizes(SimConfig(model=SPEC, agents=50_000_000, steps=365))
    assert (agents, steps) == (100_000, 20) and "at most 100,000 agents and 20 steps" in note, note
