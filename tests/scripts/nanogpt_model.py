"""nanoGPT's model.py in miniature, as a user brings it: ``GPT(config)`` (no default config) whose ``forward(idx,
targets=None)`` returns ``(logits, loss)`` (the loss None without targets), and the factory function a user adds
for ``multigpu train --model nanogpt_model:gpt`` (block_size and vocab_size come from the data).
"""
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 16


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        layer = nn.TransformerEncoderLayer(config.n_embd, config.n_head, 4 * config.n_embd, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.h = nn.TransformerEncoder(layer, config.n_layer, enable_nested_tensor=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.h(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)), mask=mask, is_causal=True)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def gpt(block_size: int, vocab_size: int, n_layer: int = 1) -> GPT:
    """What a user writes for ``--model``: GPT built from its config, the data's sizes filled in."""
    return GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer))
