"""Reinforcement learning on batched environments split across ranks: distributed PPO.

Runs inside each rank; ``multigpu rl -f ppo-cartpole`` launches it.
"""

from multigpu.rl.config import RLConfig
from multigpu.rl.ppo import ActorCritic, PPOResult, train

__all__ = ["ActorCritic", "PPOResult", "RLConfig", "train"]
