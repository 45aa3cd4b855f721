"""What to change in a script that assumed something about the job it runs in (runs in the launcher).

:func:`assumption_hint` reads a failed rank's message and traceback and, for the failures that come from
a script written for one machine or one world size, says in one line what to change. Scripts brought from
torchrun, accelerate or Lightning often hard-code CUDA (``torch.cuda.set_device(rank)``), NCCL
(``init_process_group("nccl")``) or their world size (Fabric's ``devices=2``); under ``multigpu`` the launcher
decides all three.
"""

from __future__ import annotations

import re

__all__ = ["assumption_hint"]

_NO_CUDA = re.compile(
    r"_cuda_setDevice|_cuda_getDeviceCount|Torch not compiled with CUDA enabled|No CUDA GPUs are available"
    r"|Found no NVIDIA driver|CUDA driver initialization failed"
)
_NO_NCCL = re.compile(r"doesn't have NCCL built in|ProcessGroupNCCL is only supported with GPUs|NCCL is not available")
_BAD_ORDINAL = re.compile(r"invalid device ordinal", re.IGNORECASE)
_FIXED_DEVICES = re.compile(r"You set `devices=(\d+)`.*?does not match the world size \((\d+)\)", re.DOTALL)
_WORLD_SIZE_ASSERT = re.compile(r"world[ _]?size", re.IGNORECASE)
_DIVIDES_ASSERT = re.compile(r"assert\s+(\w+)\s*%\s*\w*world[ _]?size\w*\s*==\s*0", re.IGNORECASE)
_DEVICE_AS_STRING = re.compile(r"argument of type 'torch\.device' is not iterable|'torch\.device' object has no "
                               r"attribute '(startswith|split|replace|lower)'")
_DDP_DEVICE_IDS_ON_CPU = re.compile(r"DistributedDataParallel device_ids and output_device arguments only work.*"
                                    r"module parameters \{device\(type='cpu'\)\}")


def assumption_hint(text: str) -> str | None:
    """One line saying what to change when ``text`` (a rank's error and traceback) shows the script assumed
    CUDA or a world size the job does not have; None when it shows no such assumption."""
    if _NO_NCCL.search(text):
        return ("the script asks for NCCL, and this rank runs on the CPU (gloo): call init_process_group() without "
                "backend= (torch then takes gloo for CPU tensors and NCCL for CUDA ones), or mg.init() instead")
    if _NO_CUDA.search(text):
        return ("the script calls CUDA, and this rank has none (a CPU rank): use mg.device() (the rank's GPU, "
                "else the CPU; it needs no mg.init()) instead of torch.cuda.set_device / 'cuda:N' / "
                "device_ids=[local_rank], or run where the GPUs are")
    if _BAD_ORDINAL.search(text):
        return ("the script picked a GPU this rank cannot see: take the device from mg.device() (or "
                "LOCAL_RANK), not from the global rank or a fixed index")
    fixed = _FIXED_DEVICES.search(text)
    if fixed:
        return (f"the script fixes devices={fixed.group(1)}, but this job has {fixed.group(2)} rank(s): "
                "let the launcher decide: Fabric(devices=int(os.environ['LOCAL_WORLD_SIZE'])), the processes it "
                "started on this node (with num_nodes= the --nnodes of a multi-node job); devices='auto' is the "
                "GPU count, right only when every visible GPU has a rank (on CPU ranks multigpu makes it the "
                "processes per node)")
    if _DEVICE_AS_STRING.search(text):
        return ("the script uses its device as a string ('cuda' in device): use str(mg.device()) ('cuda:1', "
                "'cpu'); mg.device() is a torch.device")
    if _DDP_DEVICE_IDS_ON_CPU.search(text):
        return ("DDP's device_ids name a GPU, and this rank's model is on the CPU: write DDP(model) (DDP then uses "
                "the device the model is on: the rank's GPU, or the CPU)")
    divides = _DIVIDES_ASSERT.search(text) if "AssertionError" in text else None
    if divides:
        name = divides.group(1)
        return (f"the script needs {name} to be a multiple of the number of ranks: give it one (--{name}=2 at 2 "
                "ranks for nanoGPT's configurator), or run on a number of ranks that divides it")
    if "AssertionError" in text and _WORLD_SIZE_ASSERT.search(text):
        return ("the script asserts its world size: read it from the environment (WORLD_SIZE, mg.world_size()) "
                "instead, since multigpu bench and verify run it at several")
    return None
