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

WORLD = """\
import os
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()  # no rank leaves before the other's gloo mesh is whole (else its connect saw a closed peer)
print("WORLD", dist.get_rank(), dist.get_world_size(), os.uname().nodename, flush=True)
dist.destroy_process_group()
"""

CASES = {"the store's host starts first": (["node1", "node2"], "node1"),
         "the other host starts first": (["node4", "node3"], "node3"),
         "two launchers on one host (loopback)": (["node1", "node1"], "localhost")}
"""Each case: the hosts in the order their launchers start (the second 2 s later), and the endpoint's host."""


def test_torchruns_elastic_flags_form_the_world_torchrun_forms(hosts):
    """Every case at once (each on its own hosts or ports): torchrun's world and ours, for each."""
    (hosts.shared / "world.py").write_text(WORLD)
    env = hosts.env(MULTIGPU_RDZV_SECRET="0123456789abcdef0123")
    procs: dict[tuple[str, str], list[subprocess.Popen]] = {}
    try:
        for step in range(2):  # the first launcher of every case, then the second
            for i, (case, (order, endpoint_host)) in enumerate(CASES.items()):
                for j, (tool, argv) in enumerate((("torchrun", ["torchrun"]), ("multigpu", ["multigpu", "launch"]))):
                    flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             f"{endpoint_host}:{29400 + 2 * i + j}", "--rdzv-id", f"job{i}", "world.py"]
                    procs.setdefault((case, tool), []).append(hosts.on(
                        order[step], [*argv, *flags], cwd=hosts.shared, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, start_new_session=True))
            if step == 0:
                time.sleep(2)  # the second node comes later
        outs = {key: [p.communicate(timeout=180) for p in ps] for key, ps in procs.items()}
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    worlds = {}
    for (case, tool), results in outs.items():
        codes = [p.returncode for p in procs[case, tool]]
        assert codes == [0, 0], (case, tool, codes, [err[-2500:] for _, err in results])
        found = re.findall(r"WORLD (\d+) (\d+) (\S+)", "".join(out for out, _ in results))
        worlds[case, tool] = sorted((int(rank), int(size)) for rank, size, _ in found)
    for case in CASES:
        assert worlds[case, "torchrun"] == [(0, 2), (1, 2)], (case, outs[case, "torchrun"])
        assert worlds[case, "multigpu"] == worlds[case, "torchrun"], (case, [e for _, e in outs[case, "multigpu"]])
