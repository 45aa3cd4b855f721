"""The hardware catalog of ``multigpu plan`` and the user's prices (pure; in the launcher).

    from multigpu.plan.catalog import load_catalog, load_prices
    cat = load_catalog()                  # the packaged catalog.yaml: GPU types and links, each figure sourced
    h100 = cat.gpu("h100-sxm")            # names are case-insensitive; an unknown one lists the valid names
    prices = load_prices("prices.yaml")   # only from a file the user gives; never a default

A GPU's figures are its vendor's dense peaks (TFLOP/s per precision), its memory, HBM bandwidth, board power and
the link among the GPUs of one node; a figure without a source is absent, and asking for it is one line naming
what is missing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["HOST_CPU", "Catalog", "Gpu", "LinkSpec", "Prices", "load_catalog", "load_prices"]


@dataclass(frozen=True)
class LinkSpec:
    """A link as the catalog states it."""

    key: str
    name: str
    gbs: float
    """GB/s per GPU and direction."""
    alpha_us: float
    source: dict[str, str]

    def link(self):
        """The alpha-beta model's :class:`multigpu.bench.predict.Link`."""
        from multigpu.bench.predict import Link

        return Link(self.name, self.alpha_us * 1e-6, self.gbs * 1e9, f"catalog ({self.source.get('url', '')})")


@dataclass(frozen=True)
class Gpu:
    """One GPU type of the catalog."""

    key: str
    tflops: dict[str, float]
    memory_gb: float
    hbm_tbs: float
    tdp_w: float
    node_link: str
    per_node: int
    board_names: tuple[str, ...] = ()
    device_memory: str | None = None
    missing: str = ""
    sources: tuple[dict[str, str], ...] = field(default_factory=tuple)

    @property
    def memory_bytes(self) -> int:
        """What a job can fill: nvidia-smi's figure where the dry run's table (:data:`multigpu.jobs.dryrun.GPUS`) has it, else the vendor's."""
        if self.device_memory:
            from multigpu.jobs.dryrun import GPUS

            if self.device_memory in GPUS:
                return GPUS[self.device_memory]
        return int(self.memory_gb * 1e9)

    def peak(self, precision: str) -> float:
        """Dense FLOP/s at ``precision``; ConfigError where the catalog has no sourced figure."""
        if precision not in self.tflops:
            why = f" ({self.missing})" if self.missing else ""
            raise ConfigError(f"the catalog has no {precision} peak for {self.key}{why}; valid precisions for it: "
                              f"{', '.join(self.tflops)}")
        return self.tflops[precision] * 1e12

    @property
    def bandwidth(self) -> float:
        """HBM (or GDDR) bytes per second."""
        return self.hbm_tbs * 1e12


@dataclass(frozen=True)
class Catalog:
    gpus: dict[str, Gpu]
    links: dict[str, LinkSpec]

    def gpu(self, name: str) -> Gpu:
        key = _key(name)
        if key == "cpu":
            return HOST_CPU
        for gpu in self.gpus.values():
            if _key(gpu.key) == key or any(_key(b) == key for b in gpu.board_names):
                return gpu
        raise ConfigError(f"unknown GPU type {name!r}; valid: {', '.join(self.gpus)} (or cpu: this host's CPU ranks, "
                          "for a folder measured here)")

    def gpu_for_board(self, board: str) -> Gpu | None:
        """The type of a board as NVML / torch name it (``NVIDIA H100 80GB HBM3``); None when not in the catalog."""
        for gpu in self.gpus.values():
            if board.strip() in gpu.board_names:
                return gpu
        return None

    def link(self, name: str) -> LinkSpec:
        if name not in self.links:
            raise ConfigError(f"unknown link {name!r}; valid: {', '.join(self.links)}")
        return self.links[name]


HOST_CPU = Gpu(key="cpu", tflops={p: 1.0 for p in ("bf16", "fp16", "tf32", "fp32")}, memory_gb=0, hbm_tbs=0,
               tdp_w=0, node_link="loopback", per_node=1 << 20,
               missing="this host's CPU: its rates are measured, not catalogued",
               sources=({"url": "", "says": "this host, measured"},))
"""``--gpus cpu``: ranks on this host's CPU (a measured folder only: ``multigpu bench --predict``'s model of this
host, with the thread count carried by the CPU's measured roofline)."""


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where} is {value!r}; valid: a positive number")
    return float(value)


def parse_catalog(data: Any, where: str = "catalog") -> Catalog:
    """A catalog from its YAML's data; one line naming the first wrong entry."""
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict) or not isinstance(data.get("links"), dict):
        raise ConfigError(f"{where}: needs 'gpus' and 'links' mappings")
    links = {}
    for key, d in data["links"].items():
        links[key] = LinkSpec(key, str(d["name"]), _number(f"{where}: links.{key}.gbs", d["gbs"]),
                              _number(f"{where}: links.{key}.alpha_us", d["alpha_us"]), dict(d.get("source") or {}))
    gpus = {}
    for key, d in data["gpus"].items():
        if not d.get("sources"):
            raise ConfigError(f"{where}: gpus.{key} has no sources; every figure needs one")
        if d["node_link"] not in links:
            raise ConfigError(f"{where}: gpus.{key}.node_link {d['node_link']!r} is not a link; valid: {', '.join(links)}")
        gpus[key] = Gpu(key=key, tflops={p: _number(f"{where}: gpus.{key}.tflops.{p}", v) for p, v in d["tflops"].items()},
                        memory_gb=_number(f"{where}: gpus.{key}.memory_gb", d["memory_gb"]),
                        hbm_tbs=_number(f"{where}: gpus.{key}.hbm_tbs", d["hbm_tbs"]),
                        tdp_w=_number(f"{where}: gpus.{key}.tdp_w", d["tdp_w"]), node_link=d["node_link"],
                        per_node=int(d.get("per_node", 8)), board_names=tuple(d.get("board_names") or ()),
                        device_memory=d.get("device_memory"), missing=str(d.get("missing") or ""),
                        sources=tuple(d["sources"]))
    return Catalog(gpus, links)


@functools.cache
def load_catalog() -> Catalog:
    """The packaged catalog (``multigpu/plan/catalog.yaml``)."""
    import yaml

    text = resources.files("multigpu.plan").joinpath("catalog.yaml").read_text(encoding="utf-8")
    return parse_catalog(yaml.safe_load(text), "multigpu/plan/catalog.yaml")


@dataclass(frozen=True)
class Prices:
    """Prices per GPU-hour (and optionally per kWh) from the user's file."""

    path: str
    currency: str
    per_gpu_hour: dict[str, float]
    per_kwh: float | None
    date: str | None
    example: bool

    def hourly(self, gpu: str) -> float | None:
        return self.per_gpu_hour.get(gpu)


def load_prices(path: str | Path, catalog: Catalog | None = None) -> Prices:
    """The prices of ``path`` (YAML: ``currency``, ``date``, ``per_gpu_hour: {GPU type: price}``, optional
    ``per_kwh``); one line naming what is wrong. GPU names are the catalog's."""
    import yaml

    catalog = catalog or load_catalog()
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--prices {path}: cannot read it ({exc.strerror or exc}); valid: a YAML file such as "
                          "examples/plan/prices.example.yaml") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--prices {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("per_gpu_hour"), dict) or not data["per_gpu_hour"]:
        raise ConfigError(f"--prices {path}: needs 'per_gpu_hour: {{GPU type: price per GPU-hour}}'; valid GPU types: "
                          f"{', '.join(catalog.gpus)}")
    hourly = {}
    for name, value in data["per_gpu_hour"].items():
        hourly[catalog.gpu(str(name)).key] = _number(f"--prices {path}: per_gpu_hour.{name}", value)
    kwh = data.get("per_kwh")
    return Prices(str(path), str(data.get("currency", "")), hourly,
                  None if kwh is None else _number(f"--prices {path}: per_kwh", kwh),
                  None if data.get("date") is None else str(data["date"]), bool(data.get("example", False)))
