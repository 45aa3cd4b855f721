"""``python tests/scripts/fake_gpu_cli.py N multigpu-args...``: the real command line, on a host whose launcher
sees N GPUs (through the injected HostFacts seam; the workers themselves see whatever torch finds)."""

import sys

from multigpu.cli import main
from multigpu.launch.devices import HostFacts

count = int(sys.argv[1])
HostFacts.probe = classmethod(lambda cls: HostFacts(gpu_count=count, visible=None, cores=2))
sys.exit(main(sys.argv[2:]))
