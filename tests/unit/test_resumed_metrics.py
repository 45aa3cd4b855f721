"""A resumed run has every step once in ``metrics.jsonl``, in every workload that resumes (issue 47, item 1).

A run resumed from a checkpoint repeats the steps after it; the attempt it continues may have logged those steps
already (killed after its log point, or resumed from an earlier checkpoint by ``--resume PATH``). The records of
the repeated steps are the resumed run's, and each step is in the file once, with the figures an uninterrupted
run's record of that step has. Train's is pinned in ``tests/dist/test_train.py::test_stop_and_resume_is_bit_identical``
(2 ranks); sim's and rl's here, in one process (their Python entry points, as a plain script calls them). envs
and infer do not checkpoint (``Workload.resumable`` is False): there is no resumed run of theirs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from multigpu.run import script_context
from tests.conftest import logged_steps


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _figures(records: list[dict], names: tuple[str, ...]) -> list[dict]:
    return [{k: r.get(k) for k in ("step", *names)} for r in records]


def test_a_resumed_simulation_logs_each_step_once(single_rank_group, tmp_path):
    """sim: the first attempt checkpoints at step 2 and logs steps 1-3 (``checkpoint_last`` is off: its step 3
    is logged, not saved); resumed with ``auto`` it continues from 2 and logs 3-6. Before, metrics.jsonl held step 3
    twice (1, 2, 3, 3, 4, 5, 6)."""
    import multigpu as mg
    from multigpu.sim import SimConfig

    cfg = SimConfig(model="sir", agents=2000, grid=(16, 16), steps=6, checkpoint_every=2, checkpoint_mode="sync",
                    log_every=1, plot=False, params={"beta": 0.3})
    mg.sim.run(cfg, script_context(tmp_path / "whole"))
    mg.sim.run(dataclasses.replace(cfg, steps=3), script_context(tmp_path / "parts"))
    assert logged_steps(tmp_path / "parts") == [1, 2, 3]
    mg.sim.run(cfg, script_context(tmp_path / "parts", "auto"))  # from step 2's checkpoint
    assert logged_steps(tmp_path / "parts") == logged_steps(tmp_path / "whole") == [1, 2, 3, 4, 5, 6]
    series = ("S", "I", "R")
    assert _figures(_records(tmp_path / "parts"), series) == _figures(_records(tmp_path / "whole"), series)


def test_a_resumed_ppo_run_logs_each_update_once(single_rank_group, tmp_path):
    """rl: a run of 6 updates, checkpoints at 2, 4 and 6, rewound to update 2 (``--resume PATH``: the later
    checkpoints set aside) and resumed there: updates 3-6 are logged again. Before, metrics.jsonl held them twice
    (1, ..., 6, 3, 4, 5, 6)."""
    from multigpu.rl import RLConfig
    from multigpu.rl import train as ppo_train

    cfg = RLConfig(num_envs=4, num_steps=8, total_env_steps=4 * 8 * 6, target_return=None, log_every=1,
                   checkpoint_every=2, checkpoint_mode="sync", num_minibatches=2, update_epochs=1, hidden_size=8)
    quiet = lambda *_: None  # noqa: E731
    ppo_train(cfg, script_context(tmp_path / "whole"), log=quiet)
    assert logged_steps(tmp_path / "whole") == [1, 2, 3, 4, 5, 6]
    shutil.copytree(tmp_path / "whole", tmp_path / "rewound")
    for later in ("step_00000004", "step_00000006"):
        shutil.rmtree(tmp_path / "rewound" / "checkpoints" / later)
    resume = str(tmp_path / "rewound" / "checkpoints" / "step_00000002")
    ppo_train(cfg, script_context(tmp_path / "rewound", resume), log=quiet)
    assert logged_steps(tmp_path / "rewound") == [1, 2, 3, 4, 5, 6]
    assert _figures(_records(tmp_path / "rewound"), ("return",)) == _figures(_records(tmp_path / "whole"), ("return",))
