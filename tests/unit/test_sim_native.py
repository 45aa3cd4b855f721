"""The C kernels of multigpu.sim.native compute exactly what the torch kernels compute (the specification).

Skipped where no C compiler works (the engine then keeps the torch kernels).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.sim import native, rng
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import KERNELS, infection_table

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch kernels run instead")


def _agents(n: int, height: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(4 * n, generator=g)[:n].to(torch.int32)
    ids[:2] = torch.tensor([0, 2**31 - 1], dtype=torch.int32)
    x = torch.randint(0, width, (n,), generator=g).to(torch.int16)
    y = torch.randint(0, height, (n,), generator=g).to(torch.int16)
    x[:4] = torch.tensor([0, width - 1, 0, width - 1], dtype=torch.int16)  # the wrap-around edges
    y[:4] = torch.tensor([0, 0, height - 1, height - 1], dtype=torch.int16)
    state = torch.randint(0, 4, (n,), generator=g).to(torch.uint8)
    return ids, x, y, state


@pytest.mark.parametrize("move_prob", [0.0, 0.37, 1.0])
def test_move_matches_the_torch_kernel(move_prob):
    ids, x, y, _ = _agents(50_003, 7, 11)
    ours = native.kernels()
    for step in range(3):
        key, thr = rng.step_key(5, step, rng.STREAM_MOVE), rng.threshold(move_prob, 16)
        ax, ay, bx, by = x.clone(), y.clone(), x.clone(), y.clone()
        want = KERNELS["move"](ids, ax, ay, key, thr, 7, 11)
        got = ours["move"](ids, bx, by, key, thr, 7, 11)
        assert int(got) == int(want) and torch.equal(ax, bx) and torch.equal(ay, by)
        x, y = ax, ay


@pytest.mark.parametrize("lo, rows", [(0, 9), (3, 4)])
def test_infected_and_transition_match_the_torch_kernels(lo, rows):
    height, width = 9, 13
    ids, x, y, state = _agents(40_009, height, width, seed=1)
    ours = native.kernels()
    acc_t = torch.zeros(rows * width + 1, dtype=torch.int32)
    acc_n = acc_t.clone()
    KERNELS["infected"](acc_t, x, y, state, lo, width)
    ours["infected"](acc_n, x, y, state, lo, width)
    assert torch.equal(acc_t[:-1], acc_n[:-1]) and int(acc_t[:-1].sum()) > 0
    inside = (y >= lo) & (y < lo + rows)  # the transition sees only this rank's agents
    ids, x, y, state = ids[inside], x[inside], y[inside], state[inside]
    cell_thr = infection_table(0.2)[acc_t[:-1].clamp(max=30).to(torch.int64)]
    for seir in (False, True):
        state_thr = torch.tensor([0, rng.threshold(0.3), rng.threshold(0.1), 0], dtype=torch.int32)
        next_state = torch.tensor([1 if seir else 2, 2, 3, 3], dtype=torch.uint8)
        key = rng.step_key(9, 4, rng.STREAM_TRANSITION)
        s_t, s_n = state.clone(), state.clone()
        want = KERNELS["transition"](ids, x, y, s_t, key, cell_thr, lo, width, state_thr, next_state)
        got = ours["transition"](ids, x, y, s_n, key, cell_thr, lo, width, state_thr, next_state)
        assert torch.equal(s_t, s_n) and torch.equal(want, got)
        assert not torch.equal(s_t, state)  # something happened


def test_transition_refuses_an_agent_outside_the_rows():
    ids, x, y, state = _agents(100, 9, 13)
    thr = torch.zeros(2 * 13, dtype=torch.int32)  # rows [0, 2) only, but agents sit on rows up to 8
    with pytest.raises(IndexError, match="outside this rank's rows"):
        native.kernels()["transition"](ids, x, y, state, 1, thr, 0, 13, torch.zeros(4, dtype=torch.int32),
                                       torch.zeros(4, dtype=torch.uint8))


def test_row_order_and_outside_match_torch():
    _, _, y, _ = _agents(30_011, 17, 5, seed=2)
    assert torch.equal(native.row_order(y, 17), torch.argsort(y, stable=True))
    for lo, hi in [(0, 17), (4, 9), (16, 17)]:
        assert torch.equal(native.outside(y, lo, hi), torch.nonzero((y < lo) | (y >= hi)).reshape(-1))
    with pytest.raises(IndexError, match="a row outside 0..9"):
        native.row_order(y, 10)


def test_the_engine_gives_the_same_agents_with_and_without_the_c_kernels():
    base = SimConfig(model="sir", agents=20_011, grid=(23, 19), steps=12, chunk_size=4096, sort_every=5,
                     params={"beta": 0.3, "seir": True, "initial_infected": 0.02, "move_prob": 0.7})
    runs = {}
    for native_opt in ("off", "on"):
        engine = SimEngine(dataclasses.replace(base, native=native_opt))
        assert engine.use_native == (native_opt == "on")
        runs[native_opt] = (engine.run(), engine.state.sorted_by_id())
    (s_off, a_off), (s_on, a_on) = runs["off"], runs["on"]
    assert s_off == s_on
    assert all(torch.equal(a_off[k], a_on[k]) for k in a_off)


def test_native_and_overlap_options_are_checked():
    with pytest.raises(ConfigError, match="sim.native 'yes' is not valid; valid: auto, on, off"):
        SimConfig(native="yes")
    with pytest.raises(ConfigError, match="sim.overlap 'maybe' is not valid; valid: auto, on, off"):
        SimConfig(overlap="maybe")
    # YAML reads on / off as booleans: they mean on / off here
    assert SimConfig(native=False).native == "off" and SimConfig(overlap=True).overlap == "on"


@pytest.mark.parametrize("lo, rows", [(0, 9), (3, 4), (8, 1)])
def test_move_count_matches_the_torch_kernels(lo, rows):
    """The fused pass: the same positions, moved count, infected counts per cell and strays as the three kernels."""
    height, width = 9, 13
    ids, x, y, state = _agents(30_011, height, width, seed=3)
    state[::3] = 2  # plenty of infected agents, some of them in the same cell one after another
    ours = native.kernels()
    key, thr = rng.step_key(2, 7, rng.STREAM_MOVE), rng.threshold(0.6, 16)
    results = []
    for move_count in (KERNELS["move_count"], ours["move_count"]):
        ax, ay = x.clone(), y.clone()
        acc = torch.zeros(rows * width + 1, dtype=torch.int32)
        moved, away = move_count(ids, ax, ay, state, key, thr, height, width, acc, lo)
        results.append((int(moved), ax, ay, acc[:-1], away))
    (m_t, x_t, y_t, acc_t, away_t), (m_n, x_n, y_n, acc_n, away_n) = results
    assert m_t == m_n > 0 and torch.equal(x_t, x_n) and torch.equal(y_t, y_n)
    assert torch.equal(acc_t, acc_n) and int(acc_t.sum()) > 0
    assert torch.equal(away_t, away_n) and (away_t.numel() > 0) == (rows < height)


def test_thresholds_match_the_torch_kernel():
    table = infection_table(0.05)
    g = torch.Generator().manual_seed(4)
    counts = torch.randint(0, table.numel() + 50, (7, 311), generator=g, dtype=torch.int32)  # some past the end
    want = KERNELS["thresholds"](table, counts)
    got = native.kernels()["thresholds"](table, counts)
    assert want.dtype == got.dtype == torch.int32 and torch.equal(want, got)
    assert int((counts >= table.numel()).sum()) > 0


def test_permute_matches_index_select():
    g = torch.Generator().manual_seed(5)
    n = 10_007
    order = torch.argsort(torch.randint(0, 50, (n,), generator=g), stable=True)
    fields = [torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=dt) for dt in (torch.int32, torch.int64)]
    fields += [torch.randint(0, 255, (n,), generator=g).to(torch.uint8), torch.randint(-300, 300, (n,), generator=g).to(torch.int16)]
    want = [torch.index_select(f, 0, order) for f in fields]
    assert native.permute(fields, order)
    assert all(torch.equal(a, b) for a, b in zip(fields, want, strict=True))
    assert not native.permute([torch.zeros(n, dtype=torch.complex128)], order)  # 16-byte elements: not taken


@pytest.mark.slow  # a fresh interpreter that compiles the C kernels: 5 to 13 s on 2 cores
def test_a_compiled_config_whose_kernels_run_in_c_never_loads_torchs_compiler():
    """``compile: true`` (the sir preset's) wrapped every kernel in torch.compile when the engine was made, which
    imports dynamo and inductor (2-3 CPU-seconds of every rank's set-up), though the C kernels replaced them all
    for SIR: a kernel is compiled on its first call now. A fresh process, since this one may have loaded them."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from multigpu.sim.config import SimConfig\nfrom multigpu.sim.engine import SimEngine\n"
            "e = SimEngine(SimConfig(model='sir', agents=5000, grid=(20, 20), steps=2, compile=True))\n"
            "e.step(); e.step()\nprint(e.use_native, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


# ----------------------------------------------------------------------------- whose library is loaded
_NOBODY = 65534
_as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                              reason="planting files of another user needs root (chown); CI runs as root")


def _plant(path: Path, marker: Path, *, folder_owner: int, folder_mode: int, file_owner: int, file_mode: int) -> None:
    """The real kernels plus a constructor that creates ``marker`` when the library is loaded, at ``path``."""
    import shutil
    import subprocess

    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent.parent / "evil.c"
    src.write_text(native._SOURCE + '\n#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    subprocess.run([cc, *native._FLAGS, str(src), "-o", str(path)], check=True, capture_output=True, timeout=120)
    src.unlink()
    os.chown(path, file_owner, file_owner)
    path.chmod(file_mode)
    os.chown(path.parent, folder_owner, folder_owner)
    path.parent.chmod(folder_mode)


@_as_root
@pytest.mark.parametrize("folder_owner, folder_mode, file_owner, file_mode, why", [
    (_NOBODY, 0o755, _NOBODY, 0o755, "the folder is owned by uid 65534"),
    (0, 0o777, _NOBODY, 0o755, "the folder is writable by others than its owner (mode 777)"),
    (0, 0o770, 0, 0o700, "the folder is writable by others than its owner (mode 770)"),
    (0, 0o700, _NOBODY, 0o755, "the file is owned by uid 65534"),
    (0, 0o700, 0, 0o666, "the file is writable by others than its owner (mode 666)"),
])
def test_a_library_another_user_could_have_planted_is_never_loaded(tmp_path, monkeypatch, capsys, folder_owner,
                                                                   folder_mode, file_owner, file_mode, why):
    """The kernels were loaded from ``$XDG_CACHE_HOME/multigpu/native/sim_<digest>.so`` whoever owned the folder or
    the file: a library planted there by another user ran its constructor in every rank, as the job's user. Now it
    is loaded only from a folder and a file this user owns that no one else can write; else the kernels are built in
    a private temporary folder, and one line says why."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    marker = tmp_path / "PLANTED_LIBRARY_RAN"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    path = native._cache_path(cc)
    _plant(path, marker, folder_owner=folder_owner, folder_mode=folder_mode, file_owner=file_owner,
           file_mode=file_mode)
    before = path.read_bytes()
    capsys.readouterr()
    lib = native._build()
    assert lib, "the kernels were not built in a private folder"
    assert not marker.exists(), "the planted library's constructor ran"
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "not used" in line]
    assert len(lines) == 1 and why in lines[0] and "private temporary folder" in lines[0], err
    assert path.read_bytes() == before  # the planted file is left where it is, not loaded, not replaced
    assert not list(Path(tempfile.gettempdir()).glob("multigpu_native_*"))  # the private build is deleted


@_as_root
def test_a_symbolic_link_in_place_of_the_cache_folder_is_not_followed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    marker = tmp_path / "PLANTED_LIBRARY_RAN"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    path = native._cache_path(cc)
    elsewhere = tmp_path / "theirs" / "native" / path.name
    _plant(elsewhere, marker, folder_owner=_NOBODY, folder_mode=0o755, file_owner=0, file_mode=0o700)
    path.parent.parent.mkdir(parents=True)
    path.parent.symlink_to(elsewhere.parent)
    assert native._build() and not marker.exists()
    assert "the folder cannot be opened as a folder" in capsys.readouterr().err


def test_the_cache_is_built_private_and_then_loaded_from(tmp_path, monkeypatch, capsys):
    """A fresh cache: folder 0700, library 0700 (no group or other write bit, whatever the umask); the next load
    takes it from there without a word."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = os.umask(0o002)
    try:
        assert native._build()
    finally:
        os.umask(old)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    path = native._cache_path(cc)
    assert path.stat().st_mode & 0o777 == 0o700 and path.parent.stat().st_mode & 0o777 == 0o700
    built = path.stat().st_mtime_ns
    assert native._build() and path.stat().st_mtime_ns == built
    assert "not used" not in capsys.readouterr().err


def test_network_kernels_equal_the_torch_ones():
    """The network step in C: spread along the edges of the active sources (int64 messages and bools), and
    network_sir's transition (state in place, counts of S, I, R), bit for bit the torch code."""
    from multigpu.sim import network
    from multigpu.sim.models import net_transition_kernel

    g = torch.Generator().manual_seed(3)
    n, e = 3000, 20000
    src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    ptr, targets = network.by_source(src, dst, n)
    values = torch.randint(-2, 3, (n,), generator=g) * (torch.rand(n, generator=g) < 0.3)
    got_ptr, got_targets = native.group(src, dst, n)  # the counting sort: the same groups, the same order
    assert torch.equal(got_ptr, ptr) and torch.equal(got_targets, targets)
    for v in (values, values != 0):
        want = network.spread(ptr, targets, v, torch.zeros(n, dtype=torch.int64))
        got = torch.zeros(n, dtype=torch.int64)
        assert native.spread(ptr, targets, v, got) and torch.equal(got, want)
    ids = torch.arange(n, dtype=torch.int32)
    state = torch.randint(0, 4, (n,), generator=g).to(torch.uint8)
    state[state == 1] = 0  # network_sir: S, I, R
    thr = infection_table(0.3)[torch.randint(0, 6, (n,), generator=g)]
    key = rng.step_key(9, 4, rng.STREAM_TRANSITION)
    before, want_state = state.clone(), state.clone()
    want = net_transition_kernel(ids, want_state, thr, key, rng.threshold(0.2))
    got = native.kernels()["net_transition"](ids, state, thr, key, rng.threshold(0.2))
    assert torch.equal(got, want) and torch.equal(state, want_state)
    assert (state != before).any() and want[1] > 0


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("lo_hi", [(0, 500), (200, 430)])
def test_a_graph_grouped_in_c_is_the_graph_sorted_by_torch(lo_hi, symmetric, monkeypatch):
    """Graph(use_native=True) groups the incoming edges by destination with the C counting sort: the same edges in
    the same order (the stable sort's), self-loops left out, and the same grouping by source for the step."""
    from multigpu.sim import network

    lo, hi = lo_hi
    monkeypatch.setattr(network, "shard_bounds", lambda n, rank, world: (lo, hi))
    g = torch.Generator().manual_seed(5)
    e = 6000
    dst = torch.randint(lo, hi, (e,), generator=g)
    src = torch.randint(lo, hi, (e,), generator=g)  # one rank's view: every source local (world size 1)
    src[:50] = dst[:50]  # self-loops: dropped
    incoming = torch.stack([src, dst], 1)
    want = network.Graph(500, incoming, symmetric=symmetric)
    got = network.Graph(500, incoming, symmetric=symmetric, use_native=True)
    assert got.native and got.num_edges == want.num_edges == int((src != dst).sum())
    for name in ("dst", "src_slot", "send_index"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    n = hi - lo
    for a, b in zip(got._by_source(n), want._by_source(n), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("agents,contacts", [(1, 3), (2, 4), (997, 5), (20_000, 2)])
def test_a_random_network_generated_in_c_is_the_one_built_from_its_edge_list(agents, contacts):
    """network.build(kind=random) on one rank with the C kernels: the graph generated straight into its groups in C
    holds the edges the [E, 2] list holds, in the same order (self-links left out, every link both ways)."""
    from multigpu.sim import network
    from multigpu.sim.config import SimConfig

    cfg = SimConfig(model="network_sir", agents=agents, steps=1, network={"kind": "random", "contacts": contacts})
    want = network.Graph(agents, network.incoming(cfg.network, agents, 11), symmetric=True)
    got = network.build(cfg.network, agents, 11, use_native=True)
    assert native.random_graph(agents, [1] * contacts) is not None  # built here: the C path, not the list's
    assert got.num_edges == want.num_edges and got.num_halo == want.num_halo == 0
    for name in ("dst", "src_slot", "send_index", "send_counts", "recv_counts"):
        a, b = getattr(got, name), getattr(want, name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    for a, b in zip(got._by_source(agents), want._by_source(agents), strict=True):
        assert torch.equal(a, b)
