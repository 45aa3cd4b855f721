"""The training batch stream on fake CUDA: pinning, the prefetch thread's side stream, and datasets on the GPU.

Under :func:`~multigpu.testing.fakecuda.fake_cuda` a ``DataLoader`` with ``pin_memory=True`` pins as on a GPU
machine, pinning a CUDA tensor raises as torch does, and data written on one stream and used on another that
has not waited for it raises (:class:`~multigpu.testing.fakecuda.StreamOrderError`): on a GPU, a batch read
before its copy has landed.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from multigpu.testing.fakecuda import StreamOrderError, fake_cuda, is_fake
from multigpu.train.loader import BatchStream


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(64, dtype=torch.float32).reshape(32, 2), torch.arange(32))


class _OnGpu(Dataset):
    """A dataset that returns its samples on the GPU (it moved its data there itself)."""

    def __init__(self):
        self.x = torch.zeros(32, 2, device="cuda")

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum()


@pytest.mark.parametrize("prefetch", [2, 0])
def test_batches_come_pinned_and_prefetched_on_a_side_stream_the_step_waits_for(prefetch):
    """prefetch=2 (the default): a thread copies each pinned host batch to cuda:1 on a side stream of cuda:1 and
    records an event there; the consumer's stream waits for it before the step uses the batch."""
    data = _data()
    with fake_cuda(devices=2) as cuda:
        torch.cuda.set_device(1)
        stream = BatchStream(data, 4, device=torch.device("cuda", 1), prefetch=prefetch)
        try:
            for _ in range(3):
                (x, y), state = next(stream)
                assert x.device == y.device == torch.device("cuda", 1) and is_fake(x)
                (x * 2 + 1).sum()  # the step's use, on the current stream of cuda:1
        finally:
            stream.close()
        assert cuda.pinned >= 3 * 2  # both tensors of every batch, before the copy
        side = [s for s in cuda.streams_made if s.device == torch.device("cuda", 1)]
        assert len(side) == (1 if prefetch else 0)


def test_a_batch_used_before_the_consumer_waited_for_its_copy_raises():
    """What the prefetch test above would catch: the same batch, its event never waited on."""
    data = _data()
    with fake_cuda(devices=1):
        stream = BatchStream(data, 4, device=torch.device("cuda", 0), prefetch=2)
        try:
            batch, event, _ = stream._queue.get(timeout=30)  # as the thread left it, before __next__ waits
            with pytest.raises(StreamOrderError, match="has not waited"):
                batch[0] + 1
            torch.cuda.current_stream().wait_event(event)
            batch[0] + 1
        finally:
            stream.close()


@pytest.mark.parametrize("prefetch", [2, 0])
def test_a_dataset_that_returns_gpu_tensors_is_not_pinned(prefetch):
    """A dataset whose samples are on the GPU already: nothing to pin (torch refuses to pin a CUDA tensor).
    Before: the DataLoader was always built with pin_memory=True on CUDA ranks, and crashed on the first batch."""
    with fake_cuda(devices=1) as cuda:
        stream = BatchStream(_OnGpu(), 4, device=torch.device("cuda", 0), prefetch=prefetch)
        try:
            (x, y), _ = next(stream)
            assert x.device.type == "cuda" and x.shape == (4, 2)
        finally:
            stream.close()
        assert cuda.pinned == 0


def test_pin_memory_false_turns_pinning_off(tmp_path):
    """``pin_memory: false`` (``--set pin_memory=false``): host batches are copied from ordinary memory."""
    from multigpu.config import from_dict
    from multigpu.train.job import TrainJobConfig

    assert from_dict(TrainJobConfig, {}).pin_memory is True
    cfg = from_dict(TrainJobConfig, {"pin_memory": False})
    with fake_cuda(devices=1) as cuda:
        stream = BatchStream(_data(), 4, device=torch.device("cuda", 0), prefetch=2, pin_memory=cfg.pin_memory)
        try:
            (x, _), _ = next(stream)
            assert x.device.type == "cuda"
        finally:
            stream.close()
        assert cuda.pinned == 0
