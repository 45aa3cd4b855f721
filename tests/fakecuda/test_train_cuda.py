"""Training on fake CUDA: device placement, RNG state across GPU counts, SLURM placement, FSDP's placement.

What a CPU-only machine can prove (see :mod:`multigpu.testing.fakecuda`): where every tensor of the
trainer's forward and loss lives on ``cuda``, where the optimizer puts its state, that a checkpoint's
RNG state moves between hosts with different GPU counts, that one GPU per SLURM task is ``cuda:0``,
and that FSDP is never handed a whole model on the GPU. What waits for a GPU: backward (the autograd
engine needs a real CUDA device guard), NCCL itself, and the numbers (loss values, speed).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.parallel import DistributedDataParallel

import multigpu as mg
from multigpu.checkpoint import CheckpointStore, PerRank
from multigpu.checkpoint.rng import RngState
from multigpu.config import from_dict
from multigpu.runtime import context
from multigpu.runtime.context import RunContext
from multigpu.runtime.device import DeviceFacts, select_device
from multigpu.runtime.env import read_placement
from multigpu.testing.fakecuda import fake_cuda, fake_group, is_fake
from multigpu.train import make_optimizer
from multigpu.train.checkpoint import restore_rng
from multigpu.train.data import stdlib_text
from multigpu.train.job import TrainJobConfig
from multigpu.train.loader import to_device
from multigpu.train.nano import gpt
from multigpu.train.trainer import Trainer

SLURM_TASK = {"SLURM_PROCID": "15", "SLURM_LOCALID": "7", "SLURM_NTASKS": "16", "SLURM_NODEID": "1",
              "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}


def _state(value: int) -> torch.Tensor:
    return torch.full((16,), value, dtype=torch.uint8)


def test_slurm_task_with_one_gpu_computes_on_it():
    """``srun --ntasks-per-node=8 --gpus-per-task=1``: each task sees one GPU and SLURM_LOCALID 0..7."""
    placement = read_placement(SLURM_TASK)
    with fake_cuda(devices=1, tensors=False):
        facts = DeviceFacts.probe(RunContext())
        assert (placement.local_rank, facts.cuda_count) == (7, 1)
        assert select_device("auto", placement.local_rank, facts) == torch.device("cuda", 0)
    # two GPUs per task but local rank 7: which one is not ours to guess
    with fake_cuda(devices=2, tensors=False), pytest.raises(mg.DeviceError, match="local_rank 7 has no GPU: this "
                                                                                  "process sees 2 CUDA device"):
        select_device("auto", placement.local_rank, DeviceFacts.probe(RunContext()))


@pytest.mark.parametrize("saved_on,restored_on", [(8, 1), (1, 8)])
def test_checkpoint_rng_state_moves_between_gpu_counts(tmp_path, saved_on, restored_on):
    """Saved by a rank on cuda:5 of 8 visible GPUs and resumed on a one-GPU host (``--isolate-devices``), and the
    reverse: the rank's own GPU's generator comes back on the rank's own GPU, no other GPU's is touched."""
    mg.init(backend="cpu")  # one rank: the store's gather and broadcast are identities
    store = CheckpointStore(tmp_path)
    with fake_cuda(devices=saved_on, tensors=False) as cuda:
        torch.cuda.set_device(saved_on - 1)
        cuda.rng_states[saved_on - 1] = _state(42)
        path = store.save(1, {"rng": PerRank(RngState())})
    with fake_cuda(devices=restored_on, tensors=False) as cuda:
        torch.cuda.set_device(restored_on - 1)
        store.load(path, {"rng": PerRank(RngState())})
        assert list(cuda.rng_states) == [restored_on - 1] and torch.equal(cuda.rng_states[restored_on - 1], _state(42))


def test_rng_state_of_older_checkpoints_with_every_gpu():
    """Checkpoints written before held every visible GPU's state: the rank's own device index is taken."""
    with fake_cuda(devices=1, tensors=False) as cuda:
        restore_rng({"python": __import__("random").getstate(), "torch": torch.get_rng_state(),
                     "cuda": [_state(i) for i in range(8)]})
        assert list(cuda.rng_states) == [0] and torch.equal(cuda.rng_states[0], _state(0))


# ------------------------------------------------------------------------------------------ the trainer
TINY = {"steps": 2, "batch_size": 2, "block_size": 16, "eval_every": 0, "checkpoint_every": 0, "sample_chars": 0,
        "prefetch": 0}  # prefetch copies on a side CUDA stream, which a CPU build cannot fake: the direct path


@pytest.fixture(scope="module")
def text():
    return stdlib_text(block_size=16)[0]


def _trainer(text, **overrides) -> Trainer:
    cfg = from_dict(TrainJobConfig, {**TINY, **overrides})
    model = gpt(block_size=16, vocab_size=text.vocab_size, n_layer=2, n_head=2, n_embd=32)
    return Trainer(model, make_optimizer(model, cfg), text, config=cfg)


@contextlib.contextmanager
def _rank_of(monkeypatch, rank: int, world_size: int):
    """This process as rank ``rank`` of ``world_size`` on one node: the fake process group, and the variables
    torchrun sets, so ``mg.init`` reads that placement (it joins the group that is already there)."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size,
                        "MASTER_ADDR": "localhost", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(name, str(value))
    context.set_current(RunContext(pg_backend="gloo"))  # no NCCL beside it: the fake group is the only one
    with fake_group(rank, world_size):
        yield
    mg.shutdown()


def test_trainer_forward_loss_and_optimizer_state_on_cuda_alone(text):
    """World size 1 (no DDP): the model, the batch, the loss, the clipped norm and Adam's moments on cuda:0. The
    optimizer built on the host keeps its parameters through the trainer's move, and GPT's embedding stays tied
    to its output head, as a real ``.to("cuda")`` keeps both (the fake made new Parameters before)."""
    trainer = _trainer(text)
    held = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    with fake_cuda(devices=1):
        assert mg.init(seed=0).device == torch.device("cuda", 0)
        trainer.setup()
        assert {(p.device, is_fake(p)) for p in trainer.module.parameters()} == {(torch.device("cuda", 0), True)}
        assert {id(p) for p in held} == {id(p) for p in trainer.module.parameters()}  # the same objects
        assert trainer.module.head.weight is trainer.module.tok.weight  # tied
        with unset_fake_temporarily():  # the sampler and the dataset hold real host data
            cpu_batch, _ = next(trainer.batches._tagged)
        batch = to_device(cpu_batch, trainer.env.device)  # what the stream does to each batch
        loss = trainer.loss_fn(trainer.model, batch)
        assert loss.device == torch.device("cuda", 0) and loss.shape == ()
        for p in trainer.module.parameters():  # what backward would leave (backward itself waits for a GPU)
            p.grad = torch.zeros_like(p)
        assert trainer._clip_gradients().device == torch.device("cuda", 0)
        trainer.scaler.step(trainer.optimizer)
        moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert moments and {m.device for m in moments} == {torch.device("cuda", 0)}
        trainer.batches.close()
    mg.shutdown()


def test_compile_comes_after_ddp(text, monkeypatch):
    """DDP's documented order: ``torch.compile(DDP(model))``, so DDP's hooks and buckets see the real parameters
    and its all-reduce overlaps the compiled graph. Rank 3 of 8 (CPU: DDP cannot wrap fake tensors)."""
    trainer = _trainer(text, compile=True)
    compiled = []
    with _rank_of(monkeypatch, 3, 8):
        mg.init(backend="cpu")
        with mock.patch("torch.compile", lambda model, *a, **k: compiled.append(model) or model):
            trainer.setup()
        trainer.batches.close()
    assert len(compiled) == 1 and isinstance(compiled[0], DistributedDataParallel) and compiled[0] is trainer.strategy.ddp


@pytest.mark.parametrize("gpus", [8, 0], ids=["cuda", "cpu"])
def test_fsdp_shards_from_the_host_on_a_mesh_of_the_rank_device(text, monkeypatch, gpus):
    """strategy=fsdp, rank 3 of 8: ``fully_shard`` gets each block on the host (never the whole model on the GPU:
    it moves one block at a time and keeps this rank's shard), compiled per block first, over a mesh of this
    rank's own device type (FSDP's default would be CUDA's whenever a GPU is visible, even on a CPU rank).
    ``fully_shard`` and ``init_device_mesh`` are recorded, not run: neither runs on fake tensors."""
    trainer = _trainer(text, strategy="fsdp", precision="bf16", compile=True)
    events = []

    def fully_shard(module, **kwargs):
        events.append(("shard", type(module).__name__, {p.device for p in module.parameters()}, kwargs.get("mesh")))
        return module

    patches = [mock.patch("torch.distributed.fsdp.fully_shard", fully_shard),
               mock.patch("torch.distributed.device_mesh.init_device_mesh", lambda kind, shape: (kind, shape)),
               mock.patch("torch.nn.Module.compile", lambda module, *a, **k: events.append(("compile", module)))]
    with _rank_of(monkeypatch, 3, 8), fake_cuda(devices=gpus, tensors=gpus > 0), contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        device = mg.init().device
        trainer.setup()
        trainer.batches.close()
    assert device == (torch.device("cuda", 3) if gpus else torch.device("cpu"))
    blocks = list(trainer.module.blocks)
    assert events[:2] == [("compile", blocks[0]), ("compile", blocks[1])]
    host, mesh = {torch.device("cpu")}, (device.type, (8,))
    assert events[2:] == [("shard", "_Block", host, mesh), ("shard", "_Block", host, mesh), ("shard", "GPT", host, mesh)]


def test_adamw_is_fused_on_gpu_ranks_only(text):
    """On CUDA the trainer steps AdamW with its fused kernel (one kernel for every parameter, as nanoGPT's loop
    does), and makes ``GradScaler`` hand it the inf check (no host sync per fp16 step); on CPU ranks the
    optimizer is left as built. Before: AdamW was built without ``fused=True`` and stayed so on CUDA."""
    trainer = _trainer(text)
    with fake_cuda(devices=1):
        mg.init(seed=0)
        trainer.setup()
        groups = trainer.optimizer.param_groups
        assert [g["fused"] for g in groups] == [True, True] and trainer.optimizer._step_supports_amp_scaling
        for p in trainer.module.parameters():
            p.grad = torch.zeros_like(p)
        trainer.scaler.step(trainer.optimizer)  # the fused kernel, on cuda:0
        steps = [s["step"] for s in trainer.optimizer.state.values()]
        assert steps and {t.device for t in steps} == {torch.device("cuda", 0)}  # fused keeps its step on the GPU
        trainer.batches.close()
    mg.shutdown()
    cpu = _trainer(text)
    mg.init(backend="cpu")
    cpu.setup()
    assert [g["fused"] for g in cpu.optimizer.param_groups] == [None, None]
    cpu.batches.close()
    mg.shutdown()


@pytest.mark.parametrize("strategy,world_size,extra", [("fsdp", 2, {}), ("hsdp", 4, {"hsdp_shard_size": 2})])
def test_fsdp_steps_for_real_and_reports_its_communication_as_not_measured(text, monkeypatch, strategy, world_size,
                                                                           extra):
    """The real ``init_device_mesh`` and ``fully_shard`` on CPU ranks of the fake group (rank 1 of 2, a 2x2 mesh
    under hsdp): the trainer's whole step runs, forward, backward with FSDP's hooks, clipping over DTensor
    shards and the optimizer step. FSDP2's all-gathers and reduce-scatters are torch's own, timed by nobody:
    the summary says "not measured" (None, shown as "—"), never a share of 0 and an imbalance computed as if
    communication had been measured. Before: comm_share 0.0 and imbalance 1.0.
    (On fake CUDA ``fully_shard`` cannot run: it sets ``param.data`` to its fake CUDA shard, which a CPU build
    cannot dispatch; the test below records its calls instead.)"""
    trainer = _trainer(text, strategy=strategy, **extra)
    with _rank_of(monkeypatch, 1, world_size):
        mg.init(backend="cpu")
        trainer.setup()
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in trainer.module.parameters())
        for _ in range(3):
            metrics = trainer.train_step()
        assert metrics["grad_norm"].shape == ()
        summary = trainer.close()
    assert summary["comm_share"] is None and summary["imbalance"] is None
    assert summary["per_rank"][0]["comm_s"] is None


class _Reduced:
    """The fake group's all-reduce, with the future a real group's work has (the reduced tensors): DDP's comm
    hook reads it. The fake backend completes its futures with nothing."""

    def __init__(self, tensor: torch.Tensor):
        self.future = torch.futures.Future()
        self.future.set_result([tensor])

    def get_future(self):
        return self.future

    def wait(self, *args):
        return True


def test_the_trainers_whole_step_with_backward_runs_on_a_device_that_is_not_the_cpu(text, monkeypatch):
    """Fake CUDA cannot run backward (see multigpu.testing.fakecuda); the ``meta`` device can, through the real
    autograd engine, and refuses a CPU tensor meeting its data as a GPU does. So the trainer's real
    ``train_step`` runs with this rank's device ``meta`` (rank 1 of 2, the fake group): the forward, the
    backward with DDP's reducer and its timed comm hook firing per bucket, clipping the global norm, the
    non-finite guard's update, AdamW's step and the schedule, with every gradient and moment on the device. Not run here: DDP's built-in NCCL hook (C++; needs NCCL) and fp16's GradScaler step (it reads
    whether a gradient was inf on the host: meta has no values); run_all.sh's smoke step runs both on a GPU."""
    import dataclasses

    from multigpu.runtime import collectives, group

    trainer = _trainer(text, grad_clip=1.0, prefetch=2)
    real_all_reduce = torch.distributed.all_reduce

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        work = real_all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _Reduced(tensor) if async_op else work

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    # DDP checks every rank's parameter shapes by reading a tensor on the parameters' device: no values on meta
    monkeypatch.setattr("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *a: None)
    # a move to meta makes new Parameters unless swapped in place (a move to a GPU keeps them: the optimizer's)
    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    with _rank_of(monkeypatch, 1, 2):
        env = mg.init(backend="cpu")
        monkeypatch.setattr(group, "_ENV", dataclasses.replace(env, device=torch.device("meta")))
        trainer.setup()
        assert isinstance(trainer.model, DistributedDataParallel) and trainer.strategy.comm is not None
        before = collectives.traffic().get("all_reduce", (0, 0))[0]
        metrics = trainer.train_step()  # once: DDP rebuilds its buckets before the second (copying data meta lacks)
        assert collectives.traffic()["all_reduce"][0] > before  # the comm hook ran, bucket by bucket
        meta = torch.device("meta")
        assert metrics["grad_norm"].device == metrics["loss"].device == meta
        moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert len(moments) == 2 * len(list(trainer.module.parameters())) and {m.device for m in moments} == {meta}
        assert trainer.meter.comm_times[-1] is not None  # the hook's all-reduces were timed
        logits = trainer.module(torch.zeros(1, 16, dtype=torch.long, device=meta))
        logits = logits[0] if isinstance(logits, tuple) else logits
        with pytest.raises(RuntimeError, match="expected device meta but got cpu"):  # as a GPU refuses it
            logits.backward(torch.ones(logits.shape))
        trainer.batches.close()
