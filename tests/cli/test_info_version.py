"""`multigpu info` and `multigpu --version`, through the command line in-process."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

from multigpu.cli import main


def test_info_says_what_this_machine_offers_as_a_table_and_as_json(capsys, monkeypatch):
    from multigpu.runtime.env import cpu_count

    monkeypatch.setenv("EGL_DEVICE_ID", "3")
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["torch"] == torch.__version__ and facts["cores"] == cpu_count() and facts["memory_gib"] > 0
    assert facts["backends"]["gloo"] is True and len(facts["gpus"]) == torch.cuda.device_count()
    assert facts["variables"]["EGL_DEVICE_ID"] == "3" and set(facts["variables"]) >= {"CUDA_VISIBLE_DEVICES"}
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["info"]) == 0
    table = capsys.readouterr().out
    rows = {cells[0]: cells[1] for line in table.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 2}
    assert "multigpu info" in table and rows["torch"].startswith(f"{torch.__version__} (")
    assert rows["CPU cores"] == str(cpu_count()) and "gloo" in rows["backends"].split(", ")
    assert rows["EGL_DEVICE_ID"] == "'3'" and rows["CUDA_VISIBLE_DEVICES"]
    assert ("none visible: ranks run on the CPU (gloo)" in table) is (not facts["gpus"])


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"multigpu {metadata.version('multigpu')}\n"
