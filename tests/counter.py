"""A stateful object the checkpoint tests save and load: one integer, kept as a tensor."""

from __future__ import annotations

import torch


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])
