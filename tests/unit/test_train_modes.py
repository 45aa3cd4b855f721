"""Train/eval mode in the Trainer's loop: every training forward runs in train mode.

``train_step`` no longer calls ``model.train()`` on every step (it walks every
submodule, a per-step cost the raw DDP loop does not pay): ``fit()`` calls it
once, and a step calls it again only when the root module was left in eval mode
(by ``evaluate()``, or a callback that sampled from the model). These pin that
no training forward ever runs in eval mode, with dropout on.
"""

from __future__ import annotations

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer
from multigpu.train.data import VOCAB, CharDataset
from multigpu.train.model import GPT
from multigpu.train.trainer import default_loss

SHAPE = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.1)


class _EvalInCallback:
    """A callback that leaves the model in eval mode, as one that samples text would."""

    def on_step(self, event):
        event.state["model"].eval()


def test_every_training_forward_runs_in_train_mode(single_rank_group):
    seen: list[tuple[str, bool]] = []

    def loss_fn(model, batch):
        modes = {m.training for m in model.modules()}
        assert len(modes) == 1, "submodules in mixed modes"
        seen.append(("train" if torch.is_grad_enabled() else "eval", modes.pop()))
        return default_loss(model, batch)

    torch.manual_seed(0)
    model = GPT(SHAPE, len(VOCAB)).eval()  # handed over in eval mode: fit() must still train in train mode
    cfg = TrainConfig(steps=5, batch_size=4, eval_every=2, eval_batches=1, log_every=0, checkpoint_every=0,
                      prefetch=0, warmup_steps=1)
    gen = torch.Generator().manual_seed(1)
    data = CharDataset(torch.randint(0, len(VOCAB), (16 * 32 + 1,), generator=gen, dtype=torch.uint8), 16)
    trainer = Trainer(model, make_optimizer(model, cfg), data, config=cfg, val_data=data, loss_fn=loss_fn)
    trainer.fit()
    trainer.close()
    assert [phase for phase, _ in seen].count("train") == 5
    assert all(mode for phase, mode in seen if phase == "train")
    assert not any(mode for phase, mode in seen if phase == "eval")
    # a callback that leaves the model in eval mode after every step: the next step still trains in train mode
    seen.clear()
    cfg = TrainConfig(steps=3, batch_size=4, eval_every=0, log_every=0, checkpoint_every=0, prefetch=0, warmup_steps=1)
    trainer = Trainer(model, make_optimizer(model, cfg), data, config=cfg, loss_fn=loss_fn,
                      callbacks=[_EvalInCallback()])
    trainer.fit()
    trainer.close()
    assert seen == [("train", True)] * 3


def test_the_default_loss_reads_a_tuple_output_by_its_documented_rule():
    """nanoGPT's GPT returns ``(logits, loss)`` (the loss None without targets): its first tensor is the logits;
    a 0-dim tensor in a tuple (Hugging Face's ``return_dict=False`` given labels: ``(loss, logits)``) is the loss."""
    from tests.scripts.nanogpt_model import gpt

    torch.manual_seed(0)
    model = gpt(block_size=8, vocab_size=11)
    x, y = torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (2, 8))
    logits, _ = model(x)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))
    assert torch.equal(default_loss(model, (x, y)), expected)

    class LossFirst(torch.nn.Module):
        def forward(self, x):
            return torch.tensor(0.25), x.float()

    assert default_loss(LossFirst(), (x, y)).item() == 0.25

    class Words(torch.nn.Module):
        def forward(self, x):
            return {"text": "no tensor"}

    with pytest.raises(ConfigError, match="the model returned dict, and the default loss needs logits"):
        default_loss(Words(), (x, y))
