"""A Genesis-style batched simulator on every GPU: one process per GPU, n_envs batched on each.

    multigpu launch --gpus all --isolate-devices examples/genesis_style.py --num-envs 8192 --steps 500

This is the pattern of Genesis' multi-GPU guide, run by multigpu's launcher:

* ``--isolate-devices`` gives each worker exactly one GPU *before its first
  import*, through all four variables such simulators read:
  ``CUDA_VISIBLE_DEVICES`` (CUDA/torch), ``QD_VISIBLE_DEVICE`` (Quadrants,
  Genesis' compute backend), ``TI_VISIBLE_DEVICE`` (Taichi) and
  ``EGL_DEVICE_ID`` (headless EGL rendering). Genesis ignores
  ``torch.cuda.set_device`` and binds the first visible GPU when it starts, so
  setting these inside the script would be too late. That each worker sees its
  own index in all four is tested on a CPU machine by
  ``tests/cli/test_launch_e2e.py::test_isolate_devices_sets_all_four_variables_per_worker``.
* ``--num-envs`` is global: each rank builds its share (``mg.envs.env_id_range``)
  as one batched scene (``scene.build(n_envs=...)``), and the step meter
  reduces env-steps/s over all GPUs. A policy trained on top would be wrapped
  in DDP exactly as ``multigpu rl`` does (``src/multigpu/rl/ppo.py``).

It runs only where the Genesis simulator is installed (``pip install
genesis-world``; the PyPI package named ``genesis`` is an unrelated project)
and exits with a message, code 2, elsewhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")


def _genesis():
    """The Genesis simulator module, or None (also when `genesis` is the unrelated PyPI package)."""
    if importlib.util.find_spec("genesis") is None:
        return None
    import genesis as gs

    return gs if hasattr(gs, "Scene") and hasattr(gs, "morphs") else None


def main() -> int:
    parser = argparse.ArgumentParser(description="batched Genesis scene on every GPU")
    parser.add_argument("--num-envs", type=int, default=4096, help="environments in the whole job (split over ranks)")
    parser.add_argument("--steps", type=int, default=200, help="simulation steps")
    args = parser.parse_args()
    seen = {name: os.environ.get(name) for name in DEVICE_VARIABLES}  # as the launcher set them, before any import
    gs = _genesis()
    if gs is None:
        print("examples/genesis_style.py needs the Genesis simulator: pip install genesis-world "
              "(the PyPI package named 'genesis' is a different project). Nothing was run.", file=sys.stderr)
        return 2

    import torch

    import multigpu as mg
    from multigpu.monitor import StepMeter

    mg.init()
    ids = mg.envs.env_id_range(args.num_envs)
    print(f"rank {mg.rank()}/{mg.world_size()}: envs {ids.start}..{ids.stop - 1}, devices {seen}", flush=True)
    gs.init(backend=gs.gpu if torch.cuda.is_available() else gs.cpu, logging_level="warning")
    scene = gs.Scene(show_viewer=False, sim_options=gs.options.SimOptions(dt=0.01))
    scene.add_entity(gs.morphs.Plane())
    robot = scene.add_entity(gs.morphs.MJCF(file="xml/franka_emika_panda/panda.xml"))
    scene.build(n_envs=len(ids))

    gen = torch.Generator(device=gs.device).manual_seed(ids.start)  # a stream per rank's first env id
    meter = StepMeter.from_context("env-steps", total_steps=args.steps, description="genesis franka")
    for _ in range(args.steps):
        with meter.step(items=len(ids)):
            targets = 0.3 * torch.randn(len(ids), robot.n_dofs, device=gs.device, generator=gen)
            robot.control_dofs_position(targets)  # one batched call for this rank's environments
            scene.step()
    summary = meter.close()
    if mg.is_main():
        print(f"{summary['throughput']:,.0f} env-steps/s over {summary['world_size']} rank(s), "
              f"{args.num_envs} envs in all")
    mg.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
