"""The tiny models the FSDP tests build on meta and shard (an odd vocabulary: fsdp pads the tied embedding)."""

from __future__ import annotations

VOCAB = 37


def tiny_gpt(block_size: int = 16):
    from multigpu.train import ModelConfig
    from multigpu.train.model import GPT

    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=block_size), VOCAB)


def tiny_hf():
    from multigpu.train.hf import causal_lm

    return causal_lm("llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
