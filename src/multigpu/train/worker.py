"""The module ``multigpu train`` launches on every rank: train the nano GPT from a resolved config.

    python -m multigpu.train.worker runs/train/<stamp>/resolved_config.json   # normally via `multigpu train`
    multigpu bench --nproc 1,2 train steps=20                                  # configs/nano.yaml + overrides

Inside each rank: read the config the launcher resolved and validated, join the
job, load the standard library's source as text, build the GPT, train it with
:class:`~multigpu.train.Trainer`, and on rank 0 sample some text at the end
(``sample.txt`` in the run directory, beside ``metrics.jsonl``, ``summary.json``
and ``checkpoints/``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import multigpu as mg
from multigpu.config import from_dict, load_config
from multigpu.monitor import run_dir_from_env
from multigpu.train.config import TrainConfig
from multigpu.train.data import VOCAB, CharDataset, decode, encode, load_text
from multigpu.train.model import GPT
from multigpu.train.optim import make_optimizer, make_scheduler
from multigpu.train.trainer import Trainer


def build(cfg: TrainConfig, run_dir: Path | None) -> tuple[Trainer, GPT]:
    """Data, model, optimizer, schedule and trainer for the nano GPT (not yet set up)."""
    text = load_text(cfg.data, min_chars=cfg.model.block_size + 1)
    train_set, val_set = CharDataset(text.train, cfg.model.block_size), CharDataset(text.val, cfg.model.block_size)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(cfg.model, len(VOCAB))
    if mg.is_main():
        print(f"nano GPT: {model.num_params() / 1e6:.2f}M parameters; data: {text.num_files} files, "
              f"{len(text.train):,} train / {len(text.val):,} validation characters", flush=True)
    optimizer = make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, train_set, config=cfg, val_data=val_set,
                      scheduler=make_scheduler(optimizer, cfg), run_dir=run_dir, unit="tokens")
    return trainer, model


def sample(model: GPT, cfg: TrainConfig, device: torch.device) -> str:
    """``cfg.sample_chars`` characters after ``cfg.sample_prompt`` (a fixed generator: reproducible)."""
    model.eval()
    prompt = encode(cfg.sample_prompt or "\n").long().unsqueeze(0).to(device)
    out = model.generate(prompt, cfg.sample_chars, generator=torch.Generator().manual_seed(cfg.seed))
    return decode(out[0].tolist())


def _load(argv: list[str]) -> tuple[TrainConfig, Path]:
    """A resolved JSON config (from `multigpu train`), or a YAML file plus key=value overrides
    (from `multigpu bench train`, whose run directory is ``$MULTIGPU_RUN_DIR``)."""
    path = Path(argv[0])
    if path.suffix == ".json":
        return from_dict(TrainConfig, json.loads(path.read_text())), path.parent
    run_dir = run_dir_from_env() or Path("runs/train/bench")
    return load_config(TrainConfig, path, argv[1:]), run_dir


def main(argv: list[str]) -> int:
    cfg, run_dir = _load(argv)
    env = mg.init(seed=cfg.seed)
    trainer, model = build(cfg, run_dir)
    trainer.setup()
    result = trainer.fit()
    if result["interrupted"]:  # Ctrl-C with checkpoint_on_interrupt: the checkpoint of this step is written
        trainer.close()
        if mg.is_main():
            print(f"interrupted after step {trainer.step}: checkpoint {trainer.checkpoints.path_for(trainer.step)}; "
                  f"continue with: multigpu train --run-dir {run_dir} --resume auto", flush=True)
        mg.shutdown()
        return 130
    summary = trainer.close({"params": model.num_params(), "flops_per_token": model.flops_per_token()})
    if mg.is_main():
        text = sample(model, cfg, env.device)
        (run_dir / "sample.txt").write_text(text)
        tput = summary.get("throughput", 0.0)
        print(f"done: step {trainer.step}, val_loss {trainer.last_val_loss:.4f}, {tput:,.0f} tokens/s; "
              f"outputs in {run_dir}\n--- sample ---\n{text}\n--------------", flush=True)
    mg.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
