"""``multigpu plan``: how many GPUs of which type, how long and what it costs, before renting them (in the launcher).

    multigpu plan train layers=32 hidden=4096 ffn=14336 arch=llama heads=32 kv_heads=8 vocab=128256 seq=8192 \\
        batch=2 strategy=fsdp ac=selective --gpus H100-SXM,H200 --count 8,16,32 --items 1e12 --deadline 7d
    multigpu plan runs/bench/20261129-0710 --gpus A100-80GB,H100-SXM --steps 100000 --prices prices.yaml

Pieces: :mod:`~multigpu.plan.catalog` (GPU types and links, each figure sourced; the user's prices),
:mod:`~multigpu.plan.transformer` (a model description: FLOPs, bytes, collectives, memory),
:mod:`~multigpu.plan.model` (one step on a cluster: roofline, alpha-beta, overlap, memory fit),
:mod:`~multigpu.plan.measured` (a bench or run folder carried to other GPUs), :mod:`~multigpu.plan.planner`
(the options, the best, the assumptions), :mod:`~multigpu.plan.cases` (the published figures it is checked
against). The collectives are priced by :func:`multigpu.bench.predict.comm_time`, the model of
``multigpu bench --predict``.
"""

from multigpu.plan.catalog import load_catalog, load_prices
from multigpu.plan.planner import DescribedJob, Size, make_plan, parse_duration
from multigpu.plan.transformer import ModelSpec

__all__ = ["DescribedJob", "ModelSpec", "Size", "load_catalog", "load_prices", "make_plan", "parse_duration"]
