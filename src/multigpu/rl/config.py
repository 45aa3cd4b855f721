"""RLConfig: what ``multigpu rl`` trains (read in the launcher, validated there, then by every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError

__all__ = ["RLConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RLConfig:
    env_id: str = "CartPole-v1"
    """A batched environment of ``multigpu.envs`` with a discrete action space."""

    num_envs: int = 64
    """Environments in the whole job (global), split across ranks; times world_size under weak scaling."""

    num_steps: int = 32
    """Steps each environment takes per rollout; a rollout is num_envs * num_steps env-steps."""

    total_env_steps: int = 1_000_000
    """Stop after this many env-steps (all ranks together) if the target is not reached first."""

    target_return: float | None = 475.0
    """Stop once the mean return of the last ``return_window`` episodes (all ranks) reaches this; None: never."""

    return_window: int = 100
    """Episodes in the moving mean that ``target_return`` is compared with."""

    learning_rate: float = 2.5e-3
    """Adam's step size."""

    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over ``total_env_steps``."""

    gamma: float = 0.99
    """Discount factor."""

    gae_lambda: float = 0.95
    """GAE's lambda."""

    num_minibatches: int = 4
    """Minibatches per epoch; each rank splits its share of the rollout into this many."""

    update_epochs: int = 4
    """Passes over each rollout."""

    clip_coef: float = 0.2
    """PPO's ratio clip."""

    ent_coef: float = 0.0
    """Entropy bonus weight."""

    vf_coef: float = 0.5
    """Value loss weight."""

    max_grad_norm: float = 0.5
    """Global gradient-norm clip (after DDP's all-reduce, so the same on every rank)."""

    hidden_size: int = 64
    """Width of the two hidden layers of the actor and of the critic."""

    seed: int = 1
    """Seeds the environments (keyed by global env id), the network's initialisation and each rank's sampling."""

    threads: int = 1
    """CPU threads per rank."""

    log_every: int = 5
    """Reduce and log metrics (metrics.jsonl) every N updates."""

    def __post_init__(self) -> None:
        positive = ("num_envs", "num_steps", "total_env_steps", "return_window", "num_minibatches",
                    "update_epochs", "hidden_size", "threads", "log_every")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rl.{name} must be a whole number >= 1, got {value!r}")
        for name in ("learning_rate", "clip_coef", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"rl.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"rl.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.ent_coef < 0 or self.vf_coef < 0:
            raise ConfigError(f"rl.ent_coef and rl.vf_coef must be >= 0, got {self.ent_coef!r}, {self.vf_coef!r}")
        from multigpu.envs import make

        try:
            space = make(self.env_id, 1, seed=0).single_action_space
        except ConfigError as exc:
            raise ConfigError(f"rl.env_id: {exc}") from None
        if not hasattr(space, "n"):
            raise ConfigError(f"rl.env_id={self.env_id!r} has continuous actions; this PPO needs a discrete action space")
