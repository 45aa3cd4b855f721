"""Observation normalization with running statistics that are the same on every rank.

Runs inside each rank. ``observe`` adds a batch of observations to this rank's sums (no
communication); ``sync`` all-reduces the sums of every rank - one small collective, call on
all ranks - and folds them into the running mean and variance with Chan et al.'s parallel
update, so every rank holds the same statistics, equal to a single process's over all the
data (``tests/dist/test_rl_normalize.py``). Between two ``sync`` calls the statistics do not
move, so a whole rollout is normalized with one set of numbers.

The sums are taken in float64 about the running mean (a shift that keeps ``sum(x^2) / n - mean^2``
from cancelling when the mean is large against the spread).

    norm = ObsNormalizer(obs_dim, device)
    norm.observe(obs); norm.sync()           # every rank: the same mean and var
    x = norm(obs)                            # (obs - mean) / sqrt(var + eps), clipped to +-10
"""

from __future__ import annotations

import torch

__all__ = ["ObsNormalizer"]


class ObsNormalizer:
    """Running mean and variance (population) of observations, all-reduced across ranks at each ``sync``.

    Args:
        dim: Features per observation (observations are ``(batch, dim)``).
        device: Where the statistics live.
        clip: Normalized values are clamped to ``[-clip, clip]``.
        eps: Added to the variance before the square root.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu", *, clip: float = 10.0, eps: float = 1e-8):
        self.dim, self.clip, self.eps = dim, clip, eps
        self.count = 0.0
        self.mean = torch.zeros(dim, dtype=torch.float64, device=device)
        self.var = torch.ones(dim, dtype=torch.float64, device=device)
        self._sums = torch.zeros(2 * dim + 1, dtype=torch.float64, device=device)  # count, sum(x - m), sum((x - m)^2)
        self._refresh()

    def _refresh(self) -> None:
        self._mean32 = self.mean.float()
        self._inv_std32 = torch.rsqrt(self.var + self.eps).float()

    def observe(self, obs: torch.Tensor) -> None:
        """Add ``obs`` (``(batch, dim)``) to this rank's sums; the statistics move at the next ``sync``."""
        d = obs.reshape(-1, self.dim).double() - self.mean
        self._sums[0] += d.shape[0]
        self._sums[1:1 + self.dim] += d.sum(0)
        self._sums[1 + self.dim:] += (d * d).sum(0)

    def sync(self) -> None:
        """All ranks' sums -> the new running mean and variance (the same on every rank). Call on all ranks."""
        from multigpu.runtime import collectives, group

        sums = self._sums
        if group.is_initialized() and group.world_size() > 1:
            collectives.all_reduce(sums, "sum", check_shapes=False)
        n = float(sums[0])
        if n > 0:
            shift_mean = sums[1:1 + self.dim] / n  # batch mean minus the current mean
            batch_var = (sums[1 + self.dim:] / n - shift_mean * shift_mean).clamp_min(0.0)
            total = self.count + n
            # Chan et al.: combine (count, mean, var) with (n, mean + shift_mean, batch_var)
            m2 = self.var * self.count + batch_var * n + shift_mean * shift_mean * (self.count * n / total)
            self.mean = self.mean + shift_mean * (n / total)
            self.var = m2 / total
            self.count = total
            self._refresh()
        self._sums = torch.zeros_like(sums)

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        """``(obs - mean) / sqrt(var + eps)`` clamped to ``[-clip, clip]``, in float32."""
        x = (obs.reshape(-1, self.dim).float() - self._mean32) * self._inv_std32
        return x.clamp(-self.clip, self.clip)

    def summary(self) -> dict:
        """Plain numbers (for ``summary.json``): the count, mean and variance."""
        return {"count": self.count, "mean": self.mean.tolist(), "var": self.var.tolist()}

    def state_dict(self) -> dict:
        """The running statistics, exactly (float64 tensors): a checkpoint part. Taken after a ``sync``."""
        return {"count": torch.tensor(self.count, dtype=torch.float64), "mean": self.mean.clone(),
                "var": self.var.clone(), "sums": self._sums.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.count = float(state["count"])
        self.mean = state["mean"].to(self.mean.device, torch.float64)
        self.var = state["var"].to(self.var.device, torch.float64)
        self._sums = state["sums"].to(self._sums.device, torch.float64)
        self._refresh()
