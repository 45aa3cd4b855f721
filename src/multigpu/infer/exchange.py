"""The second phase of ``sliding_window``: what one rank needs of another's windows (inside each rank; call on
all ranks).

Each output voxel belongs to the rank holding its lowest covering window (:mod:`multigpu.infer.layout`). That
rank has added its own windows in order and needs only the outputs of the later windows (of later ranks) that
touch its voxels, its **spill**: a band about one window row deep. Those are sent to it once (``gather`` per
owner), and it adds them in window order.

**The last rank goes first.** Its voxels need no other rank's windows (every window covering them is its own),
so as soon as it has evaluated it sends rank 0 its blended voxels, slab by slab, point to point; and it sends
each window that an earlier rank's voxels need right after its windows (on a GPU their copies to the host start
without blocking in the model loop and the host waits for them once, after it). A receiver thread on ranks
0..last-1 takes these while they still evaluate their own windows, so on 2 ranks nothing is exchanged after
rank 0's last window but the wait for that thread. Rank 0 has the most windows (shards give lower ranks the
extra batch), so the exchange leaves its critical path. These messages are CPU tensors over gloo
(``group.exchange_group``: a group beside NCCL on GPU jobs): a receive over NCCL would make the CUDA stream the
main thread's kernels share wait until the last rank sends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from multigpu.errors import ConfigError
from multigpu.infer.evaluate import OutputSpec, RankWindows
from multigpu.infer.layout import OutputLayout
from multigpu.infer.stats import EXCHANGE_STATS, timed_phase
from multigpu.runtime import collectives, group

__all__ = ["WindowExchange"]


class WindowExchange:
    """The exchange between ranks: the later windows each owner's voxels need (its *spill*), and the last rank's
    early path. The last rank's voxels need no other rank's windows, so it sends its spill as it evaluates and
    then its blended voxels to rank 0, point to point; a receiver thread on ranks 0..last-1 takes them while
    those ranks still evaluate. The others' spill goes by ``gather`` per owner once every rank is done."""

    def __init__(self, rank_windows: RankWindows, layout: OutputLayout):
        self.rank_windows, self.layout = rank_windows, layout
        self.rank, self.world_size = rank_windows.rank, rank_windows.world_size
        self.distributed = rank_windows.distributed
        self.last = self.world_size - 1
        # ranks 0..last-1 take the last rank's data on a thread; in a group of one rank 0 is the last and takes its own
        self.receivers = range(max(self.last, 1))
        # CPU tensors over gloo: a receive never makes a CUDA stream wait (group.exchange_group); all ranks call it
        self.pg = group.exchange_group() if self.distributed else None
        self.spill: dict[int, list[tuple[int, torch.Tensor]]] = {r: [] for r in range(self.world_size)}
        """Owner -> the ``(window index, weighted output)`` it needs from this rank, for the gather."""
        self.last_rank_spill: list[tuple[int, torch.Tensor]] = []  # the last rank's windows, received point to point
        self.outputs = None  # rank 0: (result, views), allocated by the receiver thread or after the exchange
        self._receiver: threading.Thread | None = None
        self._receiver_error: BaseException | None = None
        self._sending: list[collectives.Pending] = []  # the last rank's sends under way

    def sends_early(self, owner: int) -> bool:
        """Whether ``owner``'s voxels reach rank 0 point to point, right after its windows (the last rank's do)."""
        return self.distributed and owner == self.last

    def route(self, owner: int, index: int, y: torch.Tensor) -> None:
        """Window ``index``'s output ``y``, which rank ``owner``'s voxels need: the last rank sends it now (the
        owner's receiver thread takes it), the others keep a copy for the exchange after evaluation. Either way a
        copy: ``y`` may be a view of a buffer the next batch overwrites (``RankWindows._weighted``), and a send
        in flight reads its tensor until it completes."""
        if self.rank == self.last:
            EXCHANGE_STATS["spill"] = EXCHANGE_STATS.get("spill", 0) + y.numel() * y.element_size()
            self._sending += [collectives.isend(torch.tensor([index]), owner, pg=self.pg),
                              collectives.isend(y.clone(), owner, pg=self.pg)]
        else:
            self.spill[owner].append((index, y.clone()))

    # ---- the last rank, point to point: its spill and its voxels go out as soon as it has them ------------

    def send_owned(self) -> None:
        """On the last rank: end every owner's spill, then send rank 0 its own blended voxels, slab by slab.

        Its voxels need nothing from any other rank (every window covering them is
        its own), so they are final now, while rank 0 may still be evaluating.
        """
        spec = self.rank_windows.spec
        for r in self.receivers:
            self._sending.append(collectives.isend(torch.tensor([-1]), r, pg=self.pg))
        z = spec.scale if spec is not None else ()
        header = [spec.channels, *z] if spec is not None else []
        self._sending.append(collectives.isend(torch.tensor(header, dtype=torch.int64), 0, pg=self.pg))
        for pending in self._sending:  # the window outputs they hold are freed as they arrive
            pending.wait()
        self._sending = []
        if spec is None:
            return  # no windows here: it owns no voxel
        previous = None  # at most two slabs in flight: one blended while the other travels
        for image in range(len(self.rank_windows.images)):
            canvas = self.rank_windows.canvases.get(image)
            for rows in self.layout.slabs(image, z):
                blocks = self.layout.blocks(image, rows, z)
                if any(o == self.rank for _, o in blocks):
                    flat = self.layout.flat_blocks(blocks, canvas, self.rank, spec.channels)
                    pending = collectives.isend(flat, 0, pg=self.pg)
                    if previous is not None:
                        previous.wait()
                    previous = pending
        if previous is not None:
            previous.wait()

    def start_receiving(self, allocate: Callable[[OutputSpec], tuple]) -> None:
        """On ranks 0..last-1: a thread takes the last rank's spill (and, on rank 0, its voxels) while this rank
        evaluates its own windows. ``allocate(spec)`` gives rank 0's output (result, per-image views)."""
        def receive():
            try:
                with torch.inference_mode():
                    self._receive_early(allocate)
            except BaseException as exc:  # re-raised by finish_receiving on the main thread
                self._receiver_error = exc

        self._receiver = threading.Thread(target=receive, name="multigpu-infer-receive", daemon=True)
        self._receiver.start()

    def _receive_early(self, allocate) -> None:
        while True:
            index = int(collectives.recv(self.last, pg=self.pg).item())
            if index < 0:
                break
            self.last_rank_spill.append((index, collectives.recv(self.last, pg=self.pg)))
        if self.rank != 0:
            return
        header = collectives.recv(self.last, pg=self.pg).tolist()
        if not header:
            return
        spec = OutputSpec(header[0], tuple(header[1:]), self.rank_windows.acc_dtype)
        self.outputs = allocate(spec)
        for image, out in enumerate(self.outputs[1]):
            view = self.layout.view(image, out, spec.scale)
            for rows in self.layout.slabs(image, spec.scale):
                boxes = [box for box, o in self.layout.blocks(image, rows, spec.scale) if o == self.last]
                if boxes:
                    self.layout.place(image, collectives.recv(self.last, pg=self.pg), boxes, view)

    def finish_receiving(self) -> None:
        if self._receiver is not None:
            self._receiver.join()
            self._receiver = None
        if self._receiver_error is not None:
            raise self._receiver_error

    # ---- after every rank's windows -------------------------------------------------------------------

    def agree_on_output(self) -> None:
        """Every rank learns the output channels and scale (a rank without windows never ran the model)."""
        spec = self.rank_windows.spec
        specs = collectives.all_gather([spec] if spec is not None else []) if self.distributed else (
            [spec] if spec is not None else [])
        if not specs:
            raise ConfigError("there are no windows to evaluate")
        if any(s != specs[0] for s in specs):
            raise ConfigError(f"ranks disagree on the model's output (channels, scale, dtype): {specs}")
        if spec is None:
            self.rank_windows.set_output_spec(specs[0])

    def exchange_spill(self) -> None:
        """Send each owner the later windows that touch its voxels; it adds them in window order."""
        if not self.distributed:
            return
        with timed_phase("spill"):
            EXCHANGE_STATS["spill"] = EXCHANGE_STATS.get("spill", 0) + sum(
                y.numel() * y.element_size() for r in self.spill.values() for _, y in r)
            for dst in range(self.world_size - 2):  # ranks 1..last-1 spill through gathers (none on 2 ranks)
                received = collectives.gather(self.spill.pop(dst), dst=dst)
                if received is None:
                    continue
                for index, y in received:  # rank order, then window order within a rank = window order
                    self.rank_windows.add_received(index, y)
            # the last rank's windows are the latest of all: added after the others keeps window order
            for index, y in self.last_rank_spill:
                self.rank_windows.add_received(index, y)
            self.last_rank_spill = []
