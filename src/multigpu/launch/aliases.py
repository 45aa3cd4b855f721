"""Flags of torchrun and ``accelerate launch``, accepted beside ours (runs in the launcher).

People arrive with commands they already type. Every launching command takes
these spellings; each is translated to ours, and the equivalent is printed
once, so the next command can use it::

    multigpu launch --master-addr node0 --master-port 29400 --nnodes 2 --node-rank 1 train.py
    # multigpu: --master-addr node0 --master-port 29400 is --rdzv-endpoint node0:29400 here
    multigpu launch --num-processes 4 --num-machines 2 --machine-rank 0 --main-process-ip node0 train.py
    # multigpu: --num-processes 4 --num-machines 2 is --nproc-per-node 2 --nnodes 2 here (accelerate counts all machines)

torchrun: ``--master-addr``/``--master-port`` (static rendezvous: here c10d at that
address), ``--rdzv-backend c10d|static``, ``--rdzv-id``, ``--nproc-per-node
gpu|cpu|auto|N`` (``--standalone`` and ``--node-rank`` are ours too).
accelerate: ``--num-processes``, ``--num-machines``, ``--machine-rank``,
``--main-process-ip``, ``--main-process-port``, ``--gpu-ids``,
``--mixed-precision no|fp16|bf16`` (the workload's ``precision``; for a script,
``ACCELERATE_MIXED_PRECISION`` as ``accelerate launch`` sets it), ``--multi-gpu`` (accepted; it is the
default here). torchrun's ``--tee``, ``--redirects`` and ``--local-ranks-filter`` are real flags of ours
(:mod:`multigpu.cli.launch`) with torchrun's meaning.
"""

from __future__ import annotations

import argparse
import sys

from multigpu.cmdline import add_flag
from multigpu.errors import ConfigError

__all__ = ["add_alias_flags", "translate"]

_SUPPRESS = argparse.SUPPRESS


def add_alias_flags(group) -> None:
    """The other launchers' flags, hidden from ``--help`` (the README lists them)."""
    for name, dest in [("--master-addr", "alias_master_addr"), ("--master-port", "alias_master_port"),
                       ("--rdzv-backend", "alias_rdzv_backend"), ("--rdzv-id", "alias_rdzv_id"),
                       ("--num-processes", "alias_num_processes"), ("--num-machines", "alias_num_machines"),
                       ("--machine-rank", "alias_machine_rank"), ("--main-process-ip", "alias_main_ip"),
                       ("--main-process-port", "alias_main_port"), ("--gpu-ids", "alias_gpu_ids"),
                       ("--mixed-precision", "alias_mixed_precision")]:
        add_flag(group, name, dest=dest, default=None, help=_SUPPRESS)
    add_flag(group, "--multi-gpu", dest="alias_multi_gpu", action="store_true", help=_SUPPRESS)


def _whole(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"{flag} {text} is invalid; valid: a whole number >= {minimum}")
    return value


def translate(args: argparse.Namespace, *, say=None) -> list[str]:
    """Rewrite the other launchers' flags on ``args`` into ours (in place); returns what was said, once each."""
    said: list[str] = []
    get = lambda name: getattr(args, name, None)  # noqa: E731
    if get("alias_rdzv_backend") not in (None, "c10d", "static"):
        raise ConfigError(f"--rdzv-backend {get('alias_rdzv_backend')} is not supported; valid: c10d (static is "
                          "taken as c10d at the same address)")
    host = get("alias_master_addr") or get("alias_main_ip")
    port = get("alias_master_port") or get("alias_main_port")
    if host or port:
        if args.rdzv_endpoint not in ("localhost:0", None):
            raise ConfigError("give the rendezvous address once: --rdzv-endpoint, or --master-addr/--master-port")
        port = _whole("--master-port", port, 0) if port is not None else 29500
        args.rdzv_endpoint = f"{host or 'localhost'}:{port}"
        said.append(f"{'--master-addr/--master-port' if get('alias_master_addr') or get('alias_master_port') else '--main-process-ip/--main-process-port'}"
                    f" is --rdzv-endpoint {args.rdzv_endpoint} here")
    if get("alias_rdzv_id"):
        args.run_id = get("alias_rdzv_id")
        said.append(f"--rdzv-id is --run-id {args.run_id} here")
    if get("alias_num_machines"):
        args.nnodes = _whole("--num-machines", get("alias_num_machines"), 1)
        said.append(f"--num-machines is --nnodes {args.nnodes} here")
    if get("alias_machine_rank"):
        args.node_rank = _whole("--machine-rank", get("alias_machine_rank"), 0)
        said.append(f"--machine-rank is --node-rank {args.node_rank} here")
    if get("alias_num_processes"):
        total = _whole("--num-processes", get("alias_num_processes"), 1)
        args.nnodes = args.nnodes or 1
        if total % args.nnodes:
            raise ConfigError(f"--num-processes {total} (all machines) does not split over --num-machines "
                              f"{args.nnodes}; valid: a multiple of {args.nnodes}")
        args.nproc_per_node = total // args.nnodes
        said.append(f"--num-processes {total} is --nproc-per-node {args.nproc_per_node} here "
                    "(accelerate counts the processes of all machines)")
    if get("alias_gpu_ids"):
        ids = get("alias_gpu_ids")
        args.gpus = "all" if ids == "all" else (ids if "," in ids else f"{ids},")
        said.append(f"--gpu-ids is --gpus {args.gpus} here")
    if get("alias_mixed_precision"):
        choice = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(get("alias_mixed_precision"))
        if choice is None:
            raise ConfigError(f"--mixed-precision {get('alias_mixed_precision')!r} is invalid; valid: no, fp16, bf16")
        args.mixed_precision = choice
        said.append(f"--mixed-precision is precision={choice} here")
    if get("alias_multi_gpu"):
        said.append("--multi-gpu is what multigpu does anyway (one worker per selected GPU); it changes nothing")
    for line in said:
        (say or _say)(line)
    return said


def _say(line: str) -> None:
    print(f"multigpu: {line}", file=sys.stderr, flush=True)
