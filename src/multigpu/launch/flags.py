"""The launcher flags and their translation into a :class:`LaunchConfig` (runs in the launcher).

Every command that launches takes them (``multigpu launch``, each workload,
``bench``, ``verify``): :func:`add_launch_flags` adds them to a parser and
:func:`config_from_args` reads them back, with the other launchers' spellings
translated (:mod:`multigpu.launch.aliases`). Argument building lives here,
below both the command line and the job layer, so neither imports the other.
"""

from __future__ import annotations

import argparse
import sys

from multigpu.argtypes import non_negative_int, positive_float, positive_int
from multigpu.cmdline import add_flag
from multigpu.errors import ConfigError
from multigpu.launch.aliases import add_alias_flags, apply_accelerate_config, translate
from multigpu.launch.config import LaunchConfig

__all__ = ["add_dry_run_flags", "add_launch_flags", "config_from_args"]


def _nproc(text: str) -> int | str:
    """``N``, ``auto``, or torchrun's ``gpu`` (one per GPU) and ``cpu`` (one per core, on the CPU)."""
    if text in ("auto", "gpu", "cpu"):
        return text
    return positive_int(text)


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher flags, shared by every command that launches (launch, train, sim, ...)."""
    g = parser.add_argument_group("launch")
    add_flag(g, "--gpus", metavar="all|N|I,J", help="GPUs to use: all, the first N, or indices such as 0,2")
    add_flag(g, "--nproc-per-node", type=_nproc, default="auto", metavar="N|auto|gpu|cpu",
             help="workers on this node (default auto: one per selected GPU, else 1; gpu: one per GPU; "
                  "cpu: one per core, on the CPU)")
    add_flag(g, "--cpu", action="store_true", help="run every rank on the CPU (gloo), even with GPUs")
    add_flag(g, "--nnodes", type=_nnodes, default=None, metavar="N|MIN:MAX",
             help="number of machines (default 1, or what SLURM/PET_*/LSF/mpirun says); MIN:MAX, as torchrun: an "
                  "elastic job that goes on when nodes are lost (down to MIN) and grows when they join (up to MAX)")
    add_flag(g, "--node-rank", type=non_negative_int, default=None,
             help="this machine's index in [0, nnodes) (default 0, or the scheduler's)")
    add_flag(g, "--rdzv-endpoint", default=None, metavar="HOST:PORT",
             help="rendezvous store address, the same on every node (default localhost:0: a free port, one node; "
                  "under a scheduler, its first node)")
    add_flag(g, "--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
             help="extra c10d rendezvous setting, repeatable (e.g. is_host=false)")
    add_flag(g, "--run-id", default=None, help="job id shared by all nodes")
    add_flag(g, "--standalone", action="store_true", help="single node with a free port (same as the default endpoint)")
    add_flag(g, "--max-restarts", type=non_negative_int, default=None,
             help="restart the worker group up to K times (default 0; 3 with --nnodes MIN:MAX, which restarts it "
                  "at the new size when a node is lost)")
    add_flag(g, "--isolate-devices", action="store_true",
             help="each worker sees only its GPU (CUDA/QD/TI_VISIBLE_DEVICE(S), EGL_DEVICE_ID)")
    add_flag(g, "--allow-cpu-ranks", action="store_true",
             help="ranks beyond the GPU count run on the CPU (hybrid job on gloo)")
    add_flag(g, "--share-gpus", action="store_true",
             help="more ranks than GPUs share them round-robin (each pinned to its GPU); collectives over gloo")
    add_flag(g, "--log-dir", default=None, help="folder for each worker's stdout/stderr and error file")
    add_flag(g, "--tee", default=None, metavar="0-3|R:S,...",
             help="torchrun's --tee: streams also written to log files (1 stdout, 2 stderr, 3 both; per rank 0:3,1:0)")
    add_flag(g, "--redirects", default=None, metavar="0-3|R:S,...",
             help="torchrun's --redirects: streams written to log files only (same values as --tee)")
    add_flag(g, "--local-ranks-filter", type=_ranks, default=None, metavar="R,R",
             help="show only these local ranks' output here (the others: log files only)")
    add_flag(g, "--print-sbatch", action="store_true",
             help="print a ready sbatch script for this command (nodes from --nnodes) and exit")
    add_flag(g, "--print-k8s", action="store_true",
             help="print a Kubeflow PyTorchJob manifest for this command (nodes from --nnodes) and exit")
    add_flag(g, "--rank-prefix", action="store_true",
             help="prefix each line a worker prints with [rank<R>]: (as with --log-dir)")
    add_flag(g, "--timeout-s", type=positive_float, default=None, help="collective timeout in seconds")
    add_flag(g, "--stall-timeout-s", type=positive_float, default=None,
             help="end the job when a rank makes no progress (no collective, no step) for this long")
    add_flag(g, "--threads", type=positive_int, default=None, help="CPU threads per rank (default cores // nproc)")
    add_flag(g, "--profile", action="store_true",
             help="torch.profiler trace per rank for a window of steps, into the run directory")
    add_alias_flags(g)
    add_flag(g, "--profile-steps", type=_profile_window, default=(1, 1, 3), metavar="WAIT,WARMUP,ACTIVE",
             help="the profiler's window of steps (default 1,1,3)")
    add_flag(g, "--sample-interval-s", type=_seconds_or_zero, default=1.0, metavar="S",
             help="seconds between device samples (CPU, memory, GPUs) in the run directory; 0: off (default 1)")


def add_dry_run_flags(parser: argparse.ArgumentParser) -> None:
    """``--dry-run --world-size N``: the workload commands' dry run at any size (:mod:`multigpu.jobs.dryrun`)."""
    g = parser.add_argument_group("dry run (nothing spawned, nothing written)")
    add_flag(g, "--dry-run", action="store_true",
             help="check the job as one rank of --world-size N, shard its work and step once on fake tensors; "
                  "print per-rank memory and every config error a real run would hit, then exit")
    add_flag(g, "--world-size", type=positive_int, default=None, metavar="N", help="the dry run's ranks (e.g. 64)")
    add_flag(g, "--dry-run-rank", type=non_negative_int, default=0, metavar="R", help="the rank examined (default 0)")
    add_flag(g, "--device-memory", default=None, metavar="SIZE|GPU",
             help="memory of one device, e.g. 80GB, 40GiB, or a GPU name (H100, A100-40GB, L4, ...): does it fit?")


ELASTIC_RESTARTS = 3
"""``--max-restarts`` of an elastic job (``--nnodes MIN:MAX``) that gives none: a lost node makes the survivors'
ranks fail, and torch's agent re-forms the group at the new size only where a restart is left."""


def _nnodes(text: str) -> int | tuple[int, int]:
    """``N`` or torchrun's ``MIN:MAX``."""
    low, sep, high = text.partition(":")
    if not sep:
        return positive_int(text)
    try:
        return positive_int(low), positive_int(high)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; valid: a whole number of nodes, or MIN:MAX such as "
                                         "1:4") from None


def split_nnodes(args: argparse.Namespace) -> None:
    """``--nnodes MIN:MAX`` into ``args.nnodes`` (MAX) and ``args.min_nodes`` (MIN; None for one number).
    Idempotent: every reader of ``args.nnodes`` calls it first."""
    if isinstance(getattr(args, "nnodes", None), tuple):
        args.min_nodes, args.nnodes = args.nnodes
        if args.min_nodes > args.nnodes:
            raise ConfigError(f"--nnodes {args.min_nodes}:{args.nnodes} is invalid; valid: MIN:MAX with MIN <= MAX, "
                              "e.g. 1:4")
    elif not hasattr(args, "min_nodes"):
        args.min_nodes = None


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; valid: local ranks such as 0 or 0,1") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; valid: local ranks >= 0 such as 0 or 0,1")
    return ranks


def _profile_window(text: str) -> tuple[int, int, int]:
    from multigpu.argtypes import parse_window

    try:
        return parse_window(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--profile-steps ")) from None


def _seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is invalid; valid: seconds >= 0 (0: off)")
    return value


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """LaunchConfig from the parsed launcher flags."""
    split_nnodes(args)
    apply_accelerate_config(args)  # before anything reads the accelerate flags it may fill in
    placement = _scheduler_placement(args)
    translate(args)
    _apply_placement(args, placement)
    nproc = args.nproc_per_node
    if nproc == "cpu":  # torchrun: one worker per core, on the CPU
        from multigpu.runtime.env import cpu_count

        nproc, args.cpu = cpu_count(), True
    elif nproc == "gpu":
        from multigpu.launch.devices import HostFacts

        if HostFacts.probe().gpu_count == 0:
            raise ConfigError("--nproc-per-node gpu asks for one worker per GPU, but this machine has no visible "
                              "GPU; valid here: --nproc-per-node N or cpu")
        nproc = "auto"
    rdzv_conf = {}
    for item in args.rdzv_conf:
        for pair in item.split(","):
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ConfigError(f"--rdzv-conf {item!r} must look like key=value, e.g. is_host=false")
            rdzv_conf[key.strip()] = value.strip()
            _check_rdzv_value(key.strip(), value.strip())
    endpoint = args.rdzv_endpoint
    if args.standalone:
        if args.nnodes != 1:
            raise ConfigError(f"--standalone runs one node, but --nnodes is {args.nnodes}; drop one of them")
        endpoint = "localhost:0"
    cfg = LaunchConfig(
        nproc_per_node=nproc,
        gpus=args.gpus,
        cpu=args.cpu,
        nnodes=args.nnodes,
        min_nodes=args.min_nodes,
        node_rank=args.node_rank,
        rdzv_endpoint=endpoint,
        rdzv_conf=rdzv_conf,
        run_id=args.run_id,
        max_restarts=args.max_restarts if args.max_restarts is not None else
        ELASTIC_RESTARTS if args.min_nodes is not None and args.min_nodes < args.nnodes else 0,
        isolate_devices=args.isolate_devices,
        allow_cpu_ranks=args.allow_cpu_ranks,
        share_gpus=args.share_gpus,
        log_dir=args.log_dir,
        timeout_s=args.timeout_s,
        stall_timeout_s=args.stall_timeout_s,
        threads=args.threads,
        profile=args.profile,
        profile_steps=args.profile_steps,
        sample_interval_s=args.sample_interval_s,
        mixed_precision=getattr(args, "mixed_precision", None),
        tee=args.tee,
        redirects=args.redirects,
        local_ranks_filter=args.local_ranks_filter,
        rank_prefix=args.rank_prefix,
    )
    _say_clamped(args)
    if cfg.log_dir:
        from multigpu.launch.rundir import check_writable

        check_writable(cfg.log_dir, "--log-dir")
    from multigpu.launch.rendezvous import check_endpoint, secret_from_env

    try:
        check_endpoint(cfg.rdzv_endpoint, nnodes=cfg.nnodes, node_rank=cfg.node_rank, rdzv_conf=cfg.rdzv_conf)
    except ConfigError as exc:  # e.g. node 0's endpoint resolves to loopback: the other nodes must not wait for it
        from multigpu.launch.nodes import tell_others

        tell_others(cfg, exc)
        raise
    secret_from_env(cfg.nnodes)  # several nodes need a shared secret: refused here, before anything is written
    return cfg


_RDZV_COUNTS = {"join_timeout": (1, 600), "last_call_timeout": (0, 30), "close_timeout": (1, 30),
                "heartbeat_timeout": (1, 30), "read_timeout": (1, 60), "keep_alive_interval": (1, 5),
                "keep_alive_max_attempt": (1, 3)}
"""The ``--rdzv-conf`` keys torch's c10d rendezvous reads as whole numbers (seconds; attempts for the last), with
the least valid value and torch's default; torch's own error for another value came only as the job started."""


_RDZV_KEYS = (*_RDZV_COUNTS, "is_host", "store_type")
"""Every ``--rdzv-conf`` key the rendezvous reads (torch's c10d backend, as :mod:`multigpu.launch.stores` runs it);
another is a misspelling, which torch ignored without a word."""


def _check_rdzv_value(key: str, value: str) -> None:
    if key not in _RDZV_KEYS:
        import difflib

        close = difflib.get_close_matches(key, _RDZV_KEYS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"--rdzv-conf {key}={value}: unknown key {key!r}{hint}; valid keys: {', '.join(_RDZV_KEYS)}")
    if key not in _RDZV_COUNTS:
        return
    low, default = _RDZV_COUNTS[key]
    try:
        ok = int(value) >= low
    except ValueError:
        ok = False
    if not ok:
        what = "attempts" if key == "keep_alive_max_attempt" else "seconds"
        raise ConfigError(f"--rdzv-conf {key}={value} is invalid; valid: a whole number of {what}, {low} or more "
                          f"(default {key}={default})")


def _scheduler_placement(args: argparse.Namespace):
    """The scheduler's word on this node (SLURM, PET_*, LSF, Open MPI), or None; its node count also divides
    accelerate's --num-processes (translate) when --nnodes is not given."""
    import os

    from multigpu.launch.schedulers import from_environment

    placement = from_environment(os.environ)
    if args.nnodes is None and placement is not None and getattr(args, "alias_num_machines", None) is None:
        args.nnodes = placement.nnodes
    return placement


def _apply_placement(args: argparse.Namespace, placement) -> None:
    """Fill the flags not given by hand from the scheduler; a flag that contradicts it is one line."""
    # no --node-rank on several nodes: torchrun's elastic form, where the rendezvous numbers the nodes (None)
    defaults = {"nnodes": 1, "node_rank": 0, "rdzv_endpoint": "localhost:0"}
    if placement is None:
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, None if name == "node_rank" and args.nnodes > 1 else value)
        return
    if placement.min_nodes is not None and args.min_nodes is None and args.nnodes in (None, placement.nnodes):
        args.min_nodes = placement.min_nodes  # an elastic PyTorchJob: PET_NNODES=MIN:MAX
    said = {"nnodes": placement.nnodes, "node_rank": placement.node_rank, "rdzv_endpoint": placement.rdzv_endpoint}
    for name, value in said.items():
        given = getattr(args, name)
        if value is None:
            setattr(args, name, defaults[name] if given is None else given)
        elif given is None:
            setattr(args, name, value)
        elif name == "nnodes" and args.min_nodes is not None and args.min_nodes <= value <= given:
            if placement.scheduler == "SLURM":  # an allocation never grows: the nodes SLURM gave are the most
                args.nnodes = value
            continue  # an elastic job started on some of the nodes it may use
        elif given != value:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {given} contradicts {placement.scheduler}, which says {value} for this node; "
                              f"drop {flag} or run outside the scheduler's step")
    if placement.nproc_per_node is not None and args.nproc_per_node == "auto":
        args.nproc_per_node = placement.nproc_per_node


def scheduler_file(args: argparse.Namespace, ours: list[str], script_args: list[str] = ()) -> str | None:
    """The sbatch script or PyTorchJob manifest asked for by ``--print-sbatch``/``--print-k8s``, else None.

    ``ours``: the command line up to the script (the command and our flags); ``script_args``: what follows the
    script, which is the script's and is written out verbatim. Resources come from the job's flags only.
    """
    if not (getattr(args, "print_sbatch", False) or getattr(args, "print_k8s", False)):
        return None
    from multigpu.launch import schedulers

    if args.print_sbatch and args.print_k8s:
        raise ConfigError("--print-sbatch and --print-k8s each print a whole file; pass one of them")
    flag = "--print-sbatch" if args.print_sbatch else "--print-k8s"
    resources = job_resources(args, flag)
    what = getattr(args, "target", None) or next((a for a in ours if not a.startswith("-")), "job")
    workload = getattr(args, "_workload", None)
    run_folder = None if workload is None or getattr(args, "run_dir", None) else \
        workload.resumable and getattr(args, "resume", None) is None
    # the user's own --run-dir: kept, and continued by a requeued or restarted start (the folder is used by then)
    resume = workload is not None and bool(getattr(args, "run_dir", None)) and workload.resumable and \
        getattr(args, "resume", None) is None
    # a pre-emption's SIGTERM ends the step in progress with its checkpoint, where the workload asks for it
    takes = workload is not None and any(f.key == "checkpoint_on_interrupt" for f in workload.flags)
    stop_flag = "--checkpoint-on-interrupt" if takes and not getattr(args, "flag__checkpoint_on_interrupt", None) \
        else None
    if args.print_sbatch:
        # a folder per job id only where a requeued start continues it: a workload that cannot resume would find
        # its folder used on the next start
        return schedulers.sbatch_script(ours, script_args, what=what, resources=resources,
                                        run_folder=True if run_folder else None, stop_flag=stop_flag, resume=resume)
    return schedulers.pytorchjob_manifest(ours, script_args, what=what, resources=resources, run_folder=run_folder,
                                          stop_flag=stop_flag, resume=resume)


def job_resources(args: argparse.Namespace, flag: str):
    """GPUs, workers and cores per node from the job's flags: a job file asks the scheduler for what the job
    needs on its nodes, not for what this machine has."""
    from multigpu.launch.devices import parse_gpus
    from multigpu.launch.schedulers import JobResources

    split_nnodes(args)

    nproc, cpu = args.nproc_per_node, args.cpu or args.nproc_per_node == "cpu"
    if getattr(args, "alias_num_processes", None):  # accelerate's count of all machines' processes
        from multigpu.launch.aliases import translate

        translate(args, say=lambda line: None)
        nproc = args.nproc_per_node
    if isinstance(nproc, int):
        workers, said = nproc, "from --nproc-per-node"
    elif args.gpus not in (None, "all") and not cpu:
        workers, said = len(parse_gpus(args.gpus, 1 << 16)), "from --gpus"
    elif cpu and nproc == "auto":
        workers, said = 1, ""
    else:
        given = {"auto": "--gpus all" if args.gpus == "all" else None}.get(nproc, f"--nproc-per-node {nproc}")
        what = f"{given} does not say" if given else "nothing says"
        raise ConfigError(f"{flag}: {what} how many GPUs each node of the job has (this machine's count is no "
                          "guide to the cluster's); valid: --nproc-per-node N (one worker per GPU) or --gpus N, or "
                          "--cpu --nproc-per-node N for CPU ranks")
    if cpu and nproc == "cpu":
        raise ConfigError(f"{flag}: --nproc-per-node cpu (one worker per core) depends on the node's cores; valid: "
                          "--cpu --nproc-per-node N")
    nnodes = args.nnodes or (int(args.alias_num_machines) if str(getattr(args, "alias_num_machines", "") or "")
                             .isdecimal() else 1)
    cpus = args.threads * workers if args.threads else None
    asked = False
    if not cpu and said == "from --nproc-per-node" and flag == "--print-sbatch":
        # --nproc-per-node N means GPUs where the node has them, CPU ranks where it has none (as the launcher
        # reads it on the node): SLURM says which its nodes are; a GPU request sbatch refuses on a CPU cluster
        import os

        from multigpu.launch.schedulers import slurm_gpus_per_node

        per_node = slurm_gpus_per_node(os.environ)
        if per_node == 0:
            cpu, said, asked = True, "the cluster's nodes have no GPUs (sinfo says): CPU ranks", True
        elif per_node is None:
            said = "from --nproc-per-node; SLURM (sinfo) could not be asked here whether the nodes have GPUs: " \
                   "on a cluster without, delete this line or pass --cpu"
    return JobResources(nnodes=nnodes, workers=workers, gpus=0 if cpu else workers, cpus=cpus, said=said,
                        asked_slurm=asked,
                        min_nodes=args.min_nodes, max_restarts=args.max_restarts if args.max_restarts is not None
                        else ELASTIC_RESTARTS if args.min_nodes is not None and args.min_nodes < nnodes else 0)


def _say_clamped(args: argparse.Namespace) -> None:
    """One line when ``--timeout-s`` or ``--stall-timeout-s`` was longer than the clocks count (the config clamps it:
    :data:`multigpu.runtime.context.MAX_TIMEOUT_S`)."""
    from multigpu.runtime.context import MAX_TIMEOUT_S

    given = [f"{flag} {value:g}" for flag, value in (("--timeout-s", args.timeout_s),
                                                     ("--stall-timeout-s", args.stall_timeout_s))
             if value is not None and value > MAX_TIMEOUT_S]
    if given:
        print(f"multigpu: note: {' and '.join(given)} {'are' if len(given) > 1 else 'is'} clamped to "
              f"{MAX_TIMEOUT_S:g} s (31 years, no timeout in effect): torch's and gloo's clocks overflow past about "
              "9.2e+09 s", file=sys.stderr, flush=True)
