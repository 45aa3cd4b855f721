"""The CPU host step (NumPy views plus a few torch calls) gives the torch formulation's results bit for bit.

On the CPU, CartPole-v1 and Pendulum-v1 (up to its measured crossover) step through ``_dynamics_host`` (NumPy for the exact
arithmetic, torch for sin/cos and the fused multiply-adds) and NumPy
bookkeeping for autoreset, with initial states drawn ahead of the resets; CartPole-v1 in float32 with next-step
autoreset and int or bool actions steps as one C loop (``multigpu.sim.native``'s ``mg_cartpole_step``) after
torch's sin and cos.
``_dynamics`` (the torch formulation that accelerators run, and what the CPU
ran before) is the reference: every observation, reward, flag and info entry
must be equal, bit for bit, in every autoreset mode, in float32 and float64,
with integer, bool and float actions (NaN included: it must terminate the
same way), on both sides of the masked/indexed reset crossover, and across
``reset(seed=...)`` and ``reset(options={"reset_mask": ...})``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multigpu as mg
from multigpu.envs import vector
from multigpu.envs.cartpole import CartPole
from multigpu.envs.pendulum import Pendulum
from multigpu.sim import native


def _trajectory(env_id: str, num_envs: int, mode: str, dtype: torch.dtype, host: bool, monkeypatch) -> list:
    cls = CartPole if env_id == "CartPole-v1" else Pendulum
    monkeypatch.setattr(cls, "host_step_max_envs", num_envs if host else 0)
    envs = mg.envs.make(env_id, num_envs=num_envs, seed=5, autoreset_mode=mode, dtype=dtype, max_episode_steps=40)
    assert envs._host is host and envs.cpu_step.startswith("host step" if host else "torch step")
    if host and env_id == "CartPole-v1" and dtype == torch.float32 and mode == "next_step" and native.available():
        assert envs._native is not None  # CartPole's C step (int and bool actions), held to the torch step's bits here
    rng = np.random.default_rng(num_envs)
    out = list(envs.reset())[:1]
    for step in range(90):
        kind = step % 4
        if env_id == "Pendulum-v1":  # torques beyond [-2, 2] clamp; int and (n,) shapes convert as before
            actions = rng.random((num_envs, 1)) * 5 - 2.5 if kind < 2 else rng.integers(-3, 4, num_envs)
            if kind == 0:
                actions = torch.from_numpy(actions.astype(np.float32))
            if step == 61:  # float64 NumPy actions (kind 1)
                actions[::7] = float("nan")
        elif kind == 0:
            actions = torch.from_numpy(rng.integers(0, 2, num_envs))  # int64 tensor
        elif kind == 1:
            actions = rng.integers(-3, 4, num_envs).astype(np.int32)  # NumPy, out-of-range ints clamp
        elif kind == 2:
            actions = torch.from_numpy(rng.random(num_envs) < 0.5)  # bool
        else:
            actions = torch.from_numpy(rng.random(num_envs).astype(np.float32) * 1.4 - 0.2)  # floats clamp to [0, 1]
            if step == 63:
                actions[::7] = float("nan")  # NaN states terminate (as _dynamics's max(...) > 0 does)
        obs, reward, terminated, truncated, info = envs.step(actions)
        out += [obs, reward, terminated, truncated]
        out += [info[k] for k in sorted(info)]
        if mode == "disabled" and step % 9 == 8:
            out.append(envs.reset(options={"reset_mask": terminated | truncated | (torch.arange(num_envs) % 5 == 0)})[0])
        if step == 70:
            out.append(envs.reset(seed=9)[0])
    out.append(envs.elapsed_steps.clone())
    return out


@pytest.fixture
def one_thread():
    """One intra-op thread: above 2048 elements torch's sin/cos would wake a second one (ms each on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("num_envs", [1, 37, vector._MASKED_RESETS_UP_TO + 61])
@pytest.mark.parametrize("mode", ["next_step", "same_step", "disabled"])
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_host_step_is_the_torch_step_bit_for_bit(env_id, num_envs, mode, monkeypatch):
    for dtype in (torch.float32, torch.float64):
        host = _trajectory(env_id, num_envs, mode, dtype, True, monkeypatch)
        ref = _trajectory(env_id, num_envs, mode, dtype, False, monkeypatch)
        assert len(host) == len(ref)
        for i, (a, b) in enumerate(zip(host, ref, strict=True)):
            strides = [(sa, sb) for sa, sb, size in zip(a.stride(), b.stride(), a.shape, strict=True) if size > 1]
            assert a.dtype == b.dtype and a.shape == b.shape and all(sa == sb for sa, sb in strides), (i, a, b)
            # rtol = atol = 0: equal values, NaN where the reference has NaN
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, i=i, d=dtype: f"entry {i} ({num_envs} envs, {mode}, {d}): {m}")

@pytest.mark.skipif(not native.available(), reason="no C compiler: the NumPy host step runs instead")
def test_cartpoles_c_step_is_made_on_the_first_step_not_when_the_envs_are_built():
    """Building envs loads nothing more (a config check builds them to learn their spaces: the launcher did)."""
    envs = mg.envs.make("CartPole-v1", num_envs=37, seed=0)
    assert envs._native == envs._first_native_step and not hasattr(envs, "_native_call")
    envs.reset()
    envs.step(torch.zeros(37, dtype=torch.int64))
    assert envs._native == envs._step_native


def test_host_step_keeps_gymnasium_vector_api_errors():
    envs = mg.envs.make("CartPole-v1", num_envs=4, seed=0)
    assert envs._host
    envs.reset()
    with pytest.raises(mg.errors.ConfigError, match=r"step\(\) got actions of shape \(3,\); expected \(4, ...\)"):
        envs.step(np.zeros(3, dtype=np.int64))
    obs, reward, terminated, truncated, info = envs.step([0, 1, 0, 1])  # a list works as before
    assert obs.shape == (4, 4) and reward.dtype == torch.float32 and terminated.dtype == torch.bool and info == {}
    # outputs are fresh tensors: the next step does not overwrite what the caller kept
    kept = (obs.clone(), reward.clone(), terminated.clone(), truncated.clone())
    envs.step(torch.ones(4, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(kept, (obs, reward, terminated, truncated), strict=True))


# Digests of trajectories taken with the host step as it was before the reset and Euler rework
# (commit 717697d: masked resets with a stale pass, Euler as one add_ over a copy of the velocities).
# The rework must give the same bits; sin/cos bits are torch's kernels', so the pin holds for the
# torch build and CPU capability it was taken with, and the test says so rather than fail elsewhere.
_PINNED_ON = ("2.13.0+cpu", ("AVX2", "AVX512"))
# AVX512: commit 717697d's code run on an AVX512 host (2026-11-26) gave these same four digests
_PINNED = {
    ("CartPole-v1", 64, "next_step", 600): "2df0d9abf0f19e99",
    ("CartPole-v1", 64, "same_step", 600): "36bb6ffc09d7dbc5",
    ("CartPole-v1", 8192, "next_step", 520): "d73d7ba9266778f8",  # indexed resets, past the 500-step time limit
    ("Pendulum-v1", 64, "next_step", 210): "827b8c3a5ac6cf32",
}


def _trajectory_digest(env_id: str, num_envs: int, mode: str, steps: int) -> str:
    import hashlib

    envs = mg.envs.make(env_id, num_envs=num_envs, seed=3, autoreset_mode=mode)
    rng = np.random.default_rng(num_envs)
    digest = hashlib.sha256(envs.reset()[0].numpy().tobytes())
    for _ in range(steps):
        if env_id == "CartPole-v1":
            actions = torch.from_numpy(rng.integers(0, 2, num_envs))
        else:
            actions = torch.from_numpy((rng.random((num_envs, 1)) * 4 - 2).astype(np.float32))
        obs, reward, terminated, truncated, info = envs.step(actions)
        for value in (obs, reward, terminated, truncated, *(info[k] for k in sorted(info))):
            digest.update(value.numpy().tobytes())
    digest.update(envs.elapsed_steps.numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", sorted(_PINNED))
def test_host_step_gives_the_bits_it_gave_before_the_rework(case):
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    if here[0] != _PINNED_ON[0] or here[1] not in _PINNED_ON[1]:
        pytest.skip(f"digests pinned on torch {_PINNED_ON[0]} with {' or '.join(_PINNED_ON[1])} kernels; this is {here}")
    assert _trajectory_digest(*case) == _PINNED[case]
