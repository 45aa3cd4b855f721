"""PPO's pure pieces: GAE across episode ends, the config's validation."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.rl.config import RLConfig
from multigpu.rl.ppo import ActorCritic, _advantages


def _gae_by_hand(rewards, values, dones, next_value, gamma, lam):
    """Textbook GAE for one environment, written as plainly as possible."""
    steps = len(rewards)
    adv = [0.0] * steps
    running = 0.0
    for t in reversed(range(steps)):
        following = next_value if t == steps - 1 else values[t + 1]
        alive = 0.0 if dones[t] else 1.0
        delta = rewards[t] + gamma * following * alive - values[t]
        running = delta + gamma * lam * alive * running
        adv[t] = running
    return adv


def test_advantages_stop_at_episode_ends_and_bootstrap_the_last_value():
    cfg = RLConfig(num_steps=5, gamma=0.9, gae_lambda=0.8)
    rewards = torch.tensor([[1.0, 0.5], [1.0, 0.5], [1.0, 2.0], [0.0, 1.0], [1.0, 1.0]])
    values = torch.tensor([[0.5, 1.0], [0.4, 0.2], [0.3, 0.1], [0.2, 0.3], [0.1, 0.6]])
    dones = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    next_value = torch.tensor([0.7, 0.9])
    advantages, returns = _advantages(cfg, rewards, values, dones, next_value)
    for env in range(2):
        expected = _gae_by_hand(rewards[:, env].tolist(), values[:, env].tolist(), dones[:, env].tolist(),
                                float(next_value[env]), 0.9, 0.8)
        assert advantages[:, env].tolist() == pytest.approx(expected)
    assert torch.allclose(returns, advantages + values)


def test_actor_critic_shapes():
    agent = ActorCritic(4, 2, 16)
    logits, value = agent(torch.zeros(7, 4))
    assert logits.shape == (7, 2) and value.shape == (7,)


@pytest.mark.parametrize("change, message", [
    ({"num_envs": 0}, "rl.num_envs must be a whole number >= 1, got 0"),
    ({"gamma": 1.5}, r"rl.gamma must be in \[0, 1\], got 1.5"),
    ({"learning_rate": 0.0}, "rl.learning_rate must be > 0"),
    ({"reward_scale": 0.0}, "rl.reward_scale must be > 0, got 0.0"),
    ({"env_id": "CartPol-v1"}, "rl.env_id: unknown environment 'CartPol-v1'. Did you mean 'CartPole-v1'"),
])
def test_config_rejects_bad_values_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(RLConfig(), **change)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a device sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist) or (
                func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _train_counting_reads(env_id: str, num_steps: int, on_host: bool):
    from multigpu.envs.pendulum import Pendulum
    from multigpu.rl import ppo

    Pendulum.default_max_episode_steps = 6  # episodes end (truncated) within a rollout: the bootstrap path runs
    ppo._reads_on_host = lambda device: on_host  # False: the GPU's rollout, run on the CPU
    cfg = RLConfig(env_id=env_id, num_envs=4, num_steps=num_steps, total_env_steps=4 * num_steps * 2,
                   target_return=None, seed=1, update_epochs=1, num_minibatches=1, hidden_size=8)
    with _HostReads() as reads:
        result = ppo.train(cfg, log=lambda *a: None)
    return result, reads.count


def _rollout_reads_body():
    out = {}
    for env_id in ("CartPole-v1", "Pendulum-v1"):
        out[env_id] = {(steps, host): _train_counting_reads(env_id, steps, host)
                       for steps in (8, 16) for host in (True, False)}
    return out


def test_rollout_on_a_gpu_reads_the_host_once_per_rollout_with_the_same_numbers():
    """On a GPU the rollout must not read a value on the host every env step (each read waits for the
    device): the device path bootstraps truncated episodes and records ended returns without reading, then
    reads them once per rollout. Run on the CPU, it gives the host path's results exactly, and its count of
    host reads does not grow with the rollout's length. Before, every step read ``bool(done.any())`` (and,
    where an episode ended, ``truncated.any()`` and a boolean-mask index)."""
    from multigpu.testing import run_on_ranks

    (got,) = run_on_ranks(_rollout_reads_body, 1, timeout_s=600)
    for env_id, runs in got.items():
        for steps in (8, 16):
            host, device = runs[steps, True][0], runs[steps, False][0]
            assert host.episodes == device.episodes > 0, (env_id, steps)
            assert host.mean_return == device.mean_return, (env_id, steps)
        assert runs[8, False][1] == runs[16, False][1], env_id  # reads per rollout, not per step
        assert runs[16, True][1] > runs[8, True][1] or env_id == "Pendulum-v1", env_id


# ----------------------------------------------------------------------------- non-finite env output
class _Bad:
    """A 4-env continuous task (the Reach of tests/cli/test_rl_byo) whose env 2 returns NaN at its 5th step."""

    def __init__(self, num_envs: int, seed: int, device, what: str, inner=None):
        from tests.cli.test_rl_byo import Reach

        inner = inner or Reach(range(num_envs), seed, torch.device(device))
        self.inner, self.what, self.t = inner, what, 0
        self.num_envs = num_envs
        self.metadata = self.inner.metadata
        self.single_observation_space = self.inner.single_observation_space
        self.single_action_space = self.inner.single_action_space

    def reset(self, *, seed=None, options=None):
        return self.inner.reset(seed=seed, options=options)

    def step(self, actions):  # NaN actions (from NaN observations) are taken as 0 here, as many simulators would
        obs, reward, terminated, truncated, info = self.inner.step(torch.nan_to_num(actions))
        self.t += 1
        if self.t == 5:
            (obs if self.what == "obs" else reward)[2] = float("nan")
        return obs, reward, terminated, truncated, info


def bad_obs(num_envs: int, seed: int, device):
    return _Bad(num_envs, seed, device, "obs")


def bad_reward(num_envs: int, seed: int, device):
    return _Bad(num_envs, seed, device, "reward")


def bad_discrete_obs(num_envs: int, seed: int, device):
    """CartPole: a NaN observation makes NaN logits, and torch's sampling fails mid-rollout."""
    from multigpu.envs.cartpole import CartPole

    return _Bad(num_envs, seed, device, "obs", CartPole(range(num_envs), device=device, seed=seed))


@pytest.mark.parametrize(("factory", "what"), [("bad_obs", "observation (nan) in step 5"),
                                               ("bad_reward", "reward (nan) in step 4"),
                                               ("bad_discrete_obs", "observation (nan) in step 5")])
def test_a_non_finite_observation_or_reward_is_one_line_naming_the_env(factory, what):
    """Before: ~60 lines ending in torch's ``probability tensor contains either inf, nan`` (or a NaN loss)."""
    import multigpu as mg
    from multigpu.factory import Factory
    from multigpu.rl import ppo

    cfg = RLConfig(env=Factory(factory=f"tests.unit.test_rl:{factory}"), num_envs=4, num_steps=8,
                   total_env_steps=64, obs_norm=False)
    threads = torch.get_num_threads()
    mg.init(backend="cpu", threads=threads)
    try:
        with pytest.raises(ConfigError) as info:
            ppo.train(cfg, log=lambda *a: None)
    finally:
        mg.shutdown()
        torch.set_num_threads(threads)
    message = str(info.value)
    assert "\n" not in message and message == (
        f"tests.unit.test_rl:{factory}: environment 2 on rank 0 returned a non-finite {what} of rollout 0; valid: "
        "finite observations and rewards (clip or guard them in the environment)")


def _rollout(num_envs: int = 5):
    from multigpu.rl import ppo

    cfg = RLConfig(env_id="CartPole-v1", num_envs=num_envs, num_steps=4, target_return=None)
    envs, autoreset, spec = ppo._make_envs(cfg, cfg.num_envs)
    ro = ppo._Rollout(cfg, envs, spec, torch.device("cpu"), autoreset == "next_step")
    for _ in range(3):  # a state of its own in every environment
        ro.obs, reward, *_ = envs.step(torch.tensor([0, 1, 1, 0, 1][:num_envs]))
        ro.episode_return += reward
    return cfg, ro


def test_the_env_digest_tells_a_changed_environment_and_a_resize_that_differs_is_named(tmp_path):
    """The rl resize check in the failing direction (tests/dist/test_rl_ranks.py sees only equal digests): the digest
    changes with any environment's physics, counters, observation, episode sum or pending reset; re-split from 3+2 saved ranks it is the same; a resize whose digests differ is recorded as
    not equal, with a WARNING line."""
    from types import SimpleNamespace

    from multigpu.checkpoint.resize import read_resizes
    from multigpu.rl import ppo

    cfg, ro = _rollout()
    base = ppo._env_digest(ro)
    assert base.endswith("-5") and base == ppo._env_digest(ro)
    clean = copy.deepcopy(ro.state_dict())
    changes = {"physics": lambda s: s["envs"]["state"].__setitem__((2, 3), s["envs"]["state"][2, 3] + 1e-6),
               "counter": lambda s: s["envs"]["elapsed_steps"].__setitem__(4, 99),
               "obs": lambda s: s["obs"].__setitem__((1, 0), s["obs"][1, 0] + 1e-6),
               "episode sum": lambda s: s["episode_return"].__setitem__(0, s["episode_return"][0] + 1),
               "pending reset": lambda s: s["reset_step"].__setitem__(3, True)}
    for what, change in changes.items():
        state = copy.deepcopy(clean)
        change(state)
        ro.load_state_dict(state)
        assert ppo._env_digest(ro) != base, what
    other = ppo._env_digest(ro)  # the last change's
    ro.load_state_dict(copy.deepcopy(clean))
    assert ppo._env_digest(ro) == base
    halves = [{"envs": {k: (v[..., a:b].clone() if isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == 5
                            else v) for k, v in clean["envs"].items()},
               **{k: clean[k][a:b].clone() for k in ppo._PER_ENV}} for a, b in ((0, 3), (3, 5))]
    _, again = _rollout()
    again.load_state_dict({**again.state_dict(), **ppo._resplit(halves, cfg, again, "ckpt", 2, 1, 3)})
    assert ppo._env_digest(again) == base  # 3 + 2 saved ranks, re-split for one: bit for bit
    lines: list[str] = []
    run = SimpleNamespace(run_dir=tmp_path, start=3, resume_from="ckpt")
    ppo._record_resize(run, base, base, 2, 1, lines.append)
    ppo._record_resize(run, base, other, 2, 3, lines.append)
    assert lines[0].endswith(f"the state loaded equals the saved one, bit for bit (digest {base})")
    assert lines[1] == (f"multigpu rl: resized from 2 to 3 rank(s) at update 3: WARNING: the state loaded differs "
                        f"from the saved one (digest {other}, saved {base})")
    records = read_resizes(tmp_path)
    assert [r["check"]["equal"] for r in records] == [True, False]
