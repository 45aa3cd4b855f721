"""torchrun's own multi-node flags, as torchrun's docs give them, on the cluster's hosts without the scheduler.

torchrun's elastic form needs no ``--node-rank``: every node runs the same command, the node whose name or
address is the endpoint's hosts the c10d store (another launcher on that machine that finds the port taken
becomes a client), and the rendezvous numbers the nodes. Before: ``multigpu launch`` with the same flags took
every node for node 0, so the second host stopped with "cannot listen on <its peer's address> ... node 0 hosts
the rendezvous store" and the first ran alone at world size 1; on loopback the second launcher said "port ... is
already in use". Here torchrun and ``multigpu launch`` run side by side on the same hosts, each with its own
port, and must form the same world. (``MULTIGPU_RDZV_SECRET`` is the one thing multigpu adds: every node signs the
rendezvous state with it.)
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.cluster.conftest import job_folder

WORLD = """\
import os
import torch.distributed as dist

dist.init_process_group("gloo")
print("WORLD", dist.get_rank(), dist.get_world_size(), os.uname().nodename, flush=True)
dist.destroy_process_group()
"""

CASES = {"the store's host starts first": (["node1", "node2"], "node1"),
         "the other host starts first": (["node2", "node1"], "node1"),
         "two launchers on one host (loopback)": (["node1", "node1"], "localhost")}


@pytest.mark.parametrize("case", CASES)
def test_torchruns_elastic_flags_form_the_world_torchrun_forms(hosts, case):
    order, endpoint_host = CASES[case]
    folder = job_folder(hosts, "torchrun-" + re.sub(r"\W+", "-", case))
    (folder / "world.py").write_text(WORLD)
    commands = {"torchrun": (["torchrun"], 29400), "multigpu": (["multigpu", "launch"], 29401)}
    env = hosts.env(MULTIGPU_RDZV_SECRET="0123456789abcdef0123")
    procs: dict[str, list[subprocess.Popen]] = {tool: [] for tool in commands}
    try:
        for i, host in enumerate(order):
            for tool, (argv, port) in commands.items():
                flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"{endpoint_host}:{port}", "--rdzv-id", "job1", "world.py"]
                procs[tool].append(hosts.on(host, [*argv, *flags], cwd=folder, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, start_new_session=True))
            if i == 0:
                time.sleep(2)  # the second node comes later
        outs = {tool: [p.communicate(timeout=180) for p in ps] for tool, ps in procs.items()}
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    worlds = {}
    for tool, results in outs.items():
        codes = [p.returncode for p in procs[tool]]
        assert codes == [0, 0], (tool, codes, [err[-2500:] for _, err in results])
        found = re.findall(r"WORLD (\d+) (\d+) (\S+)", "".join(out for out, _ in results))
        worlds[tool] = sorted((int(rank), int(size)) for rank, size, _ in found)
    assert worlds["torchrun"] == [(0, 2), (1, 2)], outs["torchrun"]
    assert worlds["multigpu"] == worlds["torchrun"], outs["multigpu"]
