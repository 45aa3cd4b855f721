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
default here), ``--config-file`` (an ``accelerate config`` YAML or JSON file: the keys above are read from it
where the command line does not give them, ``use_cpu``/``distributed_type: MULTI_CPU`` as ``--cpu``, and one
line names what it holds that this launcher does not run: FSDP, DeepSpeed, Megatron, TPU settings). torchrun's ``--tee``, ``--redirects`` and ``--local-ranks-filter`` are real flags of ours
(:mod:`multigpu.cli.launch`) with torchrun's meaning.
"""

from __future__ import annotations

import argparse
import sys

from multigpu.cmdline import add_flag
from multigpu.errors import ConfigError

__all__ = ["ACCELERATE_FLAGS", "add_alias_flags", "apply_accelerate_config", "translate"]

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
    add_flag(group, "--config-file", dest="alias_config_file", default=None, help=_SUPPRESS)


ACCELERATE_FLAGS = {
    "num_processes": ("alias_num_processes", "--num-processes", "nproc_per_node", "auto"),
    "num_machines": ("alias_num_machines", "--num-machines", "nnodes", None),
    "machine_rank": ("alias_machine_rank", "--machine-rank", "node_rank", None),
    "main_process_ip": ("alias_main_ip", "--main-process-ip", "rdzv_endpoint", None),
    "main_process_port": ("alias_main_port", "--main-process-port", "rdzv_endpoint", None),
    "gpu_ids": ("alias_gpu_ids", "--gpu-ids", "gpus", None),
    "mixed_precision": ("alias_mixed_precision", "--mixed-precision", "mixed_precision", None),
    "rdzv_backend": ("alias_rdzv_backend", "--rdzv-backend", None, None),
}
"""An accelerate config file's keys that are accelerate flags we take: (our alias's dest, the flag, our own flag's
dest that gives the same, its value when not given)."""

_ACCELERATE_DEFAULTS = {"num_machines": 1, "machine_rank": 0, "gpu_ids": "all", "rdzv_backend": "static"}
"""accelerate's own defaults for keys of :data:`ACCELERATE_FLAGS`: taken as not given (ours are the same)."""

_ACCELERATE_QUIET = {"compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no",
                     "enable_cpu_affinity": False, "main_training_function": "main", "same_network": True,
                     "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False,
                     "dynamo_config": {}, "tpu_name": None, "tpu_zone": None, "commands": None, "command_file": None}
"""Keys ``accelerate config`` writes that change nothing at these values (not named as ignored)."""

_RUN_ELSEWHERE = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "MEGATRON_LM": "Megatron-LM", "XLA": "XLA/TPU", "TPU": "TPU"}


def _config_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def apply_accelerate_config(args: argparse.Namespace, *, say=None) -> list[str]:
    """Read ``--config-file`` (``accelerate config``'s file) into the accelerate flags the command line left unset
    (the command line wins, as under ``accelerate launch``); returns what was said (one line per kind). The flags
    it fills in are translated quietly by :func:`translate` (``args.from_config``)."""
    path = getattr(args, "alias_config_file", None)
    args.from_config = set()
    if not path:
        return []
    data = _read_accelerate_config(path)
    cpu = data.get("use_cpu") is True or data.get("distributed_type") == "MULTI_CPU"
    taken, ignored = [], []
    for key, value in data.items():
        if key in ACCELERATE_FLAGS:
            dest, flag, ours, unset = ACCELERATE_FLAGS[key]
            if (value is None or value == _ACCELERATE_DEFAULTS.get(key) or (key == "gpu_ids" and cpu)
                    or getattr(args, dest, None) is not None or (ours and getattr(args, ours, unset) != unset)):
                continue  # not set in the file, accelerate's default, or given on the command line
            if key == "mixed_precision" and value not in ("no", "fp16", "bf16"):
                raise ConfigError(f"accelerate config {path}: mixed_precision {value!r} is not run here; valid: no, "
                                  "fp16, bf16")
            setattr(args, dest, _config_text(value))
            args.from_config.add(dest)
            taken.append(f"{key} {_config_text(value)}")
        elif key in ("use_cpu", "distributed_type") and cpu:
            if not args.cpu:
                args.cpu = True
                taken.append(f"{key} {_config_text(value)} (--cpu)")
        elif key == "distributed_type":
            if value in _RUN_ELSEWHERE:
                ignored.append(f"distributed_type {value} (this launcher runs the script as it is, without "
                               f"accelerate's {_RUN_ELSEWHERE[value]} plugin settings)")
        elif (key not in _ACCELERATE_QUIET or _ACCELERATE_QUIET[key] != value) and value not in (None, {}, []):
            ignored.append(key)
    said = [f"accelerate config {path}: taken: {', '.join(taken) or 'nothing beyond the defaults'}"]
    if ignored:
        said.append(f"accelerate config {path}: ignored {', '.join(ignored)}")
    for line in said:
        (say or _say)(line)
    return said


def _read_accelerate_config(path: str) -> dict:
    """The file's mapping (YAML, or JSON as accelerate also writes); one line when it cannot be."""
    import json
    from pathlib import Path

    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config-file {path}: no such file; give the accelerate config file (`accelerate config` "
                          "writes ~/.cache/huggingface/accelerate/default_config.yaml)")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--config-file {path} cannot be read as an accelerate config: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path} is not an accelerate config (a mapping of keys such as "
                          "num_processes, mixed_precision)")
    return data


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
    said: list[tuple[str, str]] = []  # (line, the alias it translates)
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
        said.append((f"{'--master-addr/--master-port' if get('alias_master_addr') or get('alias_master_port') else '--main-process-ip/--main-process-port'}"
                     f" is --rdzv-endpoint {args.rdzv_endpoint} here", "alias_main_ip"))
    if get("alias_rdzv_id"):
        args.run_id = get("alias_rdzv_id")
        said.append((f"--rdzv-id is --run-id {args.run_id} here", "alias_rdzv_id"))
    if get("alias_num_machines"):
        args.nnodes = _whole("--num-machines", get("alias_num_machines"), 1)
        said.append((f"--num-machines is --nnodes {args.nnodes} here", "alias_num_machines"))
    if get("alias_machine_rank"):
        args.node_rank = _whole("--machine-rank", get("alias_machine_rank"), 0)
        said.append((f"--machine-rank is --node-rank {args.node_rank} here", "alias_machine_rank"))
    if get("alias_num_processes"):
        total = _whole("--num-processes", get("alias_num_processes"), 1)
        args.nnodes = args.nnodes or 1
        if total % args.nnodes:
            raise ConfigError(f"--num-processes {total} (all machines) does not split over --num-machines "
                              f"{args.nnodes}; valid: a multiple of {args.nnodes}")
        args.nproc_per_node = total // args.nnodes
        said.append((f"--num-processes {total} is --nproc-per-node {args.nproc_per_node} here "
                     "(accelerate counts the processes of all machines)", "alias_num_processes"))
    if get("alias_gpu_ids"):
        ids = get("alias_gpu_ids")
        args.gpus = "all" if ids == "all" else (ids if "," in ids else f"{ids},")
        said.append((f"--gpu-ids is --gpus {args.gpus} here", "alias_gpu_ids"))
    if get("alias_mixed_precision"):
        choice = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(get("alias_mixed_precision"))
        if choice is None:
            raise ConfigError(f"--mixed-precision {get('alias_mixed_precision')!r} is invalid; valid: no, fp16, bf16")
        args.mixed_precision = choice
        said.append((f"--mixed-precision is precision={choice} here", "alias_mixed_precision"))
    if get("alias_multi_gpu"):
        said.append(("--multi-gpu is what multigpu does anyway (one worker per selected GPU); it changes nothing",
                     "alias_multi_gpu"))
    quiet = getattr(args, "from_config", set())
    said = [line for line, dest in said if dest not in quiet]
    for line in said:
        (say or _say)(line)
    return said


def _say(line: str) -> None:
    print(f"multigpu: {line}", file=sys.stderr, flush=True)
