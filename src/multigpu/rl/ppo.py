"""Distributed PPO on batched environments (runs inside each rank).

The environments are split across ranks (``mg.envs.make(..., split=True)``),
each rank collects a rollout from its share, and the policy is one
``DistributedDataParallel`` model: every minibatch's gradients are averaged
over ranks in backward, so all ranks apply the same update. Completed
episodes' returns are gathered from every rank after each rollout, so the
moving mean that decides "solved" is the same number on every rank and every
rank stops at the same update.

The algorithm is CleanRL's ``ppo.py`` (GAE, clipped ratio, value loss, global
gradient clip) on tensors, with same-step autoreset and the value of the final
observation added to the reward of truncated steps (a time limit is not a
failure).

Glossary: *update* = one rollout plus ``update_epochs`` passes over it;
*env-step* = one environment advancing once (the meter's unit).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import nn

import multigpu as mg
from multigpu.monitor import StepMeter
from multigpu.rl.config import RLConfig
from multigpu.runtime import context
from multigpu.train.sync import wrap_ddp

__all__ = ["ActorCritic", "PPOResult", "train"]


def _layer(n_in: int, n_out: int, gain: float = 2**0.5) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Separate tanh MLPs for the policy's logits and the state value (CleanRL's initialisation)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int):
        super().__init__()
        self.actor = nn.Sequential(_layer(obs_dim, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(),
                                   _layer(hidden, num_actions, 0.01))
        self.critic = nn.Sequential(_layer(obs_dim, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(),
                                    _layer(hidden, 1, 1.0))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


@dataclass
class PPOResult:
    solved: bool
    env_steps: int
    """Env-steps of all ranks when training stopped."""
    wall_s: float
    """Seconds from the first rollout to the end of the last update."""
    mean_return: float
    episodes: int


def _advantages(cfg: RLConfig, rewards, values, dones, next_value) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a (num_steps, n) rollout; ``dones[t]`` ends the episode after step t (same-step autoreset)."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(cfg.num_steps)):
        following = next_value if t == cfg.num_steps - 1 else values[t + 1]
        alive = 1.0 - dones[t]
        delta = rewards[t] + cfg.gamma * following * alive - values[t]
        last = delta + cfg.gamma * cfg.gae_lambda * alive * last
        advantages[t] = last
    return advantages, advantages + values


def train(cfg: RLConfig, run_dir=None, *, log=print) -> PPOResult:
    """Train until the target return or the env-step budget; call on all ranks after ``mg.init``.

    ``run_dir``: where rank 0 writes ``metrics.jsonl`` and ``summary.json`` (None: nowhere).
    """
    world, rank = mg.world_size(), mg.rank()
    num_envs = cfg.num_envs
    envs = mg.envs.make(cfg.env_id, num_envs=num_envs, seed=cfg.seed, split=True, autoreset_mode="same_step")
    n, device = envs.num_envs, envs.device
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    agent = ActorCritic(envs.single_observation_space.shape[0], envs.single_action_space.n, cfg.hidden_size).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rank)  # each rank explores its own way

    steps_per_update = num_envs * cfg.num_steps
    num_updates = max(1, cfg.total_env_steps // steps_per_update)
    meter = StepMeter.from_context(
        "env-steps", dataclasses.replace(context.current(), run_dir=str(run_dir) if run_dir else None),
        total_steps=num_updates, description=f"ppo {cfg.env_id}", log_every=cfg.log_every, warmup_steps=1)
    model, comm = agent, None
    if world > 1:  # grads averaged over ranks in backward, the all-reduces timed into the comm share
        model, comm = wrap_ddp(agent, mg.get_env("rl.train"), "auto")

    # rollout storage, (num_steps, n, ...) on this rank
    obs_buf = torch.zeros(cfg.num_steps, n, envs.single_observation_space.shape[0], device=device)
    act_buf = torch.zeros(cfg.num_steps, n, dtype=torch.int64, device=device)
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros(cfg.num_steps, n, device=device) for _ in range(4))
    episode_return = torch.zeros(n, device=device)
    recent: collections.deque[float] = collections.deque(maxlen=cfg.return_window)
    episodes, mean_return, solved = 0, float("nan"), False

    obs, _ = envs.reset(seed=cfg.seed)
    start = time.perf_counter()
    for update in range(num_updates):
        with meter.step(items=n * cfg.num_steps):
            if cfg.anneal_lr:
                optimizer.param_groups[0]["lr"] = cfg.learning_rate * (1.0 - update / num_updates)
            # 1. rollout on this rank's environments (no gradients, no communication)
            finished = []
            with torch.no_grad():
                for t in range(cfg.num_steps):
                    logits, value = agent(obs)
                    action = torch.multinomial(torch.softmax(logits, -1), 1, generator=sample_gen).squeeze(1)
                    obs_buf[t], act_buf[t], val_buf[t] = obs, action, value
                    logp_buf[t] = torch.log_softmax(logits, -1).gather(1, action[:, None]).squeeze(1)
                    obs, reward, terminated, truncated, info = envs.step(action)
                    done = terminated | truncated
                    episode_return += reward
                    rew_buf[t] = reward
                    if info:  # some episode ended: log its return, bootstrap the truncated ones
                        if truncated.any():
                            rew_buf[t] += cfg.gamma * agent(info["final_obs"])[1] * truncated
                        finished.append(episode_return[done].clone())
                        episode_return[done] = 0.0
                    done_buf[t] = done.float()
                advantages, returns = _advantages(cfg, rew_buf, val_buf, done_buf, agent(obs)[1])

            # 2. the episodes that ended on any rank, in rank order: the same moving mean everywhere
            ended = mg.all_gather(torch.cat(finished).tolist() if finished else [])  # one small collective
            recent.extend(ended)
            episodes += len(ended)
            mean_return = sum(recent) / len(recent) if recent else float("nan")
            meter.extras["return"] = mean_return

            # 3. PPO epochs over this rank's rollout; DDP averages every minibatch's gradients
            b_obs, b_act, b_logp = obs_buf.flatten(0, 1), act_buf.flatten(), logp_buf.flatten()
            b_adv, b_ret, b_val = advantages.flatten(), returns.flatten(), val_buf.flatten()
            local_batch = b_obs.shape[0]
            for _ in range(cfg.update_epochs):
                order = torch.randperm(local_batch, generator=sample_gen, device=device)
                for mb in order.chunk(cfg.num_minibatches):  # the same count on every rank: DDP's collectives pair up
                    logits, value = model(b_obs[mb])
                    logp_all = torch.log_softmax(logits, -1)
                    logp = logp_all.gather(1, b_act[mb, None]).squeeze(1)
                    ratio = (logp - b_logp[mb]).exp()
                    adv = b_adv[mb]
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                    v_clipped = b_val[mb] + (value - b_val[mb]).clamp(-cfg.clip_coef, cfg.clip_coef)
                    v_loss = 0.5 * torch.max((value - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
                    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                    loss = pg_loss - cfg.ent_coef * entropy + cfg.vf_coef * v_loss
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                    optimizer.step()
            if comm is not None:
                meter.add_comm(comm.pop_seconds())

        env_steps = (update + 1) * steps_per_update
        if cfg.target_return is not None and len(recent) == cfg.return_window and mean_return >= cfg.target_return:
            solved = True
            break
    wall_s = time.perf_counter() - start
    if mg.is_main():
        verdict = "solved" if solved else "not solved"
        log(f"{verdict} {cfg.env_id}: mean return {mean_return:.1f} over the last {len(recent)} episodes "
            f"after {env_steps:,} env-steps and {update + 1} updates, {wall_s:.1f} s on {world} rank(s)")
    result = PPOResult(solved=solved, env_steps=env_steps, wall_s=wall_s, mean_return=mean_return, episodes=episodes)
    meter.close({"rl": {**result.__dict__, "world_size": world, "num_envs": num_envs, "updates": update + 1}})
    return result
