"""Inference, collectives' shape checks, PPO's act step and the batched environments on fake CUDA tensors.

A CPU-only machine cannot run these on a GPU; under :func:`~multigpu.testing.fakecuda.fake_cuda` every
``device="cuda"`` tensor raises where CUDA would on mixed devices, and reading a GPU value on the host
(``.item()``, ``.tolist()``, ``bool()``) raises too. So these pin: what each step puts on the GPU, that no
CPU tensor meets a CUDA one, and which host waits the hot paths make (none but those named here).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from multigpu.errors import ShapeMismatchError
from multigpu.infer import sliding_window
from multigpu.infer.stitch import Canvas
from multigpu.runtime import collectives, group
from multigpu.runtime.group import DistEnv
from multigpu.testing.fakecuda import fake_cuda, fake_group, is_fake


class _Logged(torch.nn.Module):
    """A model that logs each call (and where its input was) into a shared event list."""

    def __init__(self, model: torch.nn.Module, log: list):
        super().__init__()
        self.model, self.log = model, log

    def forward(self, x):
        self.log.append(("model", x.device, x.shape[0]))
        return self.model(x)


def _little_free_memory(monkeypatch, free: int = 64 << 10) -> None:
    """The faked GPUs report ``free`` bytes free: neither the image nor the canvases fit there (a quarter of it)."""
    from multigpu.testing.fakecuda.devices import FakeCuda

    monkeypatch.setattr(FakeCuda, "mem_get_info", lambda self, device=None: (free, 80 << 30))


def _stitch_log(monkeypatch, log: list) -> None:
    real_add = Canvas.add

    def add(self, output, weights, start, **kwargs):
        log.append(("stitch", output.device, self.acc.device, weights.device))
        return real_add(self, output, weights, start, **kwargs)

    monkeypatch.setattr(Canvas, "add", add)


def _infer_on_gpu_1(monkeypatch):
    """A small conv net's sliding window with the model on fake cuda:1: (the model calls and stitches logged in
    order, the fake CUDA's record, the output)."""
    log: list = []
    _stitch_log(monkeypatch, log)
    image = torch.rand(1, 2, 40, 52)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 1))
    with fake_cuda(devices=2) as cuda:
        torch.cuda.set_device(1)
        model = _Logged(net.to("cuda"), log)
        with _CudaProducts() as products:
            out = sliding_window(image, model, roi=16, overlap=0.25, batch_size=3, blend="gaussian", progress=False)
    log.append(("products", products.count))
    return log, cuda, out


class _CudaProducts(TorchDispatchMode):
    """Counts the elementwise products of CUDA tensors (each one a kernel launch on a GPU)."""

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor, torch.ops.aten.mul.out) \
                and args[0].device.type == "cuda":
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_inference_on_cuda_cuts_and_stitches_on_the_gpu_and_copies_back_once(monkeypatch):
    """Where the image and this rank's canvases fit the GPU (a quarter of its free memory each), the image
    goes there once, the windows are cut there (nothing pinned, no copy per batch), the outputs are added
    into canvases on the GPU, and nothing waits for the device until the blended output comes back at the
    end. The first GPU call (one H200) measured the host path at 0.52x MONAI's, which keeps everything on
    the GPU: host stitching and a copy each way per batch were the difference."""
    log, cuda, out = _infer_on_gpu_1(monkeypatch)
    batches = [e for e in log if e[0] == "model"]
    assert len(batches) > 2 and {e[1] for e in batches} == {torch.device("cuda", 1)}
    stitches = [e for e in log if e[0] == "stitch"]
    assert stitches and {e[1:] for e in stitches} == {(torch.device("cuda", 1),) * 3}  # outputs, canvas, weights
    assert cuda.pinned == 0  # cut on the GPU: no batch goes through pinned host memory
    assert cuda.synchronized == 0 and cuda.events_recorded == 0  # no wait per batch, none for the whole device
    assert out.shape == (1, 3, 40, 52) and out.device.type == "cpu"
    # the weights multiply a whole batch in one product (MONAI's one launch per batch), not each window on its
    # own (before: one product per window, 3 launches per batch here)
    products = next(e[1] for e in log if e[0] == "products")
    assert products == len(batches), (products, len(batches), len(stitches))


def test_inference_on_cuda_stitches_one_batch_behind_the_model_without_a_device_sync(monkeypatch):
    """Where the image and canvases do not fit the GPU: the windows go to the GPU, the model runs there, each
    batch's output comes back to the host canvas through a non-blocking copy and its own CUDA event, and
    batch k is stitched only after batch k+1's model call is queued (so the GPU never idles while the host
    blends). Before: the output's blocking ``.to("cpu")`` waited for the device after every batch, the next
    model call came after the stitch, and the importance map read a value on the host (``.item()``)."""
    _little_free_memory(monkeypatch)
    log, cuda, out = _infer_on_gpu_1(monkeypatch)
    batches = [e for e in log if e[0] == "model"]
    assert len(batches) > 2 and {e[1] for e in batches} == {torch.device("cuda", 1)}
    stitches = [e for e in log if e[0] == "stitch"]
    assert stitches and {e[1:] for e in stitches} == {(torch.device("cpu"),) * 3}  # host canvas, host outputs
    # model 0, model 1, stitch 0, model 2, stitch 1, ..., model n-1, stitch n-2, stitch n-1 (a batch's windows
    # are stitched one by one: runs of stitches shown as one S); before: model 0, stitch 0, model 1, stitch 1, ...
    order = re.sub("S+", "S", "".join("M" if e[0] == "model" else "S" for e in log))
    assert order == "MM" + "SM" * (len(batches) - 2) + "S", order
    assert cuda.synchronized == 0  # no wait for the whole device
    assert cuda.events_recorded == cuda.events_synchronized == len(batches)  # one wait per batch, on its copy
    assert out.shape == (1, 3, 40, 52) and out.device.type == "cpu"


def _meta_rows(shapes):
    """Each rank's metadata row, as ``collectives._meta`` makes it, as real tensors (the other ranks' sends)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return [collectives._meta(torch.empty(s, device="meta")) for s in shapes]


def _world(monkeypatch, rank: int, world_size: int, shapes_of):
    """multigpu's runtime as rank ``rank`` of an NCCL job on the fake group; ``shapes_of(tensor)`` gives every
    rank's shape for the metadata exchange (the fake backend moves no data). Returns the log of collectives."""
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, node_rank=0,
                  device=torch.device("cuda", rank), backend="nccl")
    host = object()  # stands for the gloo group made beside NCCL
    monkeypatch.setattr(group, "_ENV", env)
    monkeypatch.setattr(group, "_MONITOR_GROUP", host)
    calls: list = []
    real_all_gather, real_all_reduce = dist.all_gather, dist.all_reduce

    def all_gather(parts, tensor, group=None, **kwargs):
        calls.append(("all_gather", tensor.device.type, "host" if group is host else group))
        if group is host:  # the metadata exchange: fill in what the other ranks sent
            parts[:] = _meta_rows(shapes_of(tensor))
            return None
        return real_all_gather(parts, tensor, group=group, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tensor.device.type, None))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_checked_collectives_exchange_shapes_over_the_host_group_at_world_size_8(monkeypatch):
    """Rank 3 of 8, NCCL, CUDA tensors: a checked all_reduce / broadcast / gather compares every rank's shape
    with CPU tensors over the gloo group beside NCCL, then queues the data collective on the GPU; nothing
    waits for the device. A rank with another shape raises ShapeMismatchError listing all eight, before any
    data moves. Before: the metadata went to the GPU, over NCCL, and came back with ``.cpu()``: a full
    device sync per call (and a value read that fake CUDA refuses)."""
    shapes = {"now": [(4, 5)] * 8}
    with fake_group(rank=3, world_size=8), fake_cuda(devices=8) as cuda:
        torch.cuda.set_device(3)
        calls = _world(monkeypatch, 3, 8, lambda t: shapes["now"])
        x = torch.ones(4, 5, device="cuda")
        assert collectives.all_reduce(x, "mean") is x and x.device == torch.device("cuda", 3)
        assert collectives.broadcast(x, src=0).device.type == "cuda"
        assert calls[:2] == [("all_gather", "cpu", "host"), ("all_reduce", "cuda", None)]
        shapes["now"] = [(i + 1, 5) for i in range(8)]  # gather: dim 0 may differ
        gathered = collectives.all_gather(torch.ones(4, 5, device="cuda"))
        assert gathered.shape == (36, 5) and gathered.device == torch.device("cuda", 3) and is_fake(gathered)
        shapes["now"] = [(4, 5)] * 5 + [(4, 6)] + [(4, 5)] * 2
        calls.clear()
        with pytest.raises(ShapeMismatchError) as err:
            collectives.all_reduce(torch.ones(4, 5, device="cuda"))
        assert "(4, 6)" in str(err.value) and str(err.value).count("(4, 5)") == 7
        assert calls == [("all_gather", "cpu", "host")]  # no data collective after a mismatch
        assert all(kind == "cuda" for name, kind, _ in calls if name == "all_reduce")
        assert cuda.synchronized == 0


def test_cartpole_and_pendulum_reset_and_step_on_cuda():
    """Every tensor a step hands back, and the state it updates, is on the environments' GPU, in every
    autoreset mode, with a reset mask and with actions made on the GPU; no step reads a value on the host."""
    from multigpu.envs import make

    for env_id, action in (("CartPole-v1", lambda n: torch.ones(n, dtype=torch.int64, device="cuda")),
                           ("Pendulum-v1", lambda n: torch.zeros(n, 1, device="cuda"))):
        for mode in ("next_step", "same_step", "disabled"):
            with fake_cuda(devices=2) as cuda:
                torch.cuda.set_device(1)
                envs = make(env_id, 6, device="cuda", seed=3, autoreset_mode=mode)
                where = torch.device("cuda", 1)
                obs, _ = envs.reset(seed=4)
                obs2, _ = envs.reset(options={"reset_mask": torch.ones(6, dtype=torch.bool, device="cuda")})
                assert obs.device == obs2.device == envs.state.device == where, (env_id, mode)
                for _ in range(3):
                    obs, reward, terminated, truncated, info = envs.step(action(6))
                    assert {t.device for t in (obs, reward, terminated, truncated)} == {where}, (env_id, mode)
                    assert obs.shape[0] == reward.shape[0] == 6 and terminated.dtype == torch.bool
                if mode == "same_step":
                    assert set(info) <= {"final_obs", "_final_obs"}
                assert cuda.synchronized == 0


def test_ppo_act_step_on_cuda():
    """PPO's rollout step without autograd on the GPU: the observation normalizer, the actor-critic forward,
    log-probabilities and entropy, the action map (Box actions too) into an environment step, and GAE over
    the rollout buffers, all on cuda. Before: the action map read ``bool(finite.all())`` from the GPU."""
    from multigpu.envs import make
    from multigpu.rl.config import RLConfig
    from multigpu.rl.normalize import ObsNormalizer
    from multigpu.rl.policy import policy_for
    from multigpu.rl.ppo import _advantages

    cfg = RLConfig(num_steps=4)
    for env_id in ("CartPole-v1", "Pendulum-v1"):
        with fake_cuda() as cuda:
            envs = make(env_id, 5, device="cuda", seed=0, autoreset_mode="same_step")
            spec = policy_for(envs.single_observation_space, envs.single_action_space)
            agent, head, to_env = spec.make_network(8).to("cuda"), spec.make_head(), spec.make_map("cuda")
            norm = ObsNormalizer(spec.obs_dim, "cuda")
            obs, _ = envs.reset(seed=1)
            rewards, values, dones = (torch.zeros(cfg.num_steps, 5, device="cuda") for _ in range(3))
            for t in range(cfg.num_steps):
                norm.observe(obs.reshape(5, -1))
                x = norm(obs)
                out, value = agent(x)
                action = out.argmax(-1) if spec.discrete else out.chunk(2, -1)[0]  # sampling needs a CUDA generator
                logp, entropy = head.log_prob(out, action), head.entropy(out)
                assert {t_.device.type for t_ in (x, out, value, action, logp, entropy)} == {"cuda"}, env_id
                obs, reward, terminated, truncated, _ = envs.step(to_env(action))
                rewards[t], values[t], dones[t] = reward.float(), value, (terminated | truncated).float()
            advantages, returns = _advantages(cfg, rewards, values, dones, agent(norm(obs))[1])
            assert advantages.device.type == returns.device.type == "cuda" and advantages.shape == (4, 5)
            assert cuda.synchronized == 0



def test_harness_additions_used_here_behave_as_cuda_does():
    """What this file needed of the harness: data copied onto the GPU, copies on one GPU, ``~mask``,
    pinned host memory, CUDA events and the device capability, each raising where CUDA raises."""
    with fake_cuda(devices=2) as cuda:
        ids = torch.as_tensor([3, 4, 5], device="cuda")
        assert ids.device == torch.device("cuda", 0) and ids.dtype == torch.int64 and is_fake(ids)
        assert torch.tensor(1.5, device="cuda:1").device == torch.device("cuda", 1)
        mask = torch.zeros(3, dtype=torch.bool, device="cuda")
        assert (~mask).device == mask.device and (~mask).dtype == torch.bool
        state = torch.zeros(2, 3, device="cuda")
        assert state.copy_(torch.ones(3, device="cuda")) is state  # broadcasts, as copy_ does
        with pytest.raises(RuntimeError, match="broadcast"):
            state.copy_(torch.ones(4, device="cuda"))
        host = torch.ones(3)
        assert host.pin_memory() is host and host.is_pinned()
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):  # torch's words
            torch.ones(3, device="cuda").pin_memory()
        event = torch.cuda.Event()
        with pytest.raises(RuntimeError, match="never recorded"):
            event.synchronize()
        event.record()
        event.synchronize()
        assert (cuda.events_recorded, cuda.events_synchronized) == (1, 1)
        assert torch.cuda.get_device_capability(1) == (9, 0)
        with pytest.raises(IndexError, match="not visible"):
            torch.cuda.get_device_capability(2)


def test_inference_of_an_image_already_on_the_gpu(monkeypatch):
    """MONAI users write ``sliding_window_inference(x.cuda(), ...)``: the windows are cut from CUDA data, so the
    batch is on the GPU already and is not pinned (torch refuses to pin a CUDA tensor: "cannot pin ..."); the
    output comes back on the input's device. Before: every such call crashed in ``pin_memory``."""
    from multigpu.infer import sliding_window_inference

    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1))
    with fake_cuda(devices=1):
        model = net.to("cuda")
        image = torch.rand(1, 2, 40, 52).cuda()
        out = sliding_window_inference(image, 16, 3, model, overlap=0.25)
        assert out.shape == (1, 3, 40, 52) and out.device == torch.device("cuda", 0)
        host = sliding_window(torch.rand(1, 2, 40, 52), model, roi=16, batch_size=3, progress=False)
        assert host.device.type == "cpu"  # a host image: moved to the GPU once, the output back to the host


def test_a_batchs_copy_is_waited_for_on_the_stream_of_the_gpu_it_comes_from(monkeypatch):
    """The model on cuda:1 while cuda:0 is the current device (``device=`` or a model placed by hand), host
    canvases (the GPU short of memory): the copy of its output to the host runs on cuda:1's stream, so the
    event the host waits on before stitching must be recorded there. Before: it was recorded on the current
    device's stream (cuda:0's), which says nothing about cuda:1's copy: the host could stitch a pinned buffer
    still being written (the fake raises)."""
    _little_free_memory(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1))
    with fake_cuda(devices=2) as cuda:
        assert torch.cuda.current_device() == 0
        model = net.to("cuda:1")
        out = sliding_window(torch.rand(1, 2, 40, 52), model, roi=16, batch_size=3, progress=False)
        assert out.shape == (1, 3, 40, 52)
        assert cuda.events_recorded == cuda.events_synchronized > 0


class _HostCopies(torch.overrides.TorchFunctionMode):
    """Logs each copy of CUDA data to the host (``to``/``cpu``/``copy_``) and whether it blocks, into ``log``."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_) and args:
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            dst = args[0].device if func is torch.Tensor.copy_ else (
                torch.device("cpu") if func is torch.Tensor.cpu else next(
                    (torch.device(a) for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))),
                    src.device))
            if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst.type == "cpu":
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[1:3]))
                self.log.append(("to host", blocking))
        return func(*args, **kwargs)


def _evaluate_as(rank: int, world_size: int, log: list):
    """This rank's share of a sliding window on fake cuda:0, as rank ``rank`` of ``world_size`` (its windows, its
    canvases on the GPU), the model loop alone; ``route`` logs each window output handed to the exchange, and reads
    it on the host as the exchange does (gloo sends host tensors)."""
    from multigpu.infer.evaluate import RankWindows
    from multigpu.monitor import StepMeter

    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1))
    image = torch.rand(2, 64, 76)  # 30 windows of 16: 10 batches of 3, 5 per rank on 2 ranks
    with fake_cuda(devices=1) as cuda:
        model = _Logged(net.to("cuda"), log)
        rank_windows = RankWindows([image], model, (16, 16), (0.25, 0.25), 3, "gaussian", "fp32", "constant",
                                   sigma_scale=0.125, cval=0.0, device=None)
        rank_windows.rank, rank_windows.world_size, rank_windows.distributed = rank, world_size, True
        rank_windows.rank_bounds = rank_windows.plan.rank_bounds(3, world_size)
        rank_windows.start, rank_windows.stop = rank_windows.rank_bounds[rank]

        def route(owner: int, index: int, y: torch.Tensor) -> None:
            assert y.device.type == "cpu"
            y.sum()  # what a gloo send reads: the fake raises if the copy may still be landing
            log.append(("route", owner, index))

        with _HostCopies(log), torch.inference_mode():
            rank_windows.evaluate(StepMeter("windows", total_steps=rank_windows.num_batches(), progress=False), route)
    return cuda


def test_windows_another_rank_needs_leave_the_gpu_off_the_model_loop():
    """On 2+ GPUs the last rank's windows at a rank boundary go to the host (the exchange is gloo). Each copy
    starts without blocking while the model loop runs, and the host waits once, after the loop, before
    handing them over. Before: a blocking ``.to("cpu")`` per such window inside the loop, a stall of the
    whole GPU queue at every boundary window (found by reading the code: the GPU calls ran one GPU)."""
    log: list = []
    cuda = _evaluate_as(1, 2, log)
    models = [i for i, e in enumerate(log) if e[0] == "model"]
    routed = [e for e in log if e[0] == "route"]
    assert len(models) > 2 and routed and {e[1] for e in routed} == {0}  # the last rank's spill goes to rank 0
    inside = log[models[0]:models[-1] + 1]
    assert ("to host", True) not in inside, [e for e in inside if e[0] != "model"]  # no blocking copy in the loop
    assert all(not blocking for kind, *rest in log if kind == "to host" for blocking in rest)
    assert cuda.synchronized == 0 and cuda.events_synchronized == 1  # one wait, after the loop
    assert len([e for e in log if e[0] == "to host"]) == len(routed)  # one copy per window routed


class _WeightCasts(TorchDispatchMode):
    """Counts the casts of model weights (Parameters) to a lower precision: one kernel launch each on a GPU."""

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default) and isinstance(args[0], torch.nn.Parameter):
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            self.count += dtype in (torch.bfloat16, torch.float16)
        return func(*args, **(kwargs or {}))


def _autocast_entries(monkeypatch) -> list:
    """Every ``torch.autocast`` entered (enabled), by device type, in order."""
    entries: list = []
    real_enter = torch.autocast.__enter__

    def enter(self):
        if self._enabled:
            entries.append(self.device)
        return real_enter(self)

    monkeypatch.setattr(torch.autocast, "__enter__", enter)
    return entries


def test_inference_in_bf16_enters_autocast_once_per_pass_and_casts_each_weight_once(monkeypatch):
    """The host's work per batch on a GPU: the first GPU calls timed our model phase at 6.1 ms of host time per
    batch against 4.9 ms for MONAI's whole pass. Two costs per batch came from here: autocast entered around each
    batch, and every weight cast to bf16 again for every batch. Now one autocast covers the pass and the model runs
    with gradients off outside inference mode, where autocast keeps its bf16 copy of each weight from one batch to
    the next (torch keeps no such copies under ``inference_mode``, however autocast is entered): each weight is
    cast once per pass. The entries are counted on fake CUDA; the casts on the CPU, whose autocast shares the
    cache's code (fake CUDA cannot run the cached cast: it records an autograd node, which needs a real device).
    Before: one entry and one cast of every weight per batch."""
    def make():
        return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 1))

    image = torch.rand(1, 2, 40, 52)  # 12 windows of 16, 4 batches of 3
    entries = _autocast_entries(monkeypatch)
    log: list = []
    with fake_cuda(devices=1):
        model = _Logged(make().to("cuda"), log)
        out = sliding_window(image, model, roi=16, overlap=0.25, batch_size=3, precision="bf16", progress=False)
    assert out.shape == (1, 3, 40, 52) and len([e for e in log if e[0] == "model"]) == 4
    assert entries == ["cuda"], entries  # one autocast for the pass (before: one per batch)
    entries.clear()
    net = make()
    with _WeightCasts() as casts:  # the same pass on the CPU, real values
        host = sliding_window(image, net, roi=16, overlap=0.25, batch_size=3, precision="bf16", progress=False)
    weights = len(list(net.parameters()))
    assert entries == ["cpu"] and casts.count == weights, (casts.count, weights)  # before: 4 batches x 4 weights
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same bits as the model under one autocast
        for_each = sliding_window(image, net, roi=16, overlap=0.25, batch_size=3, precision="fp32", progress=False)
    assert torch.equal(host, for_each)
