"""Batched environments: gymnasium's vector API as tensor code, split over ranks.

Runs inside each rank. ``make`` builds ``num_envs`` environments stepping as
one batch on a device; ``split=True`` builds only this rank's share of a
global ``num_envs``, with random streams keyed by each environment's global
id so results do not depend on the number of ranks::

    import multigpu as mg

    mg.init()
    envs = mg.envs.make("CartPole-v1", num_envs=4096, seed=0, split=True)
    obs, info = envs.reset()
    obs, reward, terminated, truncated, info = envs.step(actions)

Your own environments: ``make("pkg.module:factory", ...)`` or ``register(id, factory)``; a factory
may return any gymnasium 1.x vector environment, NumPy or torch (``adapter``).

Modules: ``vector`` (the API, autoreset, registry, NumPy adapter), ``adapter`` (calling a
factory, any vector environment as tensors), ``split``
(env ids per rank, counter-based random streams), ``cartpole``, ``pendulum``,
``spaces`` (gymnasium spaces when installed, else stand-ins), ``bench``
(``python -m multigpu.envs.bench``: env-steps/s on every rank, the ``envs``
workload of ``multigpu bench``).
"""

from multigpu.envs.adapter import TorchVectorEnv
from multigpu.envs.cartpole import CartPole
from multigpu.envs.pendulum import Pendulum
from multigpu.envs.registry import make, register, registered_ids
from multigpu.envs.split import env_id_range
from multigpu.envs.vector import AUTORESET_MODES, NumpyVectorEnv, VectorEnv

__all__ = [
    "AUTORESET_MODES",
    "CartPole",
    "NumpyVectorEnv",
    "Pendulum",
    "TorchVectorEnv",
    "VectorEnv",
    "env_id_range",
    "make",
    "register",
    "registered_ids",
]
