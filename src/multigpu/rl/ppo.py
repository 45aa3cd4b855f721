"""Distributed PPO on batched environments (runs inside each rank).

The environments are split across ranks (``mg.envs.make(..., split=True)``),
each rank collects a rollout from its share, and the policy is one
``DistributedDataParallel`` model: every minibatch's gradients are averaged
over ranks in backward (one all-reduce of one bucket), so all ranks apply the
same update. Completed episodes' returns are gathered from every rank while
the update runs (one all-gather, waited for after it), so the moving mean that
decides "solved" is the same number on every rank and every rank stops at the
same update.

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

The loop is :func:`train`: a :class:`multigpu.run.Run` over the updates, each one :func:`rollout` then
:func:`learn`. The run owns the checkpoints (``<run_dir>/checkpoints``, every ``checkpoint_every`` updates,
after the last and when the target is reached; in the background with ``checkpoint_mode=async``): the
policy, the optimizer, the normalizer's statistics, the counters and moving returns, and every rank's
environments, current observations and sampling generator; a resumed run continues bit-identically to an
uninterrupted one on the same world size. On another world size (``--resume`` there, or an elastic job that lost
or regained a node) the same environments are re-split by global id (:func:`_resplit`), checked bit for bit
against the digest saved with the checkpoint and recorded as a resize (:mod:`multigpu.checkpoint.resize`); each
rank's sampling generator is then seeded afresh from (seed, rank, update). :func:`load_policy` reads the newest
one back as a module.

Glossary: *update* = one rollout plus ``update_epochs`` passes over it;
*env-step* = one environment advancing once (the meter's unit).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import multigpu as mg
from multigpu.checkpoint import CHECKPOINTS, CheckpointStore, PerRank
from multigpu.envs.adapter import autoreset_mode_of
from multigpu.envs.split import env_id_range
from multigpu.errors import ConfigError
from multigpu.rl.config import RLConfig
from multigpu.rl.normalize import ObsNormalizer
from multigpu.rl.policy import ActorCritic, PolicySpec, policy_for
from multigpu.run import Run, script_context
from multigpu.runtime import context
from multigpu.train.strategies import wrap_ddp

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
    interrupted: int = 0
    """The signal that ended training early with ``checkpoint_on_interrupt`` (0: none); its update's checkpoint
    is on disk."""


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


class _Learner:
    """The policy side on this rank: the network (DDP-wrapped across ranks), its head and action map, the
    observation normalizer and the optimizer."""

    def __init__(self, cfg: RLConfig, spec: PolicySpec, device: torch.device, n: int):
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        self.agent = spec.make_network(cfg.hidden_size, cfg.log_std_init).to(device)
        self.head, self.to_env = spec.make_head(), spec.make_map(device)
        self.norm = ObsNormalizer(spec.obs_dim, device) if cfg.obs_norm else None
        self.optimizer = torch.optim.Adam(self.agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.model, self.comm = self.agent, None
        if mg.world_size() > 1:  # grads averaged over ranks in backward, the all-reduces timed into the comm share
            self.model, self.comm = wrap_ddp(self.agent, mg.get_env("rl.train"), "auto")
        self.n = n

    def input(self, raw: torch.Tensor) -> torch.Tensor:
        """What the network sees of raw observations: flattened floats, normalized with ``obs_norm``."""
        x = raw.reshape(self.n, -1).float()
        return self.norm(x) if self.norm is not None else x


class _Rollout:
    """This rank's environments, their current observations and episode sums, its sampling generator, and the
    rollout storage ``(num_steps, n, ...)``. ``state_dict``: the per-rank checkpoint part."""

    def __init__(self, cfg: RLConfig, envs, spec: PolicySpec, device: torch.device, next_step: bool):
        n, steps = envs.num_envs, cfg.num_steps
        self.envs, self.n, self.device, self.next_step = envs, n, device, next_step
        self.on_host = _reads_on_host(device)
        # each rank explores its own way
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + mg.rank())
        self.obs_buf = torch.zeros(steps, n, spec.obs_dim, device=device)
        self.act_buf = (torch.zeros(steps, n, dtype=torch.int64, device=device) if spec.discrete
                        else torch.zeros(steps, n, spec.action_dim, device=device))
        self.logp_buf, self.rew_buf, self.done_buf, self.val_buf = (torch.zeros(steps, n, device=device)
                                                                    for _ in range(4))
        self.valid_buf = torch.ones(steps, n, dtype=torch.bool, device=device)  # False: a next-step reset step
        # the returns of the episodes ending, when they are read once per rollout
        self.ended_buf = None if self.on_host else torch.zeros(steps, n, device=device)
        self.obs, _ = envs.reset(seed=cfg.seed)
        self.episode_return = torch.zeros(n, device=device)
        self.reset_step = torch.zeros(n, dtype=torch.bool, device=device)  # next-step autoreset: this step only resets

    def state_dict(self) -> dict:
        envs = self.envs.state_dict() if hasattr(self.envs, "state_dict") else None
        return {"envs": envs, "gen": self.gen.get_state(), "obs": self.obs.clone(),
                "episode_return": self.episode_return.clone(), "reset_step": self.reset_step.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["envs"] is not None and hasattr(self.envs, "load_state_dict"):
            self.envs.load_state_dict(state["envs"])
        self.gen.set_state(state["gen"])
        self.obs = state["obs"].to(self.device)
        self.episode_return = state["episode_return"].to(self.device)
        self.reset_step = state["reset_step"].to(self.device)


class _Progress:
    """Updates done, episodes ended, the moving window of returns and whether the target was reached: the same
    on every rank (a checkpoint part, ``progress``)."""

    def __init__(self, window: int):
        self.update, self.episodes, self.solved = 0, 0, False
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def mean_return(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else float("nan")

    def add(self, returns: list[float]) -> None:
        self.recent.extend(returns)
        self.episodes += len(returns)

    def state_dict(self) -> dict:
        return {"update": self.update, "episodes": self.episodes, "solved": self.solved, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.update, self.episodes, self.solved = int(state["update"]), int(state["episodes"]), bool(state["solved"])
        self.recent.clear()
        self.recent.extend(state["recent"])


class _Module:
    """A module as a checkpoint part whose tensors come back on the module's own device."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def rollout(cfg: RLConfig, ro: _Rollout, learner: _Learner, update: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``num_steps`` steps of this rank's environments under the current policy (no gradients, no communication).

    Fills the rollout storage; returns the advantages, the returns and the returns of the episodes that ended."""
    agent, head, norm, cfg_gamma = learner.agent, learner.head, learner.norm, cfg.gamma
    obs, episode_return, reset_step = ro.obs, ro.episode_return, ro.reset_step
    finished = []
    with torch.no_grad():
        for t in range(cfg.num_steps):
            if norm is not None:
                norm.observe(obs.reshape(ro.n, -1))
            x = learner.input(obs)
            out, value = agent(x)
            try:
                action = head.sample(out, ro.gen)
            except (ValueError, RuntimeError):  # torch's distributions on NaN logits: say why, if it is the env
                _refuse_nonfinite(cfg, update, t, obs=obs)
                raise
            ro.obs_buf[t], ro.act_buf[t], ro.val_buf[t] = x, action, value
            ro.logp_buf[t] = head.log_prob(out, action)
            obs, reward, terminated, truncated, info = ro.envs.step(learner.to_env(action))
            reward = torch.as_tensor(reward, device=ro.device).float()
            done = terminated | truncated
            episode_return += reward
            ro.rew_buf[t] = reward * cfg.reward_scale if cfg.reward_scale != 1.0 else reward
            if ro.next_step:
                ro.valid_buf[t] = ~reset_step
                reset_step = done
            if ro.on_host:
                any_ended = bool(done.any()) if ro.next_step else "_final_obs" in info
                if any_ended:  # some episode ended: log its return, bootstrap the truncated ones
                    if truncated.any():
                        final = obs if ro.next_step else info["final_obs"]  # next-step: obs is the last one
                        ro.rew_buf[t] += cfg_gamma * agent(learner.input(final))[1] * truncated
                    finished.append(episode_return[done].clone())
                    episode_return[done] = 0.0
            else:  # no host read: bootstrap every step (times truncated: + 0 where none was cut)
                final = obs if ro.next_step else info.get("final_obs", obs)
                ro.rew_buf[t] += cfg_gamma * agent(learner.input(final))[1] * truncated
                ro.ended_buf[t] = episode_return
                episode_return.masked_fill_(done, 0.0)
            ro.done_buf[t] = done.float()
        if not ro.on_host:  # the ended episodes' returns, in step then environment order: one read
            finished.append(ro.ended_buf[ro.done_buf.bool()])
        advantages, returns = _advantages(cfg, ro.rew_buf, ro.val_buf, ro.done_buf, agent(learner.input(obs))[1])
    ro.obs, ro.episode_return, ro.reset_step = obs, episode_return, reset_step
    if not bool(torch.isfinite(ro.obs_buf).all() & torch.isfinite(ro.rew_buf).all()):  # one sync per rollout
        _refuse_nonfinite(cfg, update, None, obs=ro.obs_buf, reward=ro.rew_buf)
    return advantages, returns, finished


class _EndedReturns:
    """The returns of the episodes that ended in this rollout on every rank, in rank order, gathered in the
    background: one ``all_gather`` of a fixed-size float64 tensor per rank (the count, then the returns, exact
    for float32 sums), started here and waited for (under the collective timeout) by :meth:`wait`."""

    def __init__(self, finished: list[torch.Tensor], cap: int, device: torch.device):
        mine = torch.cat(finished).to(torch.float64) if finished else torch.zeros(0, dtype=torch.float64)
        self.parts: list[torch.Tensor] | None = None
        if mg.world_size() == 1:
            self.local = mine
            return
        from multigpu.runtime.collectives import record_traffic

        if mine.numel() > cap:  # at most one end per environment and step
            raise RuntimeError(f"rank {mg.rank()} ended {mine.numel()} episodes in one rollout, more than {cap}")
        buf = torch.zeros(cap + 1, dtype=torch.float64, device=device)
        buf[0] = mine.numel()
        buf[1:1 + mine.numel()] = mine
        self.parts = [torch.empty_like(buf) for _ in range(mg.world_size())]
        record_traffic("all_gather", buf.numel() * buf.element_size())
        self.work = torch.distributed.all_gather(self.parts, buf, async_op=True)

    def wait(self) -> list[float]:
        if self.parts is None:
            return self.local.tolist()
        import datetime

        from multigpu.runtime import group
        from multigpu.runtime.collectives import timed_collective

        with timed_collective("all_gather", self.parts[0].device):
            self.work.wait(datetime.timedelta(seconds=group.timeout_s()))
        return [value for part in torch.stack(self.parts).cpu() for value in part[1:1 + int(part[0])].tolist()]


def learn(cfg: RLConfig, ro: _Rollout, learner: _Learner, advantages: torch.Tensor, returns: torch.Tensor) -> None:
    """PPO's epochs over this rank's rollout; DDP averages every minibatch's gradients over the ranks."""
    b_obs, b_act, b_logp = ro.obs_buf.flatten(0, 1), ro.act_buf.flatten(0, 1), ro.logp_buf.flatten()
    b_adv, b_ret, b_val = advantages.flatten(), returns.flatten(), ro.val_buf.flatten()
    if ro.next_step:  # leave out the steps that only reset an environment
        keep = ro.valid_buf.flatten()
        b_obs, b_act, b_logp, b_adv, b_ret, b_val = (b[keep] for b in (b_obs, b_act, b_logp, b_adv, b_ret, b_val))
    head, optimizer = learner.head, learner.optimizer
    local_batch = b_obs.shape[0]
    for _ in range(cfg.update_epochs):
        order = torch.randperm(local_batch, generator=ro.gen, device=ro.device)
        for mb in order.tensor_split(cfg.num_minibatches):  # the same count on every rank: DDP's collectives pair up
            out, value = learner.model(b_obs[mb])
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
            nn.utils.clip_grad_norm_(learner.agent.parameters(), cfg.max_grad_norm)
            optimizer.step()


def train(cfg: RLConfig, ctx: context.RunContext | None = None, *, log=print) -> PPOResult:
    """Train until the target return or the env-step budget; call on all ranks after ``mg.init``.

    ``ctx``: the run context (the job's; a plain script: ``multigpu.run.script_context(run_dir, resume)``;
    None: nothing written, nothing resumed). Rank 0 writes ``metrics.jsonl``, ``summary.json`` and the
    checkpoints into its run directory.
    """
    world = mg.world_size()
    envs, autoreset, spec = _make_envs(cfg, cfg.num_envs)
    device = torch.device(envs.device)
    learner = _Learner(cfg, spec, device, envs.num_envs)
    ro = _Rollout(cfg, envs, spec, device, autoreset == "next_step")
    if learner.norm is not None:  # statistics of the first observations, before the first rollout uses them
        learner.norm.observe(ro.obs.reshape(ro.n, -1))
        learner.norm.sync()
    progress = _Progress(cfg.return_window)
    steps_per_update = cfg.num_envs * cfg.num_steps
    returns_cap = -(-cfg.num_envs // world) * cfg.num_steps  # the most episodes one rank's rollout can end
    num_updates = max(1, cfg.total_env_steps // steps_per_update)
    state = {"policy": _Module(learner.agent), "optimizer": learner.optimizer, "rank": PerRank(ro),
             "normalizer": learner.norm,  # None without obs_norm: saved as None
             "progress": progress, "spec": _spec_state(spec, cfg)}
    run = Run(ctx if ctx is not None else script_context(), state, total=num_updates,
              checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last, mode=cfg.checkpoint_mode,
              callbacks=cfg.callbacks, unit="env-steps", description=f"ppo {cfg.env_name}", log_every=cfg.log_every,
              on_interrupt=cfg.checkpoint_on_interrupt,
              meta=lambda: {"env_digest": _env_digest(ro)})  # what a resume on another size checks against
    if run.resume_from is not None:
        _resume(run, cfg, ro, world, num_updates, steps_per_update, log)

    start = time.perf_counter()
    for update in run.steps(num_updates if not progress.solved else run.start):
        run.add_items(ro.n * cfg.num_steps)
        if cfg.anneal_lr:
            learner.optimizer.param_groups[0]["lr"] = cfg.learning_rate * (1.0 - update / num_updates)
        advantages, returns, finished = rollout(cfg, ro, learner, update)
        # the episodes that ended on any rank, in rank order: the same moving mean everywhere (one small collective,
        # in flight during the update: a rank that finished its rollout first starts learning instead of waiting)
        ended = _EndedReturns(finished, returns_cap, ro.device)
        if learner.norm is not None:
            learner.norm.sync()  # every rank's observations of this rollout: the next one is normalized identically
        learn(cfg, ro, learner, advantages, returns)
        progress.add(ended.wait())
        run.meter.extras["return"] = progress.mean_return
        if learner.comm is not None:
            run.meter.add_comm(learner.comm.pop_seconds())
        progress.update = update + 1
        if (cfg.target_return is not None and len(progress.recent) == cfg.return_window
                and progress.mean_return >= cfg.target_return):
            progress.solved = True
            run.stop("solved")
    updates = run.step
    env_steps = updates * steps_per_update
    wall_s = time.perf_counter() - start
    getattr(envs, "close", lambda: None)()
    if run.interrupted:  # Ctrl-C/SIGTERM with checkpoint_on_interrupt: the checkpoint of this update is written
        run.close()
        if mg.is_main() and run.checkpoints is not None:
            again = run.ctx.resume_command or f"multigpu rl --run-dir {run.run_dir} --resume auto"
            log(f"interrupted after update {updates}: checkpoint {run.checkpoints.path_for(updates)}; "
                f"continue with: {again}")
        return PPOResult(solved=False, env_steps=env_steps, wall_s=wall_s, mean_return=progress.mean_return,
                         episodes=progress.episodes, interrupted=run.signal)
    if mg.is_main():
        verdict = "solved" if progress.solved else "not solved"
        log(f"{verdict} {cfg.env_name}: mean return {progress.mean_return:.1f} over the last {len(progress.recent)} "
            f"episodes after {env_steps:,} env-steps and {updates} updates, {wall_s:.1f} s on {world} rank(s)")
    result = PPOResult(solved=progress.solved, env_steps=env_steps, wall_s=wall_s, mean_return=progress.mean_return,
                       episodes=progress.episodes)
    norm = learner.norm
    run.close({"rl": {**result.__dict__, "world_size": world, "num_envs": cfg.num_envs, "updates": updates,
                      "env": cfg.env_name, "obs_norm": norm.summary() if norm is not None else None,
                      "resumed_from": str(run.resume_from) if run.resume_from else None}})
    return result


def _resume(run: Run, cfg: RLConfig, ro: _Rollout, world: int, num_updates: int, steps_per_update: int,
            log) -> None:
    """Load the run's checkpoint into its state. Written by another number of ranks: the same environments,
    re-split for this one (:func:`_resplit`), checked against the saved digest and recorded as a resize."""
    from multigpu.checkpoint.resize import resized_from

    manifest = run.manifest  # the run read it: its world size says how this run loads
    _check_network(run, cfg)
    saved_world = manifest["world_size"]
    before = resized_from(run.run_dir, saved_world, world)
    if saved_world == world:
        run.load()
        if before is not None:  # the group before ran at another size from this same checkpoint
            _record_resize(run, (manifest.get("meta") or {}).get("env_digest"), _env_digest(ro), before, world, log)
    else:
        loaded = run.load({**{k: v for k, v in run.state.items() if k != "rank"}, "rank": None})  # every rank's
        ro.load_state_dict(_resplit(loaded["rank"], cfg, ro, run.resume_from, saved_world, world, run.start))
        saved = (loaded["_manifest"].get("meta") or {}).get("env_digest")
        _record_resize(run, saved, _env_digest(ro), before, world, log)
    if mg.is_main():
        log(f"resumed at update {run.start} of {num_updates} ({run.start * steps_per_update:,} env-steps)")


_PER_ENV = ("obs", "episode_return", "reset_step")
"""The rollout's own per-environment state (the environment is the first dimension); the environments' own are
their state's tensors whose *last* dimension is the environment (:func:`_per_env`: a
:class:`~multigpu.envs.VectorEnv` keeps its physics as ``(state_dim, num_envs)``, its counters as ``(num_envs,)``)."""


def _per_env(envs_state: dict, n: int) -> list[str]:
    return sorted(k for k, v in envs_state.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[-1] == n)


def _resplit(states: list[dict], cfg: RLConfig, ro: _Rollout, path, saved_world: int, world: int,
             update: int) -> dict:
    """This rank's share of every rank's saved rollout state (``states``, in rank order): each rank held a
    contiguous slice of the global environment ids, so their rows concatenated are every environment in id order,
    and this rank takes its slice of the new split. Its generator is seeded from (seed, rank, update)."""
    if not isinstance(states, list) or len(states) != saved_world:
        raise ConfigError(f"checkpoint {path}: its per-rank rollout state is not one entry per rank of the "
                          f"{saved_world} that wrote it; valid: a checkpoint written by multigpu rl")
    if any(state.get("envs") is None for state in states) or not hasattr(ro.envs, "load_state_dict"):
        raise ConfigError(f"checkpoint {path} was written by {saved_world} rank(s) and this job has {world}; "
                          f"{cfg.env_name}'s environments do not save their state, so they cannot be re-split; "
                          f"valid: resume on {saved_world} rank(s), or a built-in environment (env_id)")
    sizes = [int(state["episode_return"].shape[0]) for state in states]
    keys = _per_env(states[0]["envs"], sizes[0])
    whole = {f"envs.{k}": torch.cat([state["envs"][k] for state in states], dim=-1) for k in keys}
    whole.update({k: torch.cat([state[k] for state in states]) for k in _PER_ENV})
    ids = whole.get("envs.env_ids")
    if sum(sizes) != cfg.num_envs or (ids is not None and not torch.equal(ids.cpu().long(),
                                                                           torch.arange(cfg.num_envs))):
        raise ConfigError(f"checkpoint {path} holds {sum(sizes)} environments in its ranks, not the ids 0..."
                          f"{cfg.num_envs - 1} of num_envs={cfg.num_envs}; valid: resume with the num_envs it was "
                          "written with")
    mine = env_id_range(cfg.num_envs, rank=mg.rank(), world_size=world)
    envs = {k: v for k, v in states[0]["envs"].items() if k not in keys}  # the same on every rank (the seed)
    envs.update({k: whole[f"envs.{k}"][..., mine.start:mine.stop].clone() for k in keys})
    gen = torch.Generator(device=ro.device).manual_seed((cfg.seed * 1_000_003 + mg.rank()) ^ (update << 24))
    return {"envs": envs, "gen": gen.get_state(),
            **{k: whole[k][mine.start:mine.stop].clone() for k in _PER_ENV}}


def _env_digest(ro: _Rollout) -> str | None:
    """A digest of every environment's state in the job and of the rollout's per-environment state (the current
    observations, episode sums, pending resets): the same however the environments are split, bit for bit
    (:func:`multigpu.checkpoint.resize.row_digest`). None where the environments do not save their state. A
    collective."""
    from multigpu.checkpoint.resize import row_digest
    from multigpu.runtime import collectives

    envs = ro.envs.state_dict() if hasattr(ro.envs, "state_dict") else None
    if envs is None:
        return None
    rows = {f"envs.{k}": envs[k].movedim(-1, 0) for k in _per_env(envs, ro.n)}  # a row per environment
    rows.update({"obs": ro.obs, "episode_return": ro.episode_return, "reset_step": ro.reset_step})
    total = torch.tensor([row_digest(rows), ro.n], dtype=torch.int64)
    if mg.world_size() > 1:
        collectives.all_reduce(total, "sum", check_shapes=False)
    return f"{int(total[0]) & (2**64 - 1):016x}-{int(total[1])}"


def _record_resize(run: Run, saved: str | None, loaded: str | None, saved_world: int, world: int, log) -> None:
    from multigpu.checkpoint.resize import digest_check, recorded

    check = digest_check(saved, loaded or "", ["envs"])
    if mg.is_main():
        log(recorded("rl", run.run_dir, from_ranks=saved_world, to_ranks=world, step=run.start,
                     checkpoint=run.resume_from, check=check, unit="update"))


_NETWORK_KEYS = ("hidden_size", "log_std_init")
"""The config keys the saved network's sizes follow (its ``spec`` in state.pt records them)."""


def _check_network(run: Run, cfg: RLConfig) -> None:
    """Before loading: the network the checkpoint's state.pt records (its ``spec``) is the one this config builds.
    The launcher compares the config the checkpoint's manifest records; one that records none (an older
    checkpoint, or one copied without it) would end in torch's state_dict page ("size mismatch for ...")."""
    path = run.resume_from
    saved = run.read({"spec": None}).get("spec")
    if not isinstance(saved, dict):
        return
    for key in _NETWORK_KEYS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(
                f"--resume: rl.{key} is {getattr(cfg, key)!r} here but {saved[key]!r} in the checkpoint {path} (its "
                f"network, as its state.pt records it), and a resumed rl run keeps it; valid: rl.{key}={saved[key]!r}"
                f", or start a new --run-dir without --resume")


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
    loaded = store.load(path, {"spec": None, "policy": None, "normalizer": None})
    raw = loaded["spec"]
    action_map = {k: (v.numpy() if isinstance(v, torch.Tensor) else tuple(v) if k == "shape" else v)
                  for k, v in raw["action_map"].items()}
    spec = PolicySpec(int(raw["obs_dim"]), bool(raw["discrete"]), int(raw["action_dim"]), action_map)
    network = spec.make_network(int(raw["hidden_size"]), float(raw["log_std_init"]))
    network.load_state_dict(loaded["policy"])
    norm = loaded["normalizer"]
    policy = TrainedPolicy(network, spec, norm["mean"] if norm else None, norm["var"] if norm else None)
    return policy.eval()

