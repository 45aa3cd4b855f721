"""One training or job step on a target cluster: compute by a roofline, communication by the alpha-beta model,
overlap, memory fit (pure; in the launcher).

    from multigpu.plan.model import Cluster, describe_step
    step = describe_step(spec, Cluster(gpu, count=16, network=catalog.link("ib-ndr")))
    step["step_s"], step["items_per_s"], step["memory"]["total"], step["fits"]

*Compute* (a model description): the matmul and attention FLOPs at :data:`MATMUL_EFFICIENCY` of the GPU's dense
peak at the job's precision (attention at the bf16 peak), plus the memory-bound bytes at
:data:`BANDWIDTH_EFFICIENCY` of its HBM bandwidth: a roofline with the two parts added (the kernels of a step run
one after another). *Communication*: the step's collectives (:meth:`ModelSpec.traffic`) priced by
:func:`multigpu.bench.predict.comm_time`, the same alpha-beta model ``multigpu bench --predict`` uses, inside a node
on the GPU's own link and across nodes on the network. *Overlap*: FSDP prefetches its all-gathers and reduces its
gradients while the next block computes, DDP all-reduces its buckets during the backward pass
(:data:`OVERLAP`): only communication beyond that shows in the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from multigpu.plan.catalog import Gpu, LinkSpec
from multigpu.plan.transformer import ModelSpec

__all__ = ["BANDWIDTH_EFFICIENCY", "MATMUL_EFFICIENCY", "OVERLAP", "Cluster", "describe_step", "net_of"]

MATMUL_EFFICIENCY = 0.398
"""The share of the dense peak a training step's matmuls and attention reach. The one fitted constant of the
description model, the same for every GPU and job: the geometric-mean fit over the published throughput cases of
:data:`multigpu.plan.cases.PUBLISHED` (the value that makes their mean log error zero, given every other rule).
``tests/unit/test_plan_validation.py`` recomputes the fit and fails if this constant no longer matches it, so it
cannot be tuned to one case. The figure is in line with published model-FLOPs utilizations of 33-41% for the
cases (torchtitan's and this project's H200 run), which count attention and recompute differently."""

BANDWIDTH_EFFICIENCY = 0.8
"""The share of HBM bandwidth the element-wise kernels reach: a stated assumption, not fitted (streaming kernels
such as a copy reach most of the peak; 0.8 is the usual planning figure)."""

OVERLAP = {"ddp": 2 / 3, "fsdp": 1.0, "hsdp": 1.0}
"""The share of a step's compute its communication can hide behind: DDP's all-reduce runs during the backward pass
(two thirds of the compute: backward costs twice the forward); FSDP's prefetched all-gathers and reduce-scatters
run during every block's compute."""


@dataclass(frozen=True)
class Cluster:
    """``count`` GPUs of one type, ``gpu.per_node`` to a node on the GPU's own link, nodes joined by ``network``."""

    gpu: Gpu
    count: int
    network: LinkSpec
    node_link: LinkSpec | None = None

    @property
    def nodes(self) -> int:
        return math.ceil(self.count / self.gpu.per_node)


def net_of(cluster: Cluster, node_link: LinkSpec, shards=None):
    """The :class:`multigpu.bench.predict.Net` of a cluster: the node link within a node, the network across;
    ``shards``: an HSDP job's ranks per replica at N (its ``:shard`` collectives run over those)."""
    from multigpu.bench.predict import Net

    if cluster.count <= cluster.gpu.per_node:
        return Net(node_link.link(), shards=shards)
    return Net(cluster.network.link(), node_link.link(), cluster.gpu.per_node, shards)


def compute_time(spec: ModelSpec, gpu: Gpu, count: int, efficiency: float = MATMUL_EFFICIENCY) -> dict[str, float]:
    """Seconds of one rank's compute per optimizer step, by part."""
    flops = spec.flops_per_token()
    moved = spec.bytes_per_token(count)
    tokens = spec.tokens_per_step
    matmul = flops["matmul"] / (gpu.peak(spec.precision) * efficiency) * tokens
    attention = flops["attention"] / (gpu.peak("bf16" if spec.precision == "fp8" else spec.precision) * efficiency) * tokens
    memory = sum(moved.values()) / (gpu.bandwidth * BANDWIDTH_EFFICIENCY) * tokens
    return {"matmul": matmul, "attention": attention, "memory": memory}


def describe_step(spec: ModelSpec, cluster: Cluster, catalog=None, efficiency: float = MATMUL_EFFICIENCY) -> dict[str, Any]:
    """One optimizer step of ``spec`` on ``cluster``: its parts, step time, throughput and memory fit."""
    from multigpu.bench.predict import comm_time
    from multigpu.plan.catalog import load_catalog

    catalog = catalog or load_catalog()
    node_link = cluster.node_link or catalog.link(cluster.gpu.node_link)
    parts = compute_time(spec, cluster.gpu, cluster.count, efficiency)
    compute = sum(parts.values())
    shards = spec._shards if spec.strategy == "hsdp" else None
    latency, bandwidth = comm_time(spec.traffic(cluster.count), cluster.count, net_of(cluster, node_link, shards))
    comm = latency + bandwidth
    hidden = OVERLAP[spec.strategy] * compute
    exposed = max(0.0, comm - hidden)
    step = compute + exposed
    memory = spec.memory_per_rank(cluster.count)
    have = cluster.gpu.memory_bytes
    return {"compute_s": compute, "parts_s": parts, "comm_s": comm, "latency_s": latency, "bandwidth_s": bandwidth,
            "exposed_comm_s": exposed, "step_s": step, "items_per_step": spec.tokens_per_step * cluster.count,
            "items_per_s": spec.tokens_per_step * cluster.count / step, "memory": memory,
            "memory_have": have, "fits": memory["total"] <= have,
            "bottleneck": "communication" if exposed > 0 else max(parts, key=parts.get)}
