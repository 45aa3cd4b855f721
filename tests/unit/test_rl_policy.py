"""PPO for any action space and any batched environment: the pieces that need no process group.

These pin the Gaussian head against ``torch.distributions`` (a wrong log-prob or entropy still
trains, just badly, so nothing else would catch it), the map onto a Box's bounds, the spaces PPO
refuses with one line, the calling convention of an environment factory, and the adapter that
turns a NumPy (or torch) vector environment into tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import multigpu as mg
from multigpu.envs.adapter import TorchVectorEnv, autoreset_mode_of
from multigpu.envs.spaces import Box, Discrete, MultiDiscrete
from multigpu.errors import ConfigError
from multigpu.rl.normalize import ObsNormalizer
from multigpu.rl.policy import ActionMap, Categorical, DiagGaussian, GaussianActorCritic, policy_for

HERE = "tests.unit.test_rl_policy"


def test_gaussian_log_prob_and_entropy_match_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    mean, log_std = torch.randn(50, 3, generator=gen), torch.randn(50, 3, generator=gen) * 0.5
    out = torch.cat((mean, log_std), -1)
    action = DiagGaussian().sample(out, gen)
    ref = torch.distributions.Independent(torch.distributions.Normal(mean, log_std.exp()), 1)
    assert torch.allclose(DiagGaussian().log_prob(out, action), ref.log_prob(action), atol=1e-5)
    assert torch.allclose(DiagGaussian().entropy(out), ref.entropy(), atol=1e-6)
    # samples follow N(mean, std): standardized, they have mean ~0 and std ~1
    many = torch.cat((mean[:1].expand(20_000, 3), log_std[:1].expand(20_000, 3)), -1)
    z = (DiagGaussian().sample(many, gen) - mean[:1]) / log_std[:1].exp()
    assert z.mean(0).abs().max() < 0.05 and (z.std(0) - 1).abs().max() < 0.05


def test_categorical_head_matches_torch_distributions():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 5, generator=gen)
    action = Categorical().sample(logits, gen)
    ref = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(Categorical().log_prob(logits, action), ref.log_prob(action), atol=1e-6)
    assert torch.allclose(Categorical().entropy(logits), ref.entropy(), atol=1e-6)


def test_gaussian_network_shapes_and_state_independent_log_std():
    net = GaussianActorCritic(obs_dim=3, action_dim=2, hidden=16, log_std_init=-0.5)
    out, value = net(torch.randn(7, 3))
    assert out.shape == (7, 4) and value.shape == (7,)
    assert torch.equal(out[:, 2:], torch.full((7, 2), -0.5))
    out.sum().backward()
    assert net.log_std.grad is not None  # it flows through forward, so DDP sees it used


def test_action_map_clips_or_squashes_into_the_bounds_and_passes_unbounded_dimensions():
    low, high = np.array([-2.0, 0.0, -np.inf], np.float32), np.array([2.0, 10.0, np.inf], np.float32)
    a = torch.tensor([[-5.0, -5.0, -5.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [5.0, 5.0, 5.0]])
    clip = ActionMap(low=low, high=high, shape=(3,), bounds="clip")(a)
    assert clip.tolist() == [[-2.0, 0.0, -5.0], [0.0, 5.0, 0.0], [1.0, 7.5, 0.5], [2.0, 10.0, 5.0]]
    bounded = ActionMap(low=low[:2], high=high[:2], shape=(2,), bounds="tanh")(a[:, :2] * 100)
    assert bounded.min(0).values.tolist() >= [-2.0, 0.0] and bounded.max(0).values.tolist() <= [2.0, 10.0]
    squash = ActionMap(low=low[:2], high=high[:2], shape=(2,), bounds="tanh")(a[:, :2])
    assert squash[2].tolist() == pytest.approx([2 * math.tanh(0.5), 5 + 5 * math.tanh(0.5)])
    # a (2, 2) Box: the policy's flat 4 numbers go back to the space's shape; Discrete(3, start=-1) shifts
    assert ActionMap(low=-np.ones((2, 2)), high=np.ones((2, 2)), shape=(2, 2))(torch.zeros(5, 4)).shape == (5, 2, 2)
    assert ActionMap(start=-1)(torch.tensor([0, 2])).tolist() == [-1, 1]


def test_spaces_ppo_cannot_act_in_get_one_line():
    box3 = Box(np.zeros(3, np.float32), np.ones(3, np.float32), (3,))
    unbounded = Box(np.full(1, -np.inf, np.float32), np.full(1, np.inf, np.float32), (1,))
    assert policy_for(box3, Discrete(4)).discrete and policy_for(box3, box3).action_dim == 3
    assert not policy_for(box3, unbounded, action_bounds="clip").discrete
    cases = [
        (box3, MultiDiscrete(np.array([2, 2]), (2,)), "action space MultiDiscrete(.*); valid: Discrete or Box"),
        (box3, unbounded, "without finite bounds .*action_bounds=tanh squashes into \\[low, high\\]"),
        (Discrete(5), Discrete(2), "observation space Discrete.*; valid: a Box"),
    ]
    for obs, act, message in cases:
        with pytest.raises(ConfigError, match=message):
            policy_for(obs, act, action_bounds="tanh", what="env.factory 'x:y'")


# ---------------------------------------------------------------------------------------------- environments
class CountingNumpyEnv:
    """A NumPy vector env in gymnasium 1.x's shape: obs = [steps so far, seed]; ends after ``length`` steps."""

    metadata = {"autoreset_mode": "Disabled"}

    def __init__(self, num_envs: int, seed: int, length: int = 3):
        self.num_envs, self.seed, self.length = num_envs, seed, length
        self.single_observation_space = Box(np.zeros(2, np.float32), np.full(2, 1e9, np.float32), (2,))
        self.single_action_space = Box(np.full(1, -1, np.float32), np.ones(1, np.float32), (1,))
        self.t = np.zeros(num_envs, np.int64)
        self.actions: list[np.ndarray] = []

    def _obs(self):
        return np.stack([self.t, np.full(self.num_envs, self.seed)], 1).astype(np.float64)

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seed = seed
        mask = (options or {}).get("reset_mask", np.ones(self.num_envs, bool))
        assert isinstance(mask, np.ndarray) and mask.dtype == np.bool_  # gymnasium insists on this
        self.t[mask] = 0
        return self._obs(), {}

    def step(self, actions):
        assert isinstance(actions, np.ndarray)
        self.actions.append(actions)
        self.t += 1
        done = self.t >= self.length
        return self._obs(), np.ones(self.num_envs), done, np.zeros(self.num_envs, bool), {"t": self.t.copy()}


def make_counting(num_envs: int, seed: int, length: int = 3) -> CountingNumpyEnv:
    return CountingNumpyEnv(num_envs, seed, length)


def test_the_numpy_adapter_hands_back_tensors_and_gives_disabled_envs_same_step_autoreset():
    inner = CountingNumpyEnv(4, seed=0)
    envs = TorchVectorEnv(inner, "cpu", seed_offset=10, autoreset_mode="same_step")
    assert envs.autoreset_mode == "same_step" and autoreset_mode_of(envs) == "same_step"
    obs, _ = envs.reset(seed=5)
    assert obs.dtype == torch.float64 and obs[:, 1].tolist() == [15.0] * 4  # reset seeds get the offset
    for step in range(1, 4):
        obs, reward, terminated, truncated, info = envs.step(torch.zeros(4, 1))
        assert isinstance(inner.actions[-1], np.ndarray) and reward.dtype == torch.float64
        assert terminated.dtype == truncated.dtype == torch.bool and info["t"].tolist() == [step] * 4
    assert terminated.all() and info["_final_obs"].all()
    assert info["final_obs"][:, 0].tolist() == [3.0] * 4 and obs[:, 0].tolist() == [0.0] * 4  # reset on the same step
    assert TorchVectorEnv(CountingNumpyEnv(2, 0)).autoreset_mode == "disabled"  # not asked: left alone


def test_gymnasium_final_obs_object_arrays_become_one_tensor():
    gym = pytest.importorskip("gymnasium")
    inner = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                         vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    envs = TorchVectorEnv(inner, "cpu")
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (3, 4) and envs.autoreset_mode == "same_step"
    for _ in range(200):
        obs, reward, terminated, truncated, info = envs.step(torch.zeros(3, dtype=torch.int64))
        if "_final_obs" in info:
            break
    mask = info["_final_obs"]
    assert mask.any() and info["final_obs"].shape == (3, 4)
    assert torch.equal(info["final_obs"][~mask], obs[~mask]) and info["final_obs"][mask].abs().max() > 0


def test_make_calls_a_factory_with_the_arguments_it_names_and_seeds_by_global_id(monkeypatch):
    envs = mg.envs.make(f"{HERE}:make_counting", num_envs=3, seed=100, kwargs={"length": 2})
    assert isinstance(envs, TorchVectorEnv) and envs.num_envs == 3 and envs.env.length == 2
    # a factory without env_ids, on rank 1 of 2 of 7 envs (ids 4..6): seed + 4, gymnasium's seed + i convention
    from multigpu.envs.adapter import build

    share = build(make_counting, range(4, 7), seed=100, device="cpu")
    assert share.env.seed == 104 and share.reset(seed=100)[0][:, 1].tolist() == [104.0] * 3
    # a registered factory: the same convention (the built-ins take env_ids and keep the seed as it is)
    from multigpu.envs import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registration ends with the test
    mg.envs.register("Counting-v0", make_counting)
    assert mg.envs.make("Counting-v0", num_envs=2, seed=1).env.seed == 1
    assert mg.envs.make("CartPole-v1", num_envs=2, seed=1).seed == 1


@pytest.mark.parametrize("spec, kwargs, message", [
    (f"{HERE}:nope", None, "env factory 'tests.unit.test_rl_policy:nope': 'tests.unit.test_rl_policy' has no "
                           "callable 'nope'; callables there:"),
    (f"{HERE}:make_counting", {"lenght": 2}, "calling make_counting\\(\\) failed: TypeError: .*'lenght'"),
    (f"{HERE}:_no_size", None, "takes neither num_envs nor env_ids"),
    (f"{HERE}:_not_an_env", None, "returned int, which has no 'reset'"),
    (f"{HERE}:_too_many", None, "returned 5 environments; it was asked for num_envs=2"),
    ("Pendulm-v1", None, "unknown environment 'Pendulm-v1'. Did you mean 'Pendulum-v1'?"),
])
def test_bad_factories_are_one_line_errors(spec, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        mg.envs.make(spec, num_envs=2, seed=0, kwargs=kwargs)


def _no_size(seed: int):
    return CountingNumpyEnv(1, seed)


def _not_an_env(num_envs: int):
    return 3


def _too_many(num_envs: int, seed: int):
    return CountingNumpyEnv(5, seed)


def test_obs_normalizer_on_one_process_tracks_the_data_and_clips():
    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(300, 3, generator=gen) * torch.tensor([1.0, 5.0, 0.1]) + 1000.0 for _ in range(3)]
    norm = ObsNormalizer(3)
    for part in parts:
        norm.observe(part)
        norm.sync()
    data = torch.cat(parts).double()
    assert norm.count == 900
    assert torch.allclose(norm.mean, data.mean(0), rtol=0, atol=1e-9)
    assert torch.allclose(norm.var, data.var(0, unbiased=False), rtol=1e-9)
    x = norm(parts[0])
    assert x.dtype == torch.float32 and x.abs().max() <= 10.0
    assert norm(torch.full((1, 3), 1e9)).tolist() == [[10.0, 10.0, 10.0]]
