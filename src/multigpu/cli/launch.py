"""``multigpu launch``: start a script on every selected device (runs in the launcher).

    multigpu launch --gpus all train.py --lr 3e-4
    multigpu launch --nproc-per-node 2 examples/hello.py        # 2 CPU ranks where there is no GPU
    multigpu launch --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 train.py
"""

from __future__ import annotations

import argparse

from multigpu.errors import ConfigError

HELP = "run a script on every selected GPU (or CPU ranks) through torchrun's agent"


def _nproc(text: str) -> int | str:
    """``N``, ``auto``, or torchrun's ``gpu`` (one per GPU) and ``cpu`` (one per core, on the CPU)."""
    if text in ("auto", "gpu", "cpu"):
        return text
    from multigpu.cli import positive_int

    return positive_int(text)


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher flags, shared by every command that launches (launch, train, sim, ...)."""
    from multigpu.cli import add_flag, non_negative_int, positive_float, positive_int

    g = parser.add_argument_group("launch")
    add_flag(g, "--gpus", metavar="all|N|I,J", help="GPUs to use: all, the first N, or indices such as 0,2")
    add_flag(g, "--nproc-per-node", type=_nproc, default="auto", metavar="N|auto|gpu|cpu",
             help="workers on this node (default auto: one per selected GPU, else 1; gpu: one per GPU; "
                  "cpu: one per core, on the CPU)")
    add_flag(g, "--cpu", action="store_true", help="run every rank on the CPU (gloo), even with GPUs")
    add_flag(g, "--nnodes", type=positive_int, default=1, help="number of machines (default 1)")
    add_flag(g, "--node-rank", type=non_negative_int, default=0, help="this machine's index in [0, nnodes)")
    add_flag(g, "--rdzv-endpoint", default="localhost:0", metavar="HOST:PORT",
             help="rendezvous store address, the same on every node (default localhost:0: a free port, one node)")
    add_flag(g, "--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
             help="extra c10d rendezvous setting, repeatable (e.g. is_host=false)")
    add_flag(g, "--run-id", default=None, help="job id shared by all nodes")
    add_flag(g, "--standalone", action="store_true", help="single node with a free port (same as the default endpoint)")
    add_flag(g, "--max-restarts", type=non_negative_int, default=0, help="restart the worker group up to K times")
    add_flag(g, "--isolate-devices", action="store_true",
             help="each worker sees only its GPU (CUDA/QD/TI_VISIBLE_DEVICE(S), EGL_DEVICE_ID)")
    add_flag(g, "--allow-cpu-ranks", action="store_true",
             help="ranks beyond the GPU count run on the CPU (hybrid job on gloo)")
    add_flag(g, "--share-gpus", action="store_true",
             help="more ranks than GPUs share them round-robin (each pinned to its GPU); collectives over gloo")
    add_flag(g, "--log-dir", default=None, help="folder for each worker's stdout/stderr and error file")
    add_flag(g, "--timeout-s", type=positive_float, default=None, help="collective timeout in seconds")
    add_flag(g, "--stall-timeout-s", type=positive_float, default=None,
             help="end the job when a rank makes no progress (no collective, no step) for this long")
    add_flag(g, "--threads", type=positive_int, default=None, help="CPU threads per rank (default cores // nproc)")
    add_flag(g, "--profile", action="store_true",
             help="torch.profiler trace per rank for a window of steps, into the run directory")
    from multigpu.cli.aliases import add_alias_flags

    add_alias_flags(g)
    add_flag(g, "--profile-steps", type=_profile_window, default=(1, 1, 3), metavar="WAIT,WARMUP,ACTIVE",
             help="the profiler's window of steps (default 1,1,3)")
    add_flag(g, "--sample-interval-s", type=_seconds_or_zero, default=1.0, metavar="S",
             help="seconds between device samples (CPU, memory, GPUs) in the run directory; 0: off (default 1)")


def _profile_window(text: str) -> tuple[int, int, int]:
    from multigpu.errors import ConfigError
    from multigpu.monitor.profile import parse_window

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


def config_from_args(args: argparse.Namespace):
    """LaunchConfig from the parsed launcher flags."""
    from multigpu.cli.aliases import translate
    from multigpu.launch.config import LaunchConfig

    translate(args)
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
        node_rank=args.node_rank,
        rdzv_endpoint=endpoint,
        rdzv_conf=rdzv_conf,
        run_id=args.run_id,
        max_restarts=args.max_restarts,
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
    )
    from multigpu.launch.rendezvous import check_endpoint, secret_from_env

    check_endpoint(cfg.rdzv_endpoint, nnodes=cfg.nnodes, node_rank=cfg.node_rank, rdzv_conf=cfg.rdzv_conf)
    secret_from_env(cfg.nnodes)  # several nodes need a shared secret: refused here, before anything is written
    return cfg


def add_target_args(parser: argparse.ArgumentParser, *, metavar: str = "script.py",
                    help: str = "the script (or, with -m, the module) to run") -> None:
    """``[-m] target [args...]``, shared by every command that runs a user's script (launch, bench, verify)."""
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", metavar=metavar, help=help)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("launch", help=HELP, description=HELP)
    add_launch_flags(parser)
    add_target_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.launch.agent import launch

    launch(config_from_args(args), args.target, args.args, module=args.module)
    return 0
