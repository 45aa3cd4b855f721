"""The sharded (``strategy: fsdp`` or ``hsdp``) model and optimizer as one checkpoint part (inside each rank).

Each rank writes its own shard of the model and of the optimizer state through the checkpoint store's
DCP part (:class:`multigpu.checkpoint.Sharded`); a run saved on N ranks resumes on any number of ranks
and mesh (DCP reshards on load: fsdp's 1-D, hsdp's 2-D, or a whole model under ddp). Under hsdp the
replicas hold equal shards; DCP writes each once. The optimizer's ``param_groups`` (plain values) travel in the trainer's plain
part and are handed back through :attr:`FsdpTensors.param_groups` before the tensors are loaded.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FsdpTensors"]


class FsdpTensors:
    """``{"model": ..., "optim": ...}``: this rank's shards, in torch's distributed state-dict layout."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, param_groups: list | None = None):
        self.module, self.optimizer, self.param_groups = module, optimizer, param_groups
        self.saved_param_groups: list | None = None
        """The optimizer's ``param_groups`` at the last ``state_dict()`` (what a checkpoint records beside it)."""

    def state_dict(self) -> dict[str, Any]:
        """This job's layout (on load: the template DCP fills in place; it also initializes the optimizer state)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        self.saved_param_groups = optim_sd["param_groups"]
        return {"model": model_sd, "optim": optim_sd["state"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        groups = self.param_groups if self.param_groups is not None else self.saved_param_groups
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": groups})
