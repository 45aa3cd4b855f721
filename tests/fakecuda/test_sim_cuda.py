"""Simulation on fake CUDA: every model's step, the network halo, calibration and saving agents, with the
rank's device ``cuda`` on a CPU-only machine (world size 1, and rank 1 of 2 through the fake process group).

A step on fake tensors proves placement (a CPU tensor meeting CUDA data raises as on a GPU) and which host
reads it makes, not values: those are pinned by tests/dist/test_sim_*.py on CPU ranks. Host reads
(``.item()``, ``.tolist()``, ``int(t)``, ``nonzero``, ``.cpu()``) cannot be answered on fake tensors;
:class:`_HostReads` answers them with zeros (so ``nonzero`` finds nothing and no agent migrates) and
records where they were made: on a GPU each is a wait for the GPU, so the tests pin which ones a step makes.

The backward pass of calibration runs on the ``meta`` device instead: fake CUDA cannot run the autograd
engine (see :mod:`multigpu.testing.fakecuda`), and on ``meta`` the real engine runs and refuses a gradient
on another device exactly as it does on a GPU ("invalid gradient at index 0 - expected device ...").
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from unittest import mock

import pytest
import torch

from multigpu.config import from_dict, load_yaml
from multigpu.presets import preset_names
from multigpu.runtime import group
from multigpu.runtime.group import DistEnv
from multigpu.sim import Model, Substep, calibration, models, network, population
from multigpu.sim.api import MODELS, get_model
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.testing.fakecuda import fake_cuda, fake_group, is_fake


class _HostReads(torch.overrides.TorchFunctionMode):
    """Answer host reads of fake CUDA tensors with zeros; record (calling function, read) for each."""

    _READS = {"item": "value", "tolist": "value", "__int__": "value", "__index__": "value", "__float__": "value",
              "__bool__": "value", "equal": "value", "nonzero": "nonzero", "cpu": "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = self._READS.get(getattr(func, "__name__", None))
        tensor = args[0] if args else None
        if read is None or not is_fake(tensor):
            return func(*args, **kwargs)
        if tensor.device.type == "cuda":  # a read of a fake CPU tensor is no wait for a GPU
            caller = sys._getframe(1)
            while caller.f_globals.get("__name__", "").startswith("torch"):
                caller = caller.f_back
            self.reads.append((caller.f_code.co_name, read))
        name = func.__name__
        if name == "cpu":
            return func(*args, **kwargs)
        if name == "nonzero":
            return torch.zeros((0, tensor.dim()), dtype=torch.int64, device=tensor.device)
        if name == "equal":
            return True
        if name == "tolist":
            return torch.zeros(tensor.shape, dtype=torch.int64).tolist() if tensor.dim() else 0
        return {"__bool__": False, "__float__": 0.0}.get(name, 0)


@contextlib.contextmanager
def _rank(rank: int, world: int):
    """Rank ``rank`` of ``world`` on fake CUDA (cuda:rank on an 8-GPU host); yields the host-read recorder."""
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0,
                  device=torch.device("cuda", rank), backend="nccl" if world > 1 else "none")
    with contextlib.ExitStack() as stack:
        if world > 1:
            stack.enter_context(fake_group(rank, world))
        stack.enter_context(mock.patch.object(group, "_ENV", env))
        stack.enter_context(fake_cuda(devices=8))
        torch.cuda.set_device(rank)
        yield stack.enter_context(_HostReads())


def _assert_on(device: torch.device, *tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device == device, (t.device, device)


def _step_twice(engine: SimEngine, reads: _HostReads) -> list[tuple[str, str]]:
    """Populate ``engine`` (made with populate=False), step it twice; the host reads of the steps."""
    engine._populate()
    ids = torch.arange(4, dtype=torch.int32, device=engine.device)
    _assert_on(engine.device, *engine.initial_agents(ids).values())  # the model's init makes them there
    del reads.reads[:]
    engine.step()
    engine.step()
    _assert_on(engine.device, *engine.state.buffers.values())
    assert len(engine._pending) == 2
    _assert_on(engine.device, *(sums for _, sums, _ in engine._pending))  # read once per flush, not per step
    assert not engine.use_native  # the C kernels are CPU-only: the CUDA path runs torch's kernels
    return list(reads.reads)


# host reads a step needs: agents leaving this rank's rows and how many arrive (sizes of the all-to-all),
# the market's new price (computed in Python floats, the same on every rank), the adaptive strategy's
# new borders (every rebalance_every steps)
_MIGRATION = {("_apply", "nonzero"), ("_send_strays", "nonzero"), ("migrate", "value")}
_PRICE = {("_trade_prepare", "value")}
_REBALANCE = {("rebalance", "cpu")}


def _sim_presets() -> dict[str, dict]:
    data = {name: load_yaml(name) for name in preset_names()}
    get_model("sir")  # registers the built-in models
    return {name: d for name, d in data.items() if isinstance(d.get("model"), str) and d["model"] in MODELS}


def test_the_sim_presets_are_the_ones_tested_here():
    assert set(_sim_presets()) == {"sir", "market", "movement"}


_CASES = [  # (preset, overrides, host reads the step may make at world size > 1)
    ("sir", {}, set()),
    ("sir", {"params": {"radius": 1, "seir": True}}, set()),
    ("sir", {"strategy": "spatial", "params": {"radius": 1}}, _MIGRATION),
    ("movement", {"strategy": "adaptive", "rebalance_every": 1}, _MIGRATION | _REBALANCE),
    ("market", {}, _PRICE),
]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("preset", "overrides", "allowed"), _CASES)
def test_every_sim_preset_steps_on_cuda(preset, overrides, allowed, world):
    data = {**_sim_presets()[preset], "agents": 2000, "grid": [16, 16], "compile": False, **overrides}
    data["params"] = {**data.get("params", {}), **overrides.get("params", {})}
    cfg = from_dict(SimConfig, data)
    with _rank(world - 1, world) as reads:
        engine = SimEngine(cfg, populate=False)
        got = set(_step_twice(engine, reads))
    assert got <= (allowed if world > 1 else allowed - _MIGRATION), got
    if world > 1 and cfg.strategy != "data":
        assert ("migrate", "value") in got  # the migration's all-to-alls ran on the fake CUDA tensors
    if preset == "sir" and cfg.strategy == "data":
        assert got == set()  # no wait for the GPU inside a step of the default sir


def test_the_kernels_a_gpu_runs_give_the_cpus_agents():
    """On a GPU the engine counts the infected without reading how many there are (infected_kernel_fused):
    the same agents and series, run here for real on the CPU."""
    cfg = SimConfig(model="sir", agents=3000, grid=(16, 16), steps=6, native="off", plot=False,
                    params={"beta": 0.3, "initial_infected": 0.05})
    cpu = SimEngine(cfg)
    want = cpu.run()
    with mock.patch.dict(models.KERNELS, models.FUSED_KERNELS):
        gpu = SimEngine(cfg)
    assert gpu.ctx.kernels["infected"] is models.infected_kernel_fused
    assert gpu.run() == want and want["I"][-1] > 0
    for name, values in cpu.state.sorted_by_id().items():
        assert torch.equal(values, gpu.state.sorted_by_id()[name]), name


def test_the_gpu_count_of_the_infected_spreads_its_adds_over_the_cells():
    """A GPU adds equal indices of an accumulating index_put_ one after another (it sorts them and gives each run
    to one thread): the first GPU call's warm-up step of 1e8 agents took 12 s when every uninfected agent was sent
    to the one drop slot. So the GPU kernel's adds go to the agents' own cells (0 or 1 each), and only agents off
    this rank's rows go to the drop slot; and it adds as the CPU's kernel counts."""
    gen = torch.Generator().manual_seed(3)
    n, width, rows, lo = 20_000, 50, 40, 10
    x = torch.randint(0, width, (n,), generator=gen, dtype=torch.int16)
    y = torch.randint(0, 60, (n,), generator=gen, dtype=torch.int16)  # rows 0..59: some off rows 10..49
    state = torch.randint(0, 4, (n,), generator=gen, dtype=torch.uint8)
    seen: list[torch.Tensor] = []
    real_add, real_put = torch.Tensor.index_add_, torch.Tensor.index_put_

    def index_add_(self, dim, index, source, **kwargs):
        seen.append(index.clone())
        return real_add(self, dim, index, source, **kwargs)

    def index_put_(self, indices, values, accumulate=False):
        seen.append(indices[0].clone())
        return real_put(self, indices, values, accumulate)

    fused, want = torch.zeros(rows * width + 1, dtype=torch.int32), torch.zeros(rows * width + 1, dtype=torch.int32)
    models.infected_kernel(want, x, y, state, lo, width)
    with mock.patch.object(torch.Tensor, "index_add_", index_add_), \
            mock.patch.object(torch.Tensor, "index_put_", index_put_):
        models.infected_kernel_fused(fused, x, y, state, lo, width)
    assert torch.equal(fused[:-1], want[:-1])
    (index,) = seen
    off_rows = int(((y < lo) | (y >= lo + rows)).sum())
    assert int((index == rows * width).sum()) == off_rows  # the drop slot: only agents off the rows
    assert int(torch.bincount(index[index < rows * width]).max()) < 40  # ~10 agents per cell, not n on one


# -------------------------------------------------------------------- a user's model (sim.api)
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Params:
    p_flip: float = 0.3
    move_prob: float = 0.5


def _init(ctx, ids):
    return {"id": ids, "bit": ctx.bernoulli(ids, 0.5, "init").to(torch.uint8),
            **{k: v for k, v in ctx.env["spawn"](ids, ctx).items() if k in ("x", "y")}}


def _count(ctx, agents, acc):  # a 2-channel cell field: agents with bit 0, with bit 1
    acc.index_put_((ctx.cell(agents), agents["bit"].to(torch.int64)), torch.ones_like(agents["id"]),
                   accumulate=True)


def _flip(ctx, agents, counts):
    crowded = counts.reshape(-1, 2)[ctx.cell(agents)].sum(1) > ctx.randint(agents["id"], 4, "crowd")
    agents["bit"] ^= (ctx.bernoulli(agents["id"], ctx.params.p_flip, "flip") & crowded).to(torch.uint8)
    return agents["bit"].sum(dtype=torch.int64).reshape(1)


def _ones(ctx, agents, acc):
    acc += agents["bit"].sum(dtype=torch.int64).reshape(1)


def _user_model() -> Model:
    from multigpu.sim.models import spawn_on_grid

    return Model(name="fakecuda_flips", fields={"id": torch.int32, "x": torch.int16, "y": torch.int16,
                                                "bit": torch.uint8},
                 params=_Params, init=_init,
                 env=lambda p: {"spawn": lambda ids, ctx: spawn_on_grid(ids, ctx.seed, ctx.grid)},
                 substeps=["movement",
                           Substep("flip", ("id", "bit"), _flip, field="cell", contribute=_count, channels=2,
                                   series=["ones"], halo=1),
                           Substep("total", ("bit",), lambda ctx, agents, total: None, field="global",
                                   field_size=1, contribute=_ones)])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy", ["data", "spatial"])
def test_a_user_model_steps_on_cuda(strategy, world):
    cfg = SimConfig(model=f"{__name__}:_user_model", agents=500, grid=(8, 8), strategy=strategy)
    with _rank(world - 1, world) as reads:
        engine = SimEngine(cfg, populate=False)
        got = set(_step_twice(engine, reads))
    assert got <= (_MIGRATION if strategy == "spatial" and world > 1 else set()), got


# -------------------------------------------------------------------- network_sir
def _graph_of_rank1() -> network.Graph:
    """Rank 1 of 2's part of a 6-agent graph (it owns agents 3..5), built on the CPU as the engine does.

    Edges 0-3, 4-3, 1-5: rank 1 reads agents 0 and 1 from rank 0; rank 0 reads 3 and 5 from rank 1,
    which is what the setup's all-to-all (answered here) tells rank 1.
    """
    incoming = torch.tensor([[0, 3], [4, 3], [3, 4], [1, 5]], dtype=torch.int64)
    asked = (torch.tensor([[3], [5]], dtype=torch.int64), [2, 0])
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, device=torch.device("cpu"),
                  backend="gloo")
    with mock.patch.object(group, "_ENV", env), mock.patch.object(network, "_all_to_all", lambda *a: asked):
        graph = network.Graph(6, incoming)
    assert graph.num_halo == 2 and graph.send_index.tolist() == [0, 2]
    return graph


def test_network_halo_and_inbox_on_cuda_with_two_ranks():
    graph = _graph_of_rank1()
    with _rank(1, 2) as reads:
        graph.to("cuda")  # what the engine does with the graph it built
        messages = torch.ones(3, dtype=torch.int32, device="cuda")
        inbox = graph.neighbour_sum(messages)
        _assert_on(torch.device("cuda:1"), inbox, graph.dst, graph.src_slot, graph.send_index)
        assert inbox.shape == (3,) and reads.reads == []


@pytest.mark.parametrize("kind", ["households", "geometric"])
@pytest.mark.parametrize("world", [1, 2])
def test_network_sir_steps_on_cuda(kind, world):
    cfg = SimConfig(model="network_sir", agents=6 if world > 1 else 300, steps=2,
                    network={"kind": kind, "radius": 0.1})
    # the graph's setup reads sizes on the host, so it is built for real on the CPU (at world size 2 this
    # rank's part is built above); the engine must then place it on its device
    graph = _graph_of_rank1() if world > 1 else network.build(cfg.network, cfg.agents, cfg.seed)
    with _rank(world - 1, world) as reads, mock.patch.object(network, "build", lambda *a: graph):
        engine = SimEngine(cfg, populate=False)
        assert set(_step_twice(engine, reads)) == set()
        _assert_on(engine.device, graph.dst, graph.src_slot, graph.send_index)


# -------------------------------------------------------------------- calibration
_CAL = SimConfig(model="sir", agents=400, grid=(10, 10), steps=3, params={"beta": 0.04, "initial_infected": 0.05})


@pytest.mark.parametrize("world", [1, 2])
def test_calibration_forward_on_cuda(world):
    with _rank(world - 1, world) as reads:
        engine = SimEngine(_CAL, populate=False)
        engine._populate()
        del reads.reads[:]
        kept, counts = calibration.DiffSIR(engine).forward_counts(0.04, 0.1)
        _assert_on(engine.device, counts, *(t for step in kept for t in step))
        assert counts.shape == (3, 3) and reads.reads == []  # the series is read once, after the last step


def test_calibration_backward_keeps_every_gradient_on_the_data_device():
    engine = SimEngine(_CAL)  # real agents on the CPU: the target and the kept steps have values
    model = calibration.DiffSIR(engine)
    kept, series = model.forward(0.04, 0.1)
    target = {c: torch.tensor(v, dtype=torch.float64) + 5 for c, v in series.items() if c in "IR"}
    _, grad_series = calibration.loss_and_grads(series, target, _CAL.agents)  # on the CPU, as descend makes them
    want = model.gradient_tensor(kept, grad_series, 0.04, 0.1)
    for name in ("ids", "x0", "y0", "state0"):  # the same agents on a device that is not the CPU
        setattr(model, name, getattr(model, name).to("meta"))
    on_meta = [tuple(t.to("meta") for t in step) for step in kept]
    got = model.gradient_tensor(on_meta, grad_series, 0.04, 0.1)  # the real autograd engine checks devices
    assert got.device.type == "meta" and got.shape == want.shape == (2,)


# -------------------------------------------------------------------- saving agents
def test_saved_agents_are_received_on_the_senders_device():
    received = []

    def recv(tensor, src):
        received.append(tensor.device)

    engine = mock.Mock(rank=0, world=2, num_agents=10)
    with _rank(0, 2), mock.patch("torch.distributed.recv", recv), \
            mock.patch.object(population, "_numpy", lambda t: None):
        fields = {"id": torch.zeros(5, dtype=torch.int32, device="cuda")}
        list(population._slices_on_rank0(engine, fields, "id"))
    assert received == [torch.device("cuda:0")]  # rank 1 sends a CUDA tensor: it goes over NCCL


# -------------------------------------------------------------------- ensembles
def test_a_batch_of_network_sir_runs_on_cuda_with_one_host_read():
    """A batch of populations (sim.batch) on a rank's GPU: every tensor there, and the series read once, at the
    end (a read per step would make the GPU wait every step)."""
    from multigpu.sim import batch

    cfg = SimConfig(model="network_sir", agents=40, steps=3, network={"kind": "random", "contacts": 2})
    edges = batch._edges(cfg, [1, 2], cfg.agents)  # set up on the CPU (host reads there), as for real
    with _rank(0, 1) as reads, mock.patch.object(batch, "_edges", lambda *a: edges):
        out = batch.run_batch(cfg, [1, 2], device=group.current_device())
    assert len(out) == 2 and set(out[0]) == {"step", "S", "I", "R"}
    # the one tolist of the [batch, series, steps] counts (fake tensors answer it element by element)
    assert reads.reads == [("run_batch", "value")] * (2 * 3 * cfg.steps), reads.reads


# -------------------------------------------------------------------- timing the exchanges
@contextlib.contextmanager
def _timings():
    """Record ``(op, device type)`` of every collective the simulation times (``collectives.timed_collective``): a
    device type ``cuda`` is timed by CUDA events on the stream, None by the host clock."""
    from multigpu.runtime import collectives
    from multigpu.sim import exchange

    real, seen = collectives.timed_collective, []

    def recording(op, device=None):
        seen.append((op, None if device is None else device.type))
        return real(op, device)

    with mock.patch.object(collectives, "timed_collective", recording), mock.patch.object(exchange, "timed_collective", recording):
        yield seen


@pytest.mark.parametrize(("preset", "overrides", "ops"), [
    ("sir", {"strategy": "spatial", "params": {"radius": 1}}, {"halo", "migrate"}),
    ("movement", {"strategy": "adaptive", "rebalance_every": 1}, {"migrate"}),
])
def test_halo_and_migration_on_cuda_are_timed_on_the_gpu(preset, overrides, ops):
    """On NCCL a collective returns once queued: the halo all-gather and the migration all-to-alls are timed by
    CUDA events on the stream (as multigpu's own collectives are), not by the host clock, which timed the
    queueing (comm about 0 for spatial, adaptive and network_sir). Before: every one of them by the host clock."""
    data = {**_sim_presets()[preset], "agents": 2000, "grid": [16, 16], "compile": False, **overrides}
    data["params"] = {**data.get("params", {}), **overrides.get("params", {})}
    with _rank(1, 2), _timings() as seen:
        engine = SimEngine(from_dict(SimConfig, data), populate=False)
        engine._populate()
        del seen[:]
        engine.step()
        engine.step()
    timed = {(op, kind) for op, kind in seen if op in ops}
    assert {op for op, _ in timed} == ops and {kind for _, kind in timed} == {"cuda"}, seen


def test_network_halo_on_cuda_is_timed_on_the_gpu():
    graph = _graph_of_rank1()
    with _rank(1, 2), _timings() as seen:
        graph.to("cuda")
        graph.neighbour_sum(torch.ones(3, dtype=torch.int32, device="cuda"))
    assert seen == [("network halo", "cuda")]
