"""Ensembles, the pure parts: sweep parsing, the design, replicate seeds, the rounds of --until-ci, the bands.

These pin the contracts the multi-rank tests build on: a replicate's seed is a function of (seed, point,
replicate) alone; the bands are Student's t intervals of the mean (checked against published quantiles and
numpy); the rounds stop as soon as every band is narrow enough and never pass --replicates.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from multigpu.errors import ConfigError
from multigpu.sim.bands import Running, point_bands, t_quantile
from multigpu.sim.design import (
    CI,
    EnsembleConfig,
    design_points,
    next_counts,
    parse_sweep,
    parse_until_ci,
    read_sweep_file,
    replicate_seed,
)


def test_sweep_values_lists_ranges_and_grid_order():
    sweep = parse_sweep(["beta=0.02,0.05", "gamma=0.1:0.3:3", "network.kind=households,random"])
    assert sweep == {"beta": [0.02, 0.05], "gamma": [0.1, 0.2, 0.3], "network.kind": ["households", "random"]}
    assert parse_sweep({"agents": [1000, 2000]}) == {"agents": [1000, 2000]}
    points = design_points(sweep, param_names=["beta", "gamma"], sim_keys=["agents", "network"])
    assert len(points) == 12 and [p.index for p in points] == list(range(12))
    assert points[0].overrides == {"params.beta": 0.02, "params.gamma": 0.1, "network.kind": "households"}
    assert points[1].values == {"beta": 0.02, "gamma": 0.1, "network.kind": "random"}  # the last name varies fastest
    assert points[0].label == "beta=0.02, gamma=0.1, network.kind=households"


def test_sweep_file_rows_times_the_grid(tmp_path):
    (tmp_path / "d.csv").write_text("beta,gamma\n0.02,0.1\n0.05,0.2\n")
    (tmp_path / "d.yaml").write_text("- {beta: 0.02, gamma: 0.1}\n- {beta: 0.05, gamma: 0.2}\n")
    rows = read_sweep_file(tmp_path / "d.csv")
    assert rows == read_sweep_file(tmp_path / "d.yaml") == [{"beta": 0.02, "gamma": 0.1}, {"beta": 0.05, "gamma": 0.2}]
    points = design_points({"agents": [10, 20]}, rows, param_names=["beta", "gamma"], sim_keys=["agents"])
    assert [p.values for p in points][:2] == [{"beta": 0.02, "gamma": 0.1, "agents": 10},
                                              {"beta": 0.02, "gamma": 0.1, "agents": 20}]


@pytest.mark.parametrize("items, message", [
    (["beta"], "--sweep 'beta' is invalid; valid: NAME=v1,v2"),
    (["beta="], "--sweep beta= has no values"),
    (["beta=1:2:1"], "valid: start:stop:count"),
    (["beta=0.1", "beta=0.2"], "--sweep beta is given twice"),
])
def test_bad_sweeps_are_one_line(items, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_sweep(items)


def test_swept_names_must_be_parameters_or_keys(tmp_path):
    with pytest.raises(ConfigError, match="seed cannot be swept"):
        design_points({"seed": [1, 2]}, param_names=["beta"], sim_keys=["seed"])
    with pytest.raises(ConfigError, match="bta: not a parameter of the model nor a simulation key; valid: beta"):
        design_points({"bta": [1, 2]}, param_names=["beta"], sim_keys=["agents"])
    (tmp_path / "bad.csv").write_text("beta,gamma\n0.1\n")
    with pytest.raises(ConfigError, match="every row needs one value per column"):
        read_sweep_file(tmp_path / "bad.csv")


def test_replicate_seeds_depend_on_seed_point_and_replicate_only():
    seeds = {replicate_seed(7, p, r) for p in range(20) for r in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**62 for s in seeds)
    assert replicate_seed(7, 3, 4) == replicate_seed(7, 3, 4) != replicate_seed(8, 3, 4)
    assert replicate_seed(7, 3, 4) != replicate_seed(7, 4, 3)
    assert replicate_seed(0, 0, 0) == 2636873280468538045  # pinned: a changed rule would silently change results


def test_until_ci_syntax():
    assert parse_until_ci("95:0.01") == CI(0.95, 0.01) and parse_until_ci("99.5%:0.2") == CI(0.995, 0.2)
    for bad in ("95", "95:0", "95:1.5", "100:0.1", "x:y", "0.95:0.01"):
        with pytest.raises(ConfigError, match="until_ci .* is invalid; valid: LEVEL:WIDTH"):
            parse_until_ci(bad)
    with pytest.raises(ConfigError, match="needs --replicates N"):
        EnsembleConfig(until_ci="95:0.01")


def test_rounds_grow_with_the_widest_band_and_stop_at_the_cap():
    ci = CI(0.95, 0.01)
    assert next_counts([0, 0], [None, None], ci, most=100, first=10) == [10, 10]
    # a band 3x too wide: about 9x the replicates (plus a tenth), at most 4x per round and the cap
    assert next_counts([10, 10], [3.0, 0.5], ci, most=100, first=10) == [40, 10]
    assert next_counts([40], [1.2], ci, most=100, first=10) == [64]
    assert next_counts([90], [5.0], ci, most=100, first=10) == [100]
    assert next_counts([100], [5.0], ci, most=100, first=10) == [100]
    assert next_counts([3, 0], [None, None], None, most=5, first=10) == [5, 5]  # no rule: every replicate


def test_t_quantiles_match_published_values():
    published = {(0.975, 1): 12.706204736174698, (0.975, 4): 2.7764451051977934, (0.975, 9): 2.2621571627409915,
                 (0.995, 29): 2.7563859036706113, (0.95, 99): 1.6603911559963895}
    for (q, df), want in published.items():
        assert math.isclose(t_quantile(q, df), want, rel_tol=1e-9), (q, df)


def test_running_bands_equal_numpy_and_are_t_intervals():
    rng = np.random.default_rng(0)
    reps = [rng.poisson(100, size=(7, 3)).astype(float) for _ in range(12)]
    run = Running()
    for v in reps:
        run.add(v)
    b = run.bands(0.95)
    data = np.stack(reps)
    assert np.allclose(b.mean, data.mean(0), rtol=1e-14) and np.allclose(b.sd, data.std(0, ddof=1), rtol=1e-12)
    half = t_quantile(0.975, 11) * data.std(0, ddof=1) / math.sqrt(12)
    assert np.allclose(b.high - b.mean, half) and np.allclose(b.mean - b.low, half)
    full = point_bands(reps, 0.95, (0.05, 0.95))
    assert np.array_equal(full.mean, data.mean(0)) and np.allclose(full.median, np.median(data, 0))
    assert np.allclose(full.low, b.low) and np.allclose(full.high, b.high)
    assert np.allclose(full.q_low, np.quantile(data, 0.05, axis=0))
    # widest: the widest band over (width x the series' peak |mean|)
    peak = np.abs(b.mean).max(0)
    assert math.isclose(b.widest(0.01), max((2 * half[:, j]).max() / (0.01 * peak[j]) for j in range(3)))
    assert Running().bands(0.95).widest(0.01) is None


def test_which_waves_split_their_replicates_over_the_ranks():
    from multigpu.sim.ensemble import splits_agents

    assert not splits_agents("auto", 1, 1) and not splits_agents("agents", 3, 1)  # one rank: nothing to split
    assert splits_agents("auto", 1, 2) and not splits_agents("auto", 2, 2)  # the last replicate of an odd count
    assert splits_agents("auto", 2, 4) and not splits_agents("auto", 3, 4)
    assert splits_agents("agents", 8, 2) and not splits_agents("replicates", 1, 8)


def test_the_bands_plot_names_the_model_starts_at_step_0_and_shows_its_band_over_the_line():
    """bands.png was titled "MODEL" (the attribute of pkg.module:MODEL), its axis began at step 1, and its band of
    the mean (narrower than the mean's line) was hidden under it. Now: the model's own name and spec in the title,
    the axis from step 0, the band filled above the line (alpha) with its edges drawn above and under it."""
    import matplotlib.collections  # the [report] extra, which `make setup` installs

    from multigpu.sim.bands import Bands
    from multigpu.sim.config import SimConfig
    from multigpu.sim.design import Point
    from multigpu.sim.ensemble import bands_title
    from multigpu.sim.ensemble_store import bands_figure

    assert bands_title(SimConfig(model="examples.sim_schelling:MODEL"), 12) == (
        "schelling (examples.sim_schelling:MODEL), 12 replicates")
    assert bands_title(SimConfig(model="sir"), 3) == "sir, 3 replicates"
    mean = np.array([[10.0], [20.0], [30.0]])
    band = Bands(n=8, mean=mean, sd=mean * 0, low=mean - 0.5, high=mean + 0.5)
    fig = bands_figure([Point(0, {}, {})], [["infected"]], [band], 0.95, "schelling (x:MODEL), 8 replicates")
    try:
        assert fig._suptitle.get_text().startswith("schelling (x:MODEL), 8 replicates")
        ax = fig.axes[0]
        assert ax.get_xlim()[0] == 0
        line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("all replicates"))
        fills = [c for c in ax.collections if isinstance(c, matplotlib.collections.PolyCollection)]
        assert fills and all(c.get_zorder() > line.get_zorder() and c.get_alpha() < 1 for c in fills)
        edges = [ln for ln in ax.get_lines() if ln is not line]
        assert sorted(tuple(ln.get_ydata()) for ln in edges) == [(9.5, 19.5, 29.5), (10.5, 20.5, 30.5)]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
