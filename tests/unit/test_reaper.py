"""The reaper that outlives the launcher: it stops the job's processes only when the launcher
died, and only processes carrying the job's token (real processes, no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from multigpu.launch import _reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

_SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _reaper_with_pipe(token: str, folder) -> tuple[subprocess.Popen, int]:
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", _reaper.__file__, token, str(folder)], stdin=read_end,
                            start_new_session=True)
    os.close(read_end)
    return proc, write_end


@pytest.mark.parametrize("launcher_ends", ["normally", "killed"])
def test_the_reaper_stops_the_tokens_carriers_only_when_the_launcher_dies(launcher_ends, tmp_path):
    token = os.urandom(8).hex()
    carrier = subprocess.Popen(_SLEEP, env={**os.environ, _reaper.TOKEN_VAR: token}, start_new_session=True)
    bystander = subprocess.Popen(_SLEEP, env={**os.environ, _reaper.TOKEN_VAR: "another job"})
    try:
        deadline = time.monotonic() + 10
        while carrier.pid not in _reaper.carriers(token):  # its environment is readable once it runs
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _reaper.carriers(token) == [carrier.pid]
        private = tmp_path / "multigpu_store_x"
        (private / "attempt0").mkdir(parents=True)
        reaper, write_end = _reaper_with_pipe(token, private)
        if launcher_ends == "normally":
            os.write(write_end, _reaper.DONE)
        os.close(write_end)  # what the kernel does when the launcher dies
        assert reaper.wait(timeout=15) == 0
        if launcher_ends == "killed":
            assert carrier.wait(timeout=5) == -15  # SIGTERM from the reaper
            assert not private.exists()  # then the launcher's private folder goes
        else:
            assert carrier.poll() is None  # the launcher stopped what it had to; the reaper just exits
            assert private.exists()  # and removes its folder itself
        assert bystander.poll() is None and psutil.pid_exists(bystander.pid)
    finally:
        for proc in (carrier, bystander):
            proc.kill()
            proc.wait()
