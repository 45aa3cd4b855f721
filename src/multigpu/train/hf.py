"""Hugging Face factories for ``multigpu train``: a causal LM built from a config, a dataset saved to disk.

    multigpu train --model multigpu.train.hf:causal_lm model.kwargs.config=gpt2 model.kwargs.n_layer=2 \\
                   --data multigpu.train.data:bytes_file data.kwargs.path=notes.txt

Nothing is downloaded: :func:`causal_lm` builds the architecture named by
``config`` (a model type such as ``gpt2``, ``llama``, ``qwen2``, or a local
folder with a ``config.json``) with random weights through ``from_config``.
Needs ``pip install transformers`` (and ``datasets`` for :func:`saved_dataset`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError
from multigpu.factory import checked_by

__all__ = ["causal_lm", "saved_dataset"]


def _need(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"this needs {extra}: pip install {extra}") from None


def _config(config: str, vocab_size: int | None, block_size: int | None, overrides: dict[str, Any]):
    transformers = _need("transformers", "transformers")
    if Path(config).is_dir():
        cfg = transformers.AutoConfig.from_pretrained(config, local_files_only=True, **overrides)
    else:
        try:
            cfg = transformers.AutoConfig.for_model(config, **overrides)
        except ValueError as exc:
            raise ConfigError(f"model.kwargs.config={config!r}: {str(exc).splitlines()[0]}; valid: a model type "
                              "such as gpt2, llama, qwen2, or a local folder with config.json") from None
    if vocab_size and "vocab_size" not in overrides:
        cfg.vocab_size = vocab_size
    for name in ("n_positions", "max_position_embeddings"):
        if block_size and hasattr(cfg, name) and name not in overrides and getattr(cfg, name) < block_size:
            setattr(cfg, name, block_size)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids beyond a small vocabulary
        token = getattr(cfg, name, None)
        if isinstance(token, int) and token >= cfg.vocab_size and name not in overrides:
            setattr(cfg, name, None)
    return cfg


def _check_causal_lm(config: str = "gpt2", vocab_size: int | None = None, block_size: int | None = None,
                     **overrides: Any) -> None:
    _config(config, vocab_size, block_size, overrides)


@checked_by(_check_causal_lm)
def causal_lm(config: str = "gpt2", vocab_size: int | None = None, block_size: int | None = None, **overrides: Any):
    """A causal LM of the architecture ``config`` with random weights; ``overrides`` set config fields
    (``n_layer=2``, ``hidden_size=256``). ``vocab_size`` defaults to the data's."""
    transformers = _need("transformers", "transformers")
    model = transformers.AutoModelForCausalLM.from_config(_config(config, vocab_size, block_size, overrides))
    return model


class _TokenRows:
    """Rows of ``input_ids`` cut or grouped into windows of ``block_size``: dict samples with ``labels``."""

    def __init__(self, dataset, column: str, block_size: int | None):
        self.dataset, self.column, self.block_size = dataset, column, block_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = torch.as_tensor(self.dataset[int(i)][self.column], dtype=torch.long)
        if self.block_size:
            ids = ids[: self.block_size]
        return {"input_ids": ids, "labels": ids.clone()}


def _check_saved_dataset(path: str, column: str = "input_ids", block_size: int | None = None,
                         train_split: str = "train", val_split: str | None = "validation") -> None:
    _need("datasets", "datasets")
    if not Path(path).is_dir():
        raise ConfigError(f"data.kwargs.path '{path}' is not a folder saved by datasets' save_to_disk")


@checked_by(_check_saved_dataset)
def saved_dataset(path: str, column: str = "input_ids", block_size: int | None = None,
                  train_split: str = "train", val_split: str | None = "validation"):
    """A ``datasets`` dataset saved with ``save_to_disk``: rows of token ids (``column``), as dict batches with
    ``labels`` (the model shifts them, as Hugging Face causal LMs do). Rows must have equal lengths after
    the cut to ``block_size`` (pack them beforehand)."""
    datasets = _need("datasets", "datasets")
    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        train = data[train_split]
        val = data[val_split] if val_split and val_split in data else None
    else:
        train, val = data, None
    for part in (train, val):
        if part is not None:
            part.set_format("numpy", columns=[column])
    return _TokenRows(train, column, block_size), (_TokenRows(val, column, block_size) if val is not None else None)
