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

Checkpoints (``<run_dir>/checkpoints``, :class:`multigpu.checkpoint.CheckpointStore`) every
``checkpoint_every`` updates and after the last: the policy, the optimizer, the normalizer's statistics,
the counters and moving returns, and every rank's environments, current observations and sampling
generator; a resumed run continues bit-identically to an uninterrupted one on the same world size.
:func:`load_policy` reads the newest one back as a module.

Glossary: *update* = one rollout plus ``update_epochs`` passes over it;
*env-step* = one environment advancing once (the meter's unit).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import multigpu as mg
from multigpu.checkpoint import CHECKPOINTS, CheckpointStore, PerRank, read_manifest
from multigpu.envs.adapter import autoreset_mode_of
from multigpu.errors import ConfigError
from multigpu.monitor import StepMeter
from multigpu.rl.config import RLConfig
from multigpu.rl.normalize import ObsNormalizer
from multigpu.rl.policy import ActorCritic, PolicySpec, policy_for
from multigpu.runtime import context
from multigpu.train.sync import wrap_ddp

__all__ = ["ActorCritic", "PPOResult", "TrainedPolicy", "load_policy", "train"]


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


def _refuse_nonfinite(cfg: RLConfig, update: int, step: int | None, *, obs: torch.Tensor,
                      reward: torch.Tensor | None = None) -> None:
    """Raise one line naming the environment, the first non-finite value and where, if there is one."""
    for what, values in (("observation", obs), ("reward", reward)):
        if values is None:
            continue
        bad = torch.nonzero(~torch.isfinite(values.float()))
        if bad.numel() == 0:
            continue
        first = bad[0].tolist()
        t, env = (step, first[0]) if step is not None else (first[0], first[1])
        value = values[tuple(first)].item()
        raise ConfigError(
            f"{cfg.env_name}: environment {env} on rank {mg.rank()} returned a non-finite {what} ({value}) in step "
            f"{t} of rollout {update}; valid: finite observations and rewards (clip or guard them in the environment)")


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


class _RankState:
    """What differs per rank and moves every step: environments, observations, episode sums, the sampler."""

    def __init__(self, envs, loop: dict, gen: torch.Generator):
        self.envs, self.loop, self.gen = envs, loop, gen

    def state_dict(self) -> dict:
        envs = self.envs.state_dict() if hasattr(self.envs, "state_dict") else None
        return {"envs": envs, "gen": self.gen.get_state(), **{k: v.clone() for k, v in self.loop.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["envs"] is not None and hasattr(self.envs, "load_state_dict"):
            self.envs.load_state_dict(state["envs"])
        self.gen.set_state(state["gen"])
        for key, value in self.loop.items():
            self.loop[key] = state[key].to(value.device)


class _Module:
    """A module as a checkpoint part whose tensors come back on the module's own device."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def train(cfg: RLConfig, run_dir=None, *, log=print, resume_from=None,
          run: context.RunContext | None = None) -> PPOResult:
    """Train until the target return or the env-step budget; call on all ranks after ``mg.init``.

    ``run_dir``: where rank 0 writes ``metrics.jsonl``, ``summary.json`` and the checkpoints (None: nowhere).
    ``resume_from``: a checkpoint folder to continue from (the job's ``ctx.resume_from``).
    ``run``: the run context (the job's ``ctx``; a plain script: the launcher's).
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
    on_host = _reads_on_host(device)
    ended_buf = None if on_host else torch.zeros(cfg.num_steps, n, device=device)  # returns of the episodes ending
    recent: collections.deque[float] = collections.deque(maxlen=cfg.return_window)
    episodes, mean_return, solved, first = 0, float("nan"), False, 0

    obs, _ = envs.reset(seed=cfg.seed)
    if norm is not None:  # statistics of the first observations, before the first rollout uses them
        norm.observe(obs.reshape(n, -1))
        norm.sync()
    loop = {"obs": obs, "episode_return": torch.zeros(n, device=device),
            "reset_step": torch.zeros(n, dtype=torch.bool, device=device)}  # next-step autoreset: this step only resets
    store, parts = None, {"policy": _Module(agent), "optimizer": optimizer, "rank": PerRank(_RankState(envs, loop, sample_gen))}
    parts["normalizer"] = norm  # None without obs_norm: saved as None
    if run_dir is not None:
        store = CheckpointStore(Path(run_dir) / CHECKPOINTS, cfg.keep_last)
    if resume_from is not None:
        saved_world = read_manifest(resume_from)["world_size"]
        if saved_world != world:  # each rank's environments are its share of the global ids
            raise ConfigError(f"checkpoint {resume_from} was written by {saved_world} rank(s) and this job has "
                              f"{world}; valid: resume rl on the same world size")
        loaded = CheckpointStore(Path(resume_from).parent).load(resume_from, {**parts, "progress": None})
        progress = loaded["progress"]
        first, episodes, solved = int(progress["update"]), int(progress["episodes"]), bool(progress["solved"])
        recent.extend(progress["recent"])
        mean_return = sum(recent) / len(recent) if recent else float("nan")
        if mg.is_main():
            log(f"resumed at update {first} of {num_updates} ({first * steps_per_update:,} env-steps)")
    obs, episode_return, reset_step = loop["obs"], loop["episode_return"], loop["reset_step"]
    callbacks = []
    if cfg.callbacks:
        from multigpu.factory import call_factory

        callbacks = [call_factory(spec, what="callbacks") for spec in cfg.callbacks]
    meter = StepMeter.from_context(
        "env-steps", dataclasses.replace(run or context.current(), run_dir=str(run_dir) if run_dir else None),
        total_steps=max(num_updates - first, 1), description=f"ppo {cfg.env_name}", log_every=cfg.log_every,
        warmup_steps=1)

    def save(done: int) -> None:
        loop.update(obs=obs, episode_return=episode_return, reset_step=reset_step)
        progress = {"update": done, "episodes": episodes, "solved": solved, "recent": list(recent)}
        store.save(done, {**parts, "progress": progress, "spec": _spec_state(spec, cfg)})

    start = time.perf_counter()
    update = first - 1
    for update in range(first, num_updates if not solved else first):
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
                    try:
                        action = head.sample(out, sample_gen)
                    except (ValueError, RuntimeError):  # torch's distributions on NaN logits: say why, if it is the env
                        _refuse_nonfinite(cfg, update, t, obs=obs)
                        raise
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
            if not bool(torch.isfinite(obs_buf).all() & torch.isfinite(rew_buf).all()):  # one sync per rollout
                _refuse_nonfinite(cfg, update, None, obs=obs_buf, reward=rew_buf)

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

        if cfg.target_return is not None and len(recent) == cfg.return_window and mean_return >= cfg.target_return:
            solved = True
        done = update + 1
        if store is not None and (solved or done == num_updates or (cfg.checkpoint_every
                                                                      and done % cfg.checkpoint_every == 0)):
            save(done)
        state = _Progress(done)
        for callback in callbacks:
            callback.on_step(state)
        if solved:
            break
    env_steps = (update + 1) * steps_per_update
    wall_s = time.perf_counter() - start
    getattr(envs, "close", lambda: None)()
    if mg.is_main():
        verdict = "solved" if solved else "not solved"
        log(f"{verdict} {cfg.env_name}: mean return {mean_return:.1f} over the last {len(recent)} episodes "
            f"after {env_steps:,} env-steps and {update + 1} updates, {wall_s:.1f} s on {world} rank(s)")
    result = PPOResult(solved=solved, env_steps=env_steps, wall_s=wall_s, mean_return=mean_return, episodes=episodes)
    meter.close({"rl": {**result.__dict__, "world_size": world, "num_envs": num_envs, "updates": update + 1,
                        "env": cfg.env_name, "obs_norm": norm.summary() if norm is not None else None,
                        "resumed_from": str(resume_from) if resume_from else None}})
    return result


@dataclass
class _Progress:
    step: int
    """Updates done (what a callback's ``on_step`` sees)."""


def _spec_state(spec, cfg: RLConfig) -> dict:
    """What :func:`load_policy` needs to rebuild the network and its action map, as plain values and tensors."""
    action_map = {k: (torch.as_tensor(v, dtype=torch.float64) if k in ("low", "high") else
                      (list(v) if isinstance(v, tuple) else v)) for k, v in spec.action_map.items()}
    return {"obs_dim": spec.obs_dim, "discrete": spec.discrete, "action_dim": spec.action_dim,
            "action_map": action_map, "hidden_size": cfg.hidden_size, "log_std_init": cfg.log_std_init}


class TrainedPolicy(nn.Module):
    """A trained PPO policy: observations (normalized as in training) -> actions in the environment's space.

    ``forward(obs)`` returns the deterministic action (the most likely one; a Gaussian's mean, mapped onto
    the Box); ``network`` is the actor-critic itself (``network(x) -> (out, value)`` on normalized ``x``).
    """

    def __init__(self, network: nn.Module, spec: PolicySpec, mean: torch.Tensor | None, var: torch.Tensor | None,
                 clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.network, self.spec, self.clip = network, spec, clip
        self.normalize = mean is not None
        self.register_buffer("obs_mean", (mean if mean is not None else torch.zeros(spec.obs_dim)).float())
        self.register_buffer("obs_inv_std", torch.rsqrt(var + eps).float() if var is not None
                             else torch.ones(spec.obs_dim))
        self._map = spec.make_map("cpu")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(obs).reshape(-1, self.spec.obs_dim).float()
        if self.normalize:
            x = ((x - self.obs_mean) * self.obs_inv_std).clamp(-self.clip, self.clip)
        out, _ = self.network(x)
        action = out.argmax(-1) if self.spec.discrete else out.chunk(2, -1)[0]
        return self._map(action)


def load_policy(run_dir) -> TrainedPolicy:
    """The policy of an ``rl`` run (its newest valid checkpoint) as a module on the CPU, in eval mode.

        policy = load_policy("runs/rl/20260101-120000")
        action = policy(obs)            # (n, *obs_shape) -> (n,) or (n, *action_shape)

    Raises:
        ConfigError: the folder holds no rl checkpoint.
    """
    store = CheckpointStore(Path(run_dir) / CHECKPOINTS, warn=lambda _: None)
    path = store.latest()
    if path is None:
        raise ConfigError(f"{run_dir} holds no checkpoint of an rl run (no {CHECKPOINTS}/step_*/ that verifies); "
                          "valid: the run directory of `multigpu rl`")
    loaded = CheckpointStore(path.parent).load(path, {"spec": None, "policy": None, "normalizer": None})
    raw = loaded["spec"]
    action_map = {k: (v.numpy() if isinstance(v, torch.Tensor) else tuple(v) if k == "shape" else v)
                  for k, v in raw["action_map"].items()}
    spec = PolicySpec(int(raw["obs_dim"]), bool(raw["discrete"]), int(raw["action_dim"]), action_map)
    network = spec.make_network(int(raw["hidden_size"]), float(raw["log_std_init"]))
    network.load_state_dict(loaded["policy"])
    norm = loaded["normalizer"]
    policy = TrainedPolicy(network, spec, norm["mean"] if norm else None, norm["var"] if norm else None)
    return policy.eval()

