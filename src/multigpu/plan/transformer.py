"""A decoder-only transformer described by its sizes: FLOPs, bytes, collectives and memory of one training step
(pure; in the launcher). What ``multigpu plan train model=...`` plans from when nothing has run.

    spec = ModelSpec.from_keys({"arch": "llama", "layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32,
                                "kv_heads": 8, "vocab": 128256, "seq": 8192, "batch": 2, "strategy": "fsdp"})
    spec.flops_per_token()        # matmul and attention FLOPs one token costs (forward, backward, recompute)
    spec.bytes_per_token()        # bytes the memory-bound kernels move for one token
    spec.traffic(world_size=8)    # the step's collectives, as multigpu.bench.predict's alpha-beta model reads them
    spec.memory_per_rank(8)       # training state, gathered parameters, activations and logits of one rank

The counts, each a textbook rule stated where it is used:

* *matmul FLOPs* ``6 N_mm`` per token (forward 2, backward 4; ``N_mm`` the parameters of every matmul, the output
  projection included, the embedding lookup not), plus recomputation: selective activation checkpointing
  (torchtitan's per-op policy recomputes every other matmul) ``+ N_mm``, full ``+ 2 N_mm``;
* *attention FLOPs* of causal flash attention: ``2 T H`` per token and layer forward (each token attends to T/2
  keys on average: ``QK^T`` and ``AV``), twice that backward (``6 T H``), plus the forward again under full
  checkpointing;
* *naive attention* (scores materialized): the whole ``T x T`` product (``4 T H`` forward), and per score element
  and token the scale, mask and soft-max kernels and their gradients (43 bytes eager, 12 compiled);
* *memory-bound bytes*: every element-wise kernel (norms, residual adds, the MLP's activation, rotary embedding,
  the loss) reads its inputs and writes its output once, in the activation dtype (2 bytes); backward moves twice
  what forward does; ``torch.compile`` fuses each chain between two matmuls into one kernel (counted as such);
  the loss over the vocabulary in fp32 (eager: upcast, log-softmax, its gradient; compiled: one read, one write);
  AdamW's step reads and writes parameters, two moments and reads gradients in fp32 (28 bytes per parameter
  held), once per step;
* *memory*: parameters, gradients and AdamW's two moments in fp32 (16 bytes per parameter: a whole replica per
  rank under DDP, 1/N under FSDP, 1/shard under HSDP, the rule of :func:`multigpu.train.strategy_checks.training_state_bytes`);
  the activations kept for backward per token and layer (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", their per-layer count with flash attention: no attention scores
  kept); the logits in bf16 plus their fp32 copy and log-softmax (10 bytes per token and vocabulary entry).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["ModelSpec"]

ACT_BYTES = 2
"""Bytes of one activation element (bf16/fp16 mixed precision)."""
ADAM_STEP_BYTES = 28
"""Bytes AdamW's step moves per parameter held: parameter read+write 8, gradient read 4, two moments read+write 16."""
STATE_BYTES = 16
"""Bytes per parameter of the training state: fp32 parameter 4, fp32 gradient 4, AdamW's two moments 8."""
LOGIT_BYTES = 10
"""Bytes per token and vocabulary entry the loss keeps: bf16 logits 2, their fp32 copy 4, fp32 log-softmax 4."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket (``bucket_cap_mb=25``): one all-reduce call per bucket."""

_CHOICES = {"arch": ("gpt", "llama"), "attention": ("flash", "naive"), "ac": ("none", "selective", "full"), "strategy": ("ddp", "fsdp", "hsdp"),
            "precision": ("bf16", "fp16", "fp8", "tf32", "fp32")}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A transformer training job by its sizes (``model=...`` keys of ``multigpu plan train``)."""

    layers: int
    hidden: int
    seq: int
    """Tokens per sample (the context length)."""
    batch: int
    """Samples per micro-step on each rank."""
    vocab: int = 50304
    heads: int | None = None
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); default: ``heads``."""
    ffn: int | None = None
    """The MLP's inner width; default 4 x hidden (gpt); required for llama."""
    arch: str = "gpt"
    """gpt: GELU MLP, LayerNorm, learned positions, tied embeddings; llama: SwiGLU, RMSNorm, rotary, untied."""
    params: float | None = None
    """The model's parameter count where known (else counted from the sizes)."""
    grad_accum: int = 1
    precision: str = "bf16"
    """The matmuls' precision (the peak they run at): bf16, fp16, fp8 (float8 linears), tf32, fp32."""
    ac: str = "none"
    """Activation checkpointing: none, selective (per op: every other matmul recomputed), full (per block)."""
    compile: bool = False
    attention: str = "flash"
    """flash: fused attention that keeps no T x T scores (torch's scaled_dot_product_attention); naive: the scores
    materialized, scaled, masked and soft-maxed by separate kernels (nanoGPT before 2023-01-30)."""
    strategy: str = "ddp"
    shard_size: int | None = None
    """hsdp: ranks per replica (default: the GPUs of a node)."""
    reshard_after_forward: bool = True
    name: str = "model"

    def __post_init__(self) -> None:
        for key, valid in _CHOICES.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"model.{key}={getattr(self, key)!r} is invalid; valid: {', '.join(valid)}")
        for key in ("layers", "hidden", "seq", "batch", "vocab", "grad_accum"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} is invalid; valid: a whole number >= 1")
        if self.arch == "llama" and self.ffn is None:
            raise ConfigError("model.ffn is needed for arch=llama (SwiGLU's inner width, e.g. 14336 for Llama 3 8B)")

    @classmethod
    def from_keys(cls, keys: dict[str, Any]) -> ModelSpec:
        """From ``model=...`` keys; an unknown key is one line with the valid ones."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in keys if k not in fields]
        if unknown:
            import difflib

            near = difflib.get_close_matches(unknown[0], list(fields), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"unknown model key {unknown[0]!r}.{hint} Valid: {', '.join(fields)}")
        missing = [k for k in ("layers", "hidden", "seq", "batch") if k not in keys]
        if missing:
            raise ConfigError(f"model description needs {', '.join(missing)} (e.g. model.layers=12 model.hidden=768 "
                              "model.seq=1024 model.batch=12)")
        return cls(**keys)

    # ------------------------------------------------------------------ sizes
    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_width(self) -> int:
        heads = self.heads or 1
        return self.hidden * (self.kv_heads or heads) // heads

    def _layer_matmul_params(self) -> int:
        h, f = self.hidden, self.ffn_width
        attention = h * (h + 2 * self.kv_width) + h * h
        mlp = (3 if self.arch == "llama" else 2) * h * f
        return attention + mlp

    @property
    def matmul_params(self) -> int:
        """Parameters of every matmul a token passes through: the blocks' and the output projection."""
        return self.layers * self._layer_matmul_params() + self.vocab * self.hidden

    @property
    def total_params(self) -> float:
        if self.params:
            return float(self.params)
        embed = 0 if self.arch == "gpt" else self.vocab * self.hidden  # gpt ties the embedding to the output
        positions = self.seq * self.hidden if self.arch == "gpt" else 0
        norms = self.layers * 4 * self.hidden + 2 * self.hidden
        return float(self.matmul_params + embed + positions + norms)

    @property
    def tokens_per_micro_step(self) -> int:
        return self.batch * self.seq

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank handles per optimizer step."""
        return self.tokens_per_micro_step * self.grad_accum

    def model_flops_per_token(self) -> float:
        """The MFU convention (nanoGPT, PaLM; :func:`multigpu.train.mfu.flops_per_token`): ``6 N + 12 L H T``."""
        return 6 * self.total_params + 12 * self.layers * self.hidden * self.seq

    # ------------------------------------------------------------------ work per token
    def flops_per_token(self) -> dict[str, float]:
        """``{"matmul": ..., "attention": ...}`` FLOPs one token costs in a training step (see the module doc)."""
        recompute = {"none": 0, "selective": 1, "full": 2}[self.ac]
        matmul = (6 + recompute) * self.matmul_params
        # causal flash attention skips the masked half; naive attention multiplies the whole T x T
        per = 2 if self.attention == "flash" else 4
        attention = (3 * per + (per if self.ac == "full" else 0)) * self.seq * self.hidden * self.layers
        return {"matmul": float(matmul), "attention": float(attention)}

    def _elementwise_per_layer(self) -> float:
        """Elements the element-wise kernels of one block read and write for one token, forward."""
        h, f, kv = self.hidden, self.ffn_width, self.kv_width
        if self.compile:  # one kernel per chain between matmuls
            norms_residuals = 8 * h  # norm 1; residual + norm 2 fused; residual
            activation = 3 * f if self.arch == "llama" else 2 * f
            rotary = 2 * (h + kv) if self.arch == "llama" else 0
        else:
            norms_residuals = 2 * 2 * h + 2 * 3 * h  # two norms (read, write), two residual adds (read 2, write 1)
            activation = 5 * f if self.arch == "llama" else 2 * f  # silu (2F) and its product (3F); gelu (2F)
            rotary = 4 * (h + kv) if self.arch == "llama" else 0
        return norms_residuals + activation + rotary

    def bytes_per_token(self, world_size: int = 1) -> dict[str, float]:
        """Bytes the memory-bound kernels move for one token: ``elementwise``, ``loss``, ``optimizer``, ``fp8_casts``."""
        passes = 3 + (1 if self.ac != "none" else 0)  # forward, backward (2x), the recomputed forward
        elementwise = self._elementwise_per_layer() * ACT_BYTES * passes * self.layers
        if self.attention == "naive":  # per score element: scale, mask, softmax (fp32) and their gradients; compiled:
            # one fused kernel each way
            elementwise += (self.heads or 1) * self.seq * (12 if self.compile else 43) * self.layers
        loss = (8 if self.compile else 28) * self.vocab
        held = self.total_params / self._shards(world_size)
        optimizer = ADAM_STEP_BYTES * held / self.tokens_per_step
        casts = 0.0
        if self.precision == "fp8":  # each linear's input (forward) and output gradient (backward) cast to fp8
            h, f, kv = self.hidden, self.ffn_width, self.kv_width
            mlp_io = (h + 2 * f) + (f + h) if self.arch == "llama" else (h + f) + (f + h)
            casts = 3.0 * ((h + h + 2 * kv) + 2 * h + mlp_io) * 2 * self.layers
        return {"elementwise": float(elementwise), "loss": float(loss), "optimizer": float(optimizer),
                "fp8_casts": casts}

    # ------------------------------------------------------------------ collectives
    def _shards(self, world_size: int) -> int:
        if self.strategy == "ddp" or world_size < 2:
            return 1
        if self.strategy == "hsdp":
            shards = min(self.shard_size or 8, world_size)
            if world_size % shards:
                raise ConfigError(f"strategy=hsdp: {world_size} GPUs do not split into replicas of {shards} "
                                  f"(shard_size); valid: GPU counts that are multiples of {shards}")
            return shards
        return world_size

    def traffic(self, world_size: int) -> dict[str, dict[str, float]]:
        """One optimizer step's collectives per rank, as ``collectives.record_traffic`` counts them (``calls`` and
        ``bytes`` per step) for :func:`multigpu.bench.predict.comm_time`."""
        if world_size < 2:
            return {}
        n = self.total_params
        if self.strategy == "ddp":  # fp32 gradients, all-reduced once per step (no_sync while accumulating)
            nbytes = 4 * n
            return {"all_reduce": {"calls": float(max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))), "bytes": nbytes}}
        units = self.layers + 1  # each block, then the root (embeddings, output)
        gathers = (2 if self.reshard_after_forward else 1) * self.grad_accum
        gathered = (1 if self.precision == "fp8" else 2) * n  # bf16 (fp8 all-gather under float8) parameters
        within = ":shard" if self.strategy == "hsdp" else ""
        out = {f"sharded_all_gather{within}": {"calls": float(units * gathers), "bytes": gathered * gathers},
               f"reduce_scatter{within}": {"calls": float(units * self.grad_accum), "bytes": 4 * n * self.grad_accum}}
        if self.strategy == "hsdp" and world_size > self._shards(world_size):
            out["all_reduce:replicate"] = {"calls": float(units), "bytes": 4 * n}
        return out

    # ------------------------------------------------------------------ memory
    def activation_bytes_per_token(self) -> float:
        """Bytes kept for backward per token, all layers (Korthikanti et al.'s count, flash attention, no dropout)."""
        h, f, kv = self.hidden, self.ffn_width, self.kv_width
        attention = 2 * h + 2 * (h + 2 * kv) + 2 * h  # block input, q k v, attention output (= projection input)
        mlp = 2 * h + (8 * f if self.arch == "llama" else 4 * f)  # input; fc output and activation (SwiGLU: 4 x F)
        norms = (8 if self.arch == "llama" else 4) * h  # two norms' inputs (llama's RMSNorm keeps fp32 copies)
        per_layer = attention + mlp + norms
        if self.attention == "naive":  # the soft-maxed scores (bf16) and their fp32 copy, per head
            per_layer += 6 * (self.heads or 1) * self.seq
        if self.ac == "full":  # only each block's input; one block's activations live again during its recompute
            return 2 * h * self.layers + per_layer
        if self.ac == "selective":  # every other matmul's output and the element-wise results are recomputed
            return per_layer * self.layers / 2
        return per_layer * self.layers

    def memory_per_rank(self, world_size: int) -> dict[str, float]:
        """Bytes one rank holds at its peak: ``state`` (parameters, gradients, AdamW), ``gathered`` (FSDP's
        all-gathered units: the one computing and the one prefetched), ``activations`` and ``logits``."""
        shards = self._shards(world_size)
        state = STATE_BYTES * self.total_params / shards
        gathered = 0.0
        if shards > 1:
            unit = self.total_params / (self.layers + 1)
            gathered = 2 * unit * (1 if self.precision == "fp8" else 2)
        tokens = self.tokens_per_micro_step
        out = {"state": state, "gathered": gathered, "activations": self.activation_bytes_per_token() * tokens,
               "logits": LOGIT_BYTES * self.vocab * tokens}
        out["total"] = sum(out.values())
        return out
