"""Reinforcement learning on batched environments split across ranks: distributed PPO.

Runs inside each rank; ``multigpu rl -f ppo-cartpole`` (discrete actions) or
``multigpu rl -f ppo-pendulum`` (continuous: a Gaussian policy) launches it,
``multigpu rl --env pkg.module:make_env`` trains on your own batched environment.
"""

from multigpu.rl.config import RLConfig
from multigpu.rl.normalize import ObsNormalizer
from multigpu.rl.policy import ActorCritic, GaussianActorCritic
from multigpu.rl.ppo import PPOResult, TrainedPolicy, load_policy, train

__all__ = ["ActorCritic", "GaussianActorCritic", "ObsNormalizer", "PPOResult", "RLConfig", "TrainedPolicy", "load_policy", "train"]
