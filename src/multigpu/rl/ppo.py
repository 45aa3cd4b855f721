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
failure). Discrete action spaces get a categorical policy, Box spaces a
Gaussian with a state-independent log-std (``ppo_continuous_action.py``; see
:mod:`multigpu.rl.policy`). Your own environment (``cfg.env``) is asked for
same-step autoreset; one that keeps gymnasium's default, next-step autoreset,
works too: the step that only resets an environment is left out of the update.
With ``obs_norm`` the observations are normalized by running statistics that
are all-reduced after each rollout (:mod:`multigpu.rl.normalize`).

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
from multigpu.envs.adapter import autoreset_mode_of
from multigpu.errors import ConfigError
from multigpu.monitor import StepMeter
from multigpu.rl.config import RLConfig
from multigpu.rl.normalize import ObsNormalizer
from multigpu.rl.policy import ActorCritic, policy_for
from multigpu.runtime import context
from multigpu.train.sync import wrap_ddp

__all__ = ["ActorCritic", "PPOResult", "train"]


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


def _reads_on_host(device: torch.device) -> bool:
    """Whether the rollout reads values on the host each step: on the CPU that is free and skips the work of
    steps where no episode ended; on a GPU each read waits for the device, so the rollout reads once per
    rollout instead (the same numbers)."""
    return device.type == "cpu"


def _make_envs(cfg: RLConfig, num_envs: int):
    """This rank's share of the environments, asked for same-step autoreset (a factory may keep its own)."""
    env = cfg.env.factory if cfg.env is not None else cfg.env_id
    kwargs = cfg.env.kwargs if cfg.env is not None else None
    envs = mg.envs.make(env, num_envs=num_envs, seed=cfg.seed, split=True, autoreset_mode="same_step", kwargs=kwargs)
    mode = autoreset_mode_of(envs)
    if mode not in ("same_step", "next_step"):
        raise ConfigError(f"{cfg.env_name}: autoreset_mode {mode!r} is not supported; valid: same_step, next_step "
                          "(or disabled, when the factory takes autoreset_mode)")
    what = f"env.factory {cfg.env.factory!r}" if cfg.env is not None else f"rl.env_id={cfg.env_id!r}"
    return envs, mode, policy_for(envs.single_observation_space, envs.single_action_space,
                                  action_bounds=cfg.action_bounds, what=what)


def train(cfg: RLConfig, run_dir=None, *, log=print) -> PPOResult:
    """Train until the target return or the env-step budget; call on all ranks after ``mg.init``.

    ``run_dir``: where rank 0 writes ``metrics.jsonl`` and ``summary.json`` (None: nowhere).
    """
    world, rank = mg.world_size(), mg.rank()
    num_envs = cfg.num_envs
    envs, autoreset, spec = _make_envs(cfg, num_envs)
    n, device = envs.num_envs, torch.device(envs.device)
    next_step = autoreset == "next_step"
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    agent = spec.make_network(cfg.hidden_size, cfg.log_std_init).to(device)
    head, to_env = spec.make_head(), spec.make_map(device)
    norm = ObsNormalizer(spec.obs_dim, device) if cfg.obs_norm else None
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rank)  # each rank explores its own way

    steps_per_update = num_envs * cfg.num_steps
    num_updates = max(1, cfg.total_env_steps // steps_per_update)
    meter = StepMeter.from_context(
        "env-steps", dataclasses.replace(context.current(), run_dir=str(run_dir) if run_dir else None),
        total_steps=num_updates, description=f"ppo {cfg.env_name}", log_every=cfg.log_every, warmup_steps=1)
    model, comm = agent, None
    if world > 1:  # grads averaged over ranks in backward, the all-reduces timed into the comm share
        model, comm = wrap_ddp(agent, mg.get_env("rl.train"), "auto")

    def policy_input(raw: torch.Tensor) -> torch.Tensor:
        x = raw.reshape(n, -1).float()
        return norm(x) if norm is not None else x

    # rollout storage, (num_steps, n, ...) on this rank
    obs_buf = torch.zeros(cfg.num_steps, n, spec.obs_dim, device=device)
    act_buf = (torch.zeros(cfg.num_steps, n, dtype=torch.int64, device=device) if spec.discrete
               else torch.zeros(cfg.num_steps, n, spec.action_dim, device=device))
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros(cfg.num_steps, n, device=device) for _ in range(4))
    valid_buf = torch.ones(cfg.num_steps, n, dtype=torch.bool, device=device)  # False: a next-step reset step
    reset_step = torch.zeros(n, dtype=torch.bool, device=device)  # next-step autoreset: this step only resets
    episode_return = torch.zeros(n, device=device)
    on_host = _reads_on_host(device)
    ended_buf = None if on_host else torch.zeros(cfg.num_steps, n, device=device)  # returns of the episodes ending
    recent: collections.deque[float] = collections.deque(maxlen=cfg.return_window)
    episodes, mean_return, solved = 0, float("nan"), False

    obs, _ = envs.reset(seed=cfg.seed)
    if norm is not None:  # statistics of the first observations, before the first rollout uses them
        norm.observe(obs.reshape(n, -1))
        norm.sync()
    start = time.perf_counter()
    for update in range(num_updates):
        with meter.step(items=n * cfg.num_steps):
            if cfg.anneal_lr:
                optimizer.param_groups[0]["lr"] = cfg.learning_rate * (1.0 - update / num_updates)
            # 1. rollout on this rank's environments (no gradients, no communication)
            finished = []
            with torch.no_grad():
                for t in range(cfg.num_steps):
                    if norm is not None:
                        norm.observe(obs.reshape(n, -1))
                    x = policy_input(obs)
                    out, value = agent(x)
                    action = head.sample(out, sample_gen)
                    obs_buf[t], act_buf[t], val_buf[t] = x, action, value
                    logp_buf[t] = head.log_prob(out, action)
                    obs, reward, terminated, truncated, info = envs.step(to_env(action))
                    reward = torch.as_tensor(reward, device=device).float()
                    done = terminated | truncated
                    episode_return += reward
                    rew_buf[t] = reward * cfg.reward_scale if cfg.reward_scale != 1.0 else reward
                    if next_step:
                        valid_buf[t] = ~reset_step
                        reset_step = done
                    if on_host:
                        any_ended = bool(done.any()) if next_step else "_final_obs" in info
                        if any_ended:  # some episode ended: log its return, bootstrap the truncated ones
                            if truncated.any():
                                final = obs if next_step else info["final_obs"]  # next-step: obs is the last one
                                rew_buf[t] += cfg.gamma * agent(policy_input(final))[1] * truncated
                            finished.append(episode_return[done].clone())
                            episode_return[done] = 0.0
                    else:  # no host read: bootstrap every step (times truncated: + 0 where none was cut)
                        final = obs if next_step else info.get("final_obs", obs)
                        rew_buf[t] += cfg.gamma * agent(policy_input(final))[1] * truncated
                        ended_buf[t] = episode_return
                        episode_return.masked_fill_(done, 0.0)
                    done_buf[t] = done.float()
                if not on_host:  # the ended episodes' returns, in step then environment order: one read
                    finished.append(ended_buf[done_buf.bool()])
                advantages, returns = _advantages(cfg, rew_buf, val_buf, done_buf, agent(policy_input(obs))[1])

            # 2. the episodes that ended on any rank, in rank order: the same moving mean everywhere
            ended = mg.all_gather(torch.cat(finished).tolist() if finished else [])  # one small collective
            recent.extend(ended)
            episodes += len(ended)
            mean_return = sum(recent) / len(recent) if recent else float("nan")
            meter.extras["return"] = mean_return
            if norm is not None:
                norm.sync()  # every rank's observations of this rollout: the next one is normalized identically

            # 3. PPO epochs over this rank's rollout; DDP averages every minibatch's gradients
            b_obs, b_act, b_logp = obs_buf.flatten(0, 1), act_buf.flatten(0, 1), logp_buf.flatten()
            b_adv, b_ret, b_val = advantages.flatten(), returns.flatten(), val_buf.flatten()
            if next_step:  # leave out the steps that only reset an environment
                keep = valid_buf.flatten()
                b_obs, b_act, b_logp, b_adv, b_ret, b_val = (b[keep] for b in (b_obs, b_act, b_logp, b_adv, b_ret, b_val))
            local_batch = b_obs.shape[0]
            for _ in range(cfg.update_epochs):
                order = torch.randperm(local_batch, generator=sample_gen, device=device)
                for mb in order.tensor_split(cfg.num_minibatches):  # the same count on every rank: DDP's collectives pair up
                    out, value = model(b_obs[mb])
                    logp = head.log_prob(out, b_act[mb])
                    ratio = (logp - b_logp[mb]).exp()
                    adv = b_adv[mb]
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                    v_clipped = b_val[mb] + (value - b_val[mb]).clamp(-cfg.clip_coef, cfg.clip_coef)
                    v_loss = 0.5 * torch.max((value - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
                    entropy = head.entropy(out).mean()
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
    getattr(envs, "close", lambda: None)()
    if mg.is_main():
        verdict = "solved" if solved else "not solved"
        log(f"{verdict} {cfg.env_name}: mean return {mean_return:.1f} over the last {len(recent)} episodes "
            f"after {env_steps:,} env-steps and {update + 1} updates, {wall_s:.1f} s on {world} rank(s)")
    result = PPOResult(solved=solved, env_steps=env_steps, wall_s=wall_s, mean_return=mean_return, episodes=episodes)
    meter.close({"rl": {**result.__dict__, "world_size": world, "num_envs": num_envs, "updates": update + 1,
                        "env": cfg.env_name, "obs_norm": norm.state_dict() if norm is not None else None}})
    return result
