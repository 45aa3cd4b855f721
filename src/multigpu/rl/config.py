"""RLConfig: what ``multigpu rl`` trains (read in the launcher, validated there, then by every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from multigpu.errors import ConfigError
from multigpu.factory import Factory

__all__ = ["RLConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RLConfig:
    env_id: str = "CartPole-v1"
    """A registered batched environment of ``multigpu.envs`` (CartPole-v1, Pendulum-v1, yours from
    ``mg.envs.register``); ``env`` takes its place when given."""

    env: Factory | None = None
    """Your own batched environment: ``{factory: pkg.module:make_env, kwargs: {...}}`` (``--env pkg.module:make_env``).
    Called in every rank with the arguments it names among num_envs (the rank's share), env_ids, seed,
    device, autoreset_mode (see :mod:`multigpu.envs.adapter`); it returns a gymnasium 1.x vector env,
    NumPy or torch, with a Discrete or Box action space."""

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

    action_bounds: Literal["clip", "tanh"] = "clip"
    """Box actions: the Gaussian's sample, in [-1, 1] units mapped onto each bounded dimension's [low, high],
    is clipped (CleanRL's ClipAction; unbounded dimensions pass unchanged) or tanh-squashed (needs bounds)."""

    log_std_init: float = 0.0
    """Box actions: the initial log standard deviation of the Gaussian (in [-1, 1] units), learned from there."""

    obs_norm: bool = False
    """Normalize observations by running mean and variance, all-reduced across ranks after every rollout,
    so every rank normalizes identically (the statistics are in summary.json)."""

    reward_scale: float = 1.0
    """Rewards are multiplied by this for learning (value targets of order 1 train faster); returns are
    reported unscaled."""

    seed: int = 1
    """Seeds the environments (keyed by global env id), the network's initialisation and each rank's sampling."""

    threads: int = 1
    """CPU threads per rank."""

    log_every: int = 5
    """Reduce and log metrics (metrics.jsonl) every N updates."""

    checkpoint_on_interrupt: bool = False
    """On Ctrl-C or SIGTERM (a pre-emption), finish the current update, write its checkpoint and stop (exit 130 or
    143); ``--resume auto`` continues from it."""

    checkpoint_every: int = 10
    """Save a checkpoint every N updates (0: only the last); the last update is always saved, so every run
    with a run directory leaves its policy (:func:`multigpu.rl.load_policy`). ``--resume auto`` continues
    from the newest one, bit-identically on the same world size."""

    keep_last: int = 3
    """Checkpoints kept in ``<run_dir>/checkpoints``; older ones are deleted."""

    checkpoint_mode: Literal["async", "sync"] = "async"
    """async: a checkpoint is copied to host memory and written in the background while training goes on;
    sync: every rank waits until it is on disk (use it where the host cannot hold one more copy of the state)."""

    callbacks: list[str] = field(default_factory=list)
    """``pkg.module:factory`` names; each made object's ``on_step(event)`` runs on every rank after each
    update, before its checkpoint (``event.step``: updates done; ``event.state``, ``event.run``: see
    :class:`multigpu.run.StepEvent`)."""

    def __post_init__(self) -> None:
        positive = ("num_envs", "num_steps", "total_env_steps", "return_window", "num_minibatches",
                    "update_epochs", "hidden_size", "threads", "log_every")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rl.{name} must be a whole number >= 1, got {value!r}")
        for name, low in (("checkpoint_every", 0), ("keep_last", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"rl.{name} must be a whole number >= {low}, got {value!r}")
        for name in ("learning_rate", "clip_coef", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"rl.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"rl.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.ent_coef < 0 or self.vf_coef < 0:
            raise ConfigError(f"rl.ent_coef and rl.vf_coef must be >= 0, got {self.ent_coef!r}, {self.vf_coef!r}")
        if not self.reward_scale > 0:
            raise ConfigError(f"rl.reward_scale must be > 0, got {self.reward_scale!r}")
        if self.env is not None:
            return  # a factory is checked in the launcher (multigpu.rl.job.check), where building one is allowed
        from multigpu.envs import make
        from multigpu.rl.policy import policy_for

        try:
            envs = make(self.env_id, 1, seed=0, device="cpu")
        except ConfigError as exc:
            raise ConfigError(f"rl.env_id: {exc}") from None
        policy_for(envs.single_observation_space, envs.single_action_space, action_bounds=self.action_bounds,
                   what=f"rl.env_id={self.env_id!r}")

    @property
    def env_name(self) -> str:
        """What is being trained, for log lines: the factory's name or the registered id."""
        return self.env.factory if self.env is not None else self.env_id
