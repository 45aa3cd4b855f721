"""A small character-level GPT in nanoGPT's shape (inside each rank).

Pre-LayerNorm blocks, causal self-attention through
``scaled_dot_product_attention``, a 4× MLP, tied input/output embeddings.
``GPT(ModelConfig(...), vocab_size)``; ``model(x)`` returns logits
``(batch, time, vocab)``; ``generate`` samples text from a prompt.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from multigpu.train.config import require

__all__ = ["GPT", "ModelConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The character-level GPT of ``multigpu train`` (nanoGPT's shape)."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 128
    """Context length in characters (one sample is this many characters)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs independent of the split, bit for bit on resume either way)."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers."""

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            require(getattr(self, key) >= 1, f"model.kwargs.{key}={getattr(self, key)} must be >= 1")
        require(self.n_embd % self.n_head == 0,
                 f"model.kwargs.n_embd={self.n_embd} must be divisible by model.kwargs.n_head={self.n_head}")
        require(0.0 <= self.dropout < 1.0, f"model.kwargs.dropout={self.dropout} must be in [0, 1)")


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    """Decoder-only transformer over ``vocab_size`` symbols with a context of ``cfg.block_size``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        # drawn first, from the global generator on the host (also under torch.device("meta")): every value below
        # depends on this seed and the parameter's name only, so a meta build materialized shard by shard
        # (multigpu.train.meta) gets exactly the values of a build on the host
        self.init_seed = _draw_seed()
        self.tok = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        if not self.tok.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialization of every parameter in place (see :meth:`init_parameter`)."""
        for name, p in self.named_parameters():  # the tied embedding once
            self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor``, the whole of parameter ``name``: GPT-2's init (normal(0, 0.02) for weights, scaled
        by 1/sqrt(2 n_layer) on residual projections; LayerNorm weights 1, biases 0), drawn from a generator of
        its own seeded by ``init_seed`` and ``name``."""
        if tensor.dim() < 2:
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)  # LayerNorms' weights; biases
            return
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
        generator = torch.Generator().manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
        tensor.normal_(0.0, std, generator=generator)

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once and leaving out position embeddings (nanoGPT's count)."""
        return sum(p.numel() for p in self.parameters()) - self.pos.weight.numel()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6N plus attention), as in nanoGPT's MFU estimate."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``new_tokens`` sampled tokens to ``idx`` (batch, time)."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float() / temperature
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def _draw_seed() -> int:
    """A seed from torch's global generator (``torch.manual_seed`` decides it), drawn on the host also under
    ``FakeTensorMode``, where a dry run builds models (reading a fake tensor's value raises there; the fake-tensor
    module is imported only then: it pulls in sympy, seconds of a launcher's start-up)."""
    try:
        return int(torch.randint(0, 2**62, (), device="cpu"))
    except Exception:  # noqa: BLE001 - torch's DataDependentOutputException under FakeTensorMode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return int(torch.randint(0, 2**62, (), device="cpu"))
