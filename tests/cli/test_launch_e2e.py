"""The launcher end to end: real `multigpu launch` subprocesses, real ranks (tier 3)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, SCRIPTS, run_cli

pytestmark = pytest.mark.e2e


# two ranks of examples/hello.py printing their shares and the gathered result: tests/cli/test_demo.py (the demo's
# hello part is that launch)


def _open_to_others(folder) -> dict[str, str]:
    """Entries under ``folder`` that a user other than the owner could read or enter: {relative path: mode}."""
    return {str(p.relative_to(folder)): oct(p.lstat().st_mode & 0o777) for p in folder.rglob("*")
            if p.lstat().st_mode & 0o077}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")
def test_the_console_scripts_workers_are_forked_with_torch_loaded_and_see_what_a_fresh_one_would(tmp_path):
    """The command line forks its workers from a copy of itself taken after its imports (torch's, 1-2 s of CPU
    per rank otherwise): each is its launcher's child with the launcher's command line, in a session of its own,
    and sees its arguments, script folder, working folder, thread budget, heap policy and output as a
    `python script.py` would; NumPy's global generator differs between ranks; atexit handlers run, and a file that a module of the
    script's left open is flushed when the worker leaves."""
    # the launcher loads torch with 2 OpenMP threads; the workers' budget is 1 (--threads). Its parent (a CI runner,
    # a shell) passes it a pipe: a new interpreter's worker never holds it (Popen closes it), nor may a forked one
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-m", "multigpu", "launch", "--nproc-per-node", "2", "--threads", "1",
                               str(SCRIPTS / "forked_worker.py"), str(tmp_path), "x"], capture_output=True, text=True,
                              timeout=180, cwd=ROOT, pass_fds=(write_end,),
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"})
        passed = os.readlink(f"/proc/self/fd/{write_end}")
    finally:
        os.close(read_end)
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, seen in enumerate(facts):
        assert passed not in seen["inheritable_fds"], seen
        assert seen["cmdline"] == seen["parent_cmdline"] and seen["cmdline"][1:3] == ["-m", "multigpu"], seen
        assert seen["own_session"] and seen["threads"] == int(seen["omp"]) == 1
        assert seen["refaults"] < 1000, seen  # glibc's heap thresholds applied (launch/heap.py): 12k without
        assert seen["argv"] == [str(SCRIPTS / "forked_worker.py"), str(tmp_path), "x"]
        assert seen["path0"] == str(SCRIPTS) and seen["cwd"] == str(ROOT) and seen["stdin_fd_open"]
        assert f"hello from rank {rank}" in proc.stdout and (tmp_path / f"atexit{rank}").is_file()
        assert (tmp_path / f"open{rank}").read_text() == "flushed at exit"  # its modules are torn down at exit
    assert facts[0]["draw"] != facts[1]["draw"] and facts[0]["pid"] != facts[1]["pid"]


@pytest.mark.fault
def test_a_failing_rank_is_summarised(tmp_path):
    """The failing rank still has an all-reduce in flight whose future calls back into Python. It left through the
    interpreter's teardown: it waited there for the collective timeout, then gloo's thread aborted it (exit code
    -6 after 30 s, "terminate called after throwing an instance of 'gloo::IoException'"). It leaves at once now.

    Also: a --log-dir that exists with 0755 keeps its mode, but everything the job writes there (run.json,
    stack dumps, torch's logs and error files) is 0700 / 0600, as in a folder multigpu makes; the script's own
    files keep the user's umask."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    logs.chmod(0o755)
    out.mkdir()
    proc = run_cli("launch", "--nproc-per-node", "2", "--timeout-s", "30", "--log-dir", str(logs),
                   str(SCRIPTS / "fail_rank1.py"), str(out))
    assert proc.returncode == 1
    err = proc.stderr
    assert "error: rank 1 of 2 failed first (exit code 1): ValueError: simulated failure on rank 1" in err
    assert 'raise ValueError("simulated failure on rank 1")' in err  # its own traceback's tail
    assert f"full logs: {logs}" in err
    assert "_worker.py" not in err.split("error: rank 1")[1]  # our wrapper's frames are hidden
    # the failing rank's whole traceback stays in its error file; only the summary's tail reaches the console
    assert "Traceback (most recent call last)" not in err, err
    assert "Traceback (most recent call last)" in (next(logs.rglob("error.json"))).read_text()
    assert logs.stat().st_mode & 0o777 == 0o755 and (logs / "run.json").exists() and (logs / "stacks").is_dir()
    assert _open_to_others(logs) == {}
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"rank0.txt": 0o666 & ~umask,
                                                                        "rank1.txt": 0o666 & ~umask}


@pytest.mark.fault
def test_a_rank_stuck_before_a_barrier_ends_the_job_naming_it():
    start = time.monotonic()
    proc = run_cli("launch", "--nproc-per-node", "2", "--timeout-s", "4", str(SCRIPTS / "stuck_rank1.py"))
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "rank 0 of 2 failed first" in proc.stderr
    assert "barrier() on rank 0 of 2 timed out after 4s" in proc.stderr
    assert "Ranks 1 failed to pass monitoredBarrier" in proc.stderr
    assert 'File "' in proc.stderr and "stuck_rank1.py\", line 9" in proc.stderr  # rank 0's own call site
    # the stuck rank's own stack, dumped when the agent stopped it: file and line
    assert "rank 1: in <module> (tests/scripts/stuck_rank1.py:8)" in proc.stderr
    assert elapsed < 60  # the sleeping rank (120 s) was stopped, not waited for


@pytest.mark.fault
def test_every_rank_stalled_ends_the_job_with_where_each_stood():
    """No collective ever times out when every rank is stuck at once: the stall watchdog ends the job."""
    start = time.monotonic()
    proc = run_cli("launch", "--nproc-per-node", "2", "--stall-timeout-s", "4", str(SCRIPTS / "stall_all.py"))
    assert proc.returncode == 1
    assert "(exit code 3): StallError: rank" in proc.stderr
    assert "made no progress for" in proc.stderr and "stall_all.py:12 in <module>" in proc.stderr
    assert "its last progress was step 1 of items" in proc.stderr
    assert time.monotonic() - start < 60


@pytest.mark.fault
@pytest.mark.parametrize("script,needle", [
    # gloo says "closed" or "reset" as the peer closed its sockets: exited with the group, or destroyed it first (the
    # worker wrapper destroys what a finished script left)
    ("exit_early.py", r"all_reduce\(\) on rank 0 of 2 lost a peer: (Read error \S+ )?Connection (closed|reset) by peer"),
    # both ranks wait (rank 0 in all_reduce, rank 1 in the barrier); whichever times out first is reported
    ("skip_collective.py", "of 2 timed out after 5s"),
])
def test_mismatched_ranks_end_in_bounded_time(script, needle):
    """A rank that exits early, or skips a collective, while another waits: an error, not a hang."""
    start = time.monotonic()
    proc = run_cli("launch", "--nproc-per-node", "2", "--timeout-s", "5", str(SCRIPTS / script))
    assert proc.returncode == 1
    assert "of 2 failed first" in proc.stderr and re.search(needle, proc.stderr), proc.stderr
    assert "pair.cc" not in proc.stderr.split("error:")[-1]  # gloo's internals are trimmed
    assert time.monotonic() - start < 60


_NODES_ENV = {**os.environ, "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}
"""Several nodes sign the rendezvous state with a secret they share."""


def test_two_nodes_on_loopback(tmp_path):
    """Two launchers, one per node_rank, meet at one endpoint; the store's port is bound by its owner."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # we keep the socket
    base = [sys.executable, "-m", "multigpu", "launch", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false"]
    procs = [
        subprocess.Popen([*base, "--node-rank", str(r), "examples/hello.py"], cwd=ROOT, env=_NODES_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    joined = "".join(o for o, _ in outs)
    assert "rank 0/2 on cpu" in joined and "rank 1/2 on cpu" in joined
    assert "gathered on rank 0: [1, 4, 9, 16, 25, 36, 49, 64, 81, 100]" in joined


def test_a_node_whose_ranks_finished_first_is_not_taken_for_lost_while_the_others_work_on():
    """Node 1's rank ends while rank 0 works on alone for 3 heartbeat deadlines (a final save): node 1's launcher
    waits in torch's exit barrier, whose blocking store wait held the heartbeat's writes on the same connection,
    so node 0 took node 1 for lost ("no heartbeat for 3s") and ended the job that was about to succeed."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = [sys.executable, "-m", "multigpu", "launch", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3"]
    procs = [subprocess.Popen([*base, "--node-rank", str(r), str(SCRIPTS / "rank0_lingers.py"), "9"], cwd=ROOT,
                              env={**_NODES_ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]  # before: node 1 waited in the exit barrier for 300 s
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    said = "".join(out for out, _ in outs)
    assert "rank 0 done (2 ranks summed)" in said and "rank 1 done (2 ranks summed)" in said
    assert not [err for _, err in outs if "was lost" in err or "restarting" in err], outs


def _launcher_of_rank(procs: list, folder, rank: int, ranks: int = 2, timeout: float = 90):
    """Of two nodes' launchers, the one whose worker is ``rank``, once every rank wrote its pid into ``folder``
    (``pid<R>``): which node's launcher runs which rank is the rendezvous's choice."""
    import psutil

    deadline = time.monotonic() + timeout
    while len(list(folder.glob("pid*"))) < ranks:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    pid = int((folder / f"pid{rank}").read_text())
    return next(p for p in procs if pid in [c.pid for c in psutil.Process(p.pid).children(recursive=True)])


@pytest.mark.fault
def test_a_node_whose_launcher_is_killed_is_named_with_the_last_step_of_each_rank(tmp_path):
    """Two nodes on loopback; node 1's launcher alone is SIGKILLed mid-run (its worker dies with it): node 0 ends
    within the heartbeat deadline with one line naming the lost node and the last step each rank finished."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = [sys.executable, "-m", "multigpu", "launch", "--nnodes", "2", "--nproc-per-node", "1", "--timeout-s", "20",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3"]
    procs = [
        subprocess.Popen([*base, "--node-rank", str(r), str(SCRIPTS / "steps_forever.py"), str(tmp_path)], cwd=ROOT,
                         env={**_NODES_ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for r in range(2)
    ]
    # whichever launcher runs rank 1 is "node 1": a lost machine is its launcher gone without a word
    victim = _launcher_of_rank(procs, tmp_path, 1)
    time.sleep(2)  # some steps done, and heard of by the other node
    start = time.monotonic()
    victim.kill()
    survivor = procs[1 - procs.index(victim)]
    _, err = survivor.communicate(timeout=120)
    took = time.monotonic() - start
    victim.communicate()
    assert survivor.returncode == 1, err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(r"error: node (\d) \(.+\) \(rank 1\) was lost: its launcher sent no heartbeat for 3s "
                         r"\(--rdzv-conf keep_alive_interval x keep_alive_max_attempt\); last step finished: "
                         r"rank 0: (\d+), rank 1: (\d+)", last)
    assert found, err
    assert int(found[2]) >= 1 and int(found[3]) >= 1
    assert took < 15  # the heartbeat's deadline (3s) and the ranks' stop, not the collective timeout (20s)
    assert err.count("was lost") == 1  # one line


@pytest.mark.fault
def test_at_the_warning_no_node_ends_before_the_others_ranks_have_stopped(tmp_path):
    """Seen on the real SLURM (two jobs side by side): at the scheduler's warning, node 1's rank stopped at once and
    its launcher exited 143 while rank 0 (node 0) still wrote the step's checkpoint; srun --kill-on-bad-exit took that
    exit for a failure and killed node 0's launcher, and with it the checkpoint and its "interrupted after" line.
    Now each launcher, stopped by the warning, waits (bounded) until every node's ranks have stopped."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = [sys.executable, "-m", "multigpu", "launch", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false"]
    procs = [subprocess.Popen([*base, "--node-rank", str(r), str(SCRIPTS / "rank0_stops_slowly.py"), str(tmp_path)],
                              cwd=ROOT, env={**_NODES_ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        other = procs[1 - procs.index(_launcher_of_rank(procs, tmp_path, 0))]
        deadline = time.monotonic() + 90
        for p in procs:  # the warning reaches every node's launcher (scancel --signal=USR1 JOBID)
            p.send_signal(signal.SIGUSR1)
        while other.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        other_ended = time.time()
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [143, 143], outs
    assert (tmp_path / "rank0_done").exists(), outs
    assert other_ended >= float((tmp_path / "rank0_done").read_text()), "node 1's launcher ended first"
    for _, err in outs:
        assert "error: stopped by the scheduler's warning" in err, err


def test_the_ranks_lines_reach_a_piped_console_while_the_job_runs(tmp_path):
    """Under SLURM the launcher's stdout is a pipe (to slurmstepd, then the job's .out file): the ranks' lines,
    which the launcher copies there (teed: --rank-prefix, --log-dir, several nodes), sat in its 8 KiB buffer until
    it exited, so a batch job's .out showed them late, and lost them where the launcher's exit was cut short (a
    warned job's "interrupted after step N" line, seen on a real SLURM with the checkpoint on disk)."""
    import select

    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "launch", "--nproc-per-node", "2", "--rank-prefix",
                             str(SCRIPTS / "print_then_wait.py"), str(stop)], cwd=ROOT,
                            env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                                 "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while seen.count(b"hello from rank") < 2 and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                seen += os.read(proc.stdout.fileno(), 65536)
        running = proc.poll() is None
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=60)
    assert running and b"[rank0]: hello from rank 0" in seen and b"[rank1]: hello from rank 1" in seen, (
        seen, out, err)
    assert proc.returncode == 0, err


def test_isolate_devices_sets_all_four_variables_per_worker(tmp_path):
    """On a CPU box with a faked list of 4 GPUs, --gpus 1,3 pins rank 0 to GPU 1 and rank 1 to GPU 3."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fake_gpu_cli.py"), "4", "launch", "--gpus", "1,3",
                           "--isolate-devices", str(SCRIPTS / "report_devices.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr
    for rank, gpu in [(0, "1"), (1, "3")]:
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["CUDA_VISIBLE_DEVICES"] == seen["QD_VISIBLE_DEVICE"] == gpu
        assert seen["TI_VISIBLE_DEVICE"] == seen["EGL_DEVICE_ID"] == gpu
        assert seen["omp"] is not None  # the thread budget reached the worker


def test_a_hybrid_jobs_cpu_rank_sees_no_gpu(tmp_path):
    """--allow-cpu-ranks with one (faked) GPU and 2 ranks: rank 0 sees GPU 0, rank 1 (the CPU rank) sees none, so
    nothing in it (FSDP's default mesh, a library's torch.cuda call) can land on the GPU."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fake_gpu_cli.py"), "1", "launch", "--nproc-per-node", "2",
                           "--allow-cpu-ranks", str(SCRIPTS / "report_devices.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "0" and seen[1]["CUDA_VISIBLE_DEVICES"] == ""
    assert seen[1]["EGL_DEVICE_ID"] == seen[1]["QD_VISIBLE_DEVICE"] == ""


def test_a_module_worker_does_not_import_look_alike_modules_from_the_working_directory(tmp_path):
    """A psutil.py in the working directory used to run inside every rank of `multigpu sim`: a `-m`
    worker searches the working directory last, not first as `python -m` does, so installed modules win
    (also while torch is imported), and a module that exists only there is still found."""
    for name in ("psutil", "json"):  # each would leave a marker if imported
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / (name + '.imported'))!r}, 'w').close()\n")
    (tmp_path / "mymod.py").write_text("import json, psutil\nprint('mymod ran', json.dumps([1]), psutil.cpu_count() > 0)\n")
    # the launcher started as the `multigpu` console script starts it: without the working directory on sys.path
    entry = "import sys; sys.path.pop(0); from multigpu.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", entry, "launch", "--nproc-per-node", "1", "-m", "mymod"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "mymod ran [1] True" in proc.stdout
    assert sorted(p.name for p in tmp_path.glob("*.imported")) == []


@pytest.mark.fault
@pytest.mark.parametrize("script, words", [
    ("cuda_tutorial.py", "hint: the script calls CUDA, and this rank has none (a CPU rank): use mg.device()"),
    ("fixed_world.py", "hint: the script fixes devices=2, but this job has 1 rank(s): let the launcher decide"),
])
def test_a_script_that_assumes_cuda_or_its_world_size_gets_a_hint_saying_what_to_change(script, words):
    proc = run_cli("launch", "--nproc-per-node", "1", "--cpu", str(SCRIPTS / script), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert words in proc.stderr, proc.stderr
    assert proc.stderr.count("hint:") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", [
    # the script destroys its group and lists the gloo threads at once
    (),
    # the collector off in the script: the DDP model's cycle still holds the group when the script ends; the
    # wrapper collects it then, so at the interpreter's exit no gloo thread runs
    ("atexit",),
    # a script that never destroys its group (an accelerate script once aborted at exit, -6): the wrapper destroys
    # it once the script has ended well
    ("never",),
], ids=["destroys", "atexit", "never"])  # one launch each: pytest-xdist spreads them over its workers
def test_a_plain_script_that_destroys_its_group_after_ddp_or_not_leaves_no_gloo_thread_running(tmp_path, mode):
    """torch.distributed.nn binds the live default group as default arguments when DDP imports it after
    init_process_group; destroy_process_group() then freed nothing and gloo's threads ran on into the
    interpreter's exit (see tests/dist/test_shutdown.py). The worker wrapper imports it before the script joins."""
    proc = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "ddp_then_destroy.py"), str(tmp_path), *mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.glob("threads*")} == {"threads0": "", "threads1": ""}


def test_a_timeout_too_long_for_the_clocks_is_clamped_with_one_line(tmp_path):
    """Issue 48: any --timeout-s of 1e10 or more killed every job at once (gloo "Timed out waiting 10000000000000ms",
    the launcher "did not exit within 1e+10 s"): torch's and gloo's deadlines overflow past about 9.2e9 s. Past
    1e9 s (31 years: no timeout, in effect) both timeouts are clamped to it, one line says so, and the job runs."""
    proc = run_cli("launch", "--nproc-per-node", "2", "--timeout-s", "1e10", "--stall-timeout-s", "1e12",
                   str(SCRIPTS / "allreduce_once.py"), env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0: sum 2, timeout 1e+09 s", "rank 1: sum 2, timeout 1e+09 s"]
    notes = [line for line in proc.stderr.splitlines() if "clamped" in line]
    assert notes == ["multigpu: note: --timeout-s 1e+10 and --stall-timeout-s 1e+12 are clamped to 1e+09 s (31 "
                     "years, no timeout in effect): torch's and gloo's clocks overflow past about 9.2e+09 s"], \
        proc.stderr
