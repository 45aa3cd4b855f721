"""A real SLURM on virtual hosts, on this one machine (the cluster tier's fixture; runs in the test process).

Each host is a network namespace of its own (its own address on a bridge made here, its own loopback) plus UTS and
mount namespaces held by one small process (its own hostname, an ``/etc/hosts`` that names every host, and a
resolver that answers nothing, as on hosts without reverse DNS). On each host runs Debian's ``slurmd``; beside
them ``slurmctld`` on a controller host of the same kind, and one ``munged`` of this cluster's own (its key and
socket in the cluster's folder). Jobs are submitted from the test process with the real ``sbatch``; they run as
SLURM runs them, in their host's namespaces, and see one shared folder (the cluster's ``shared/``), except where a
test gives a host a private folder (:meth:`SlurmCluster.hide`, a tmpfs in that host's mount namespace).

What a test can do to a host: kill every process on it (:meth:`SlurmCluster.kill_host`, a machine that died),
cut its link (:meth:`SlurmCluster.partition`), slow its link (:meth:`SlurmCluster.slow_link`, ``tc``), and
put it back (:meth:`SlurmCluster.heal`). Every port is inside the namespaces made here; every address is on the
bridge made here; :meth:`SlurmCluster.down` removes all of it (daemons by pid, every process left in a
namespace, the namespaces, the links, the bridge), also after a failed start.

Facts this relies on (checked on Debian 12, SLURM 22.05): several ``slurmd -N NAME`` run side by side; ``slurmd``
under ``ip netns exec`` fails (it remounts /sys without cgroups) while entering the namespace with ``nsenter``
works; ``slurmctld`` starts only where its hostname matches ``SlurmctldHost``; ``proctrack/linuxproc`` and
``task/none`` need no cgroups; a requeued job waits ``cred_expire`` seconds (120 by default) before it may start
again, set to 5 here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "iproute2")
"""Debian's packages the tier needs (``make test`` installs them as root where apt works)."""
_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged", "mungekey", "ip",
             "tc", "nsenter", "unshare")
_PREFIX = "mgc"
"""Names of what a cluster makes here (namespaces, links): ``mgc<pid>x<2 hex digits>...``, so a sweep finds what a
killed test run left behind (its pid no longer runs), and never what another live one made."""
CRED_EXPIRE_S = 5


def missing() -> str | None:
    """Why no cluster can be made here, or None: not root, a command missing, no network namespaces."""
    if os.geteuid() != 0:
        return "the cluster tier needs root (network namespaces, slurmd)"
    absent = [name for name in _BINARIES if shutil.which(name) is None]
    if absent:
        return (f"the cluster tier needs {', '.join(absent)} (Debian: apt-get install {' '.join(PACKAGES)}; "
                "make test installs them as root)")
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove the namespaces and links a killed earlier run of this tier left behind (its pid no longer runs)."""
    listed = _run("ip", "netns", "list", check=False).stdout
    for name in re.findall(rf"^({_PREFIX}(\d+)x\w*-\S+)", listed, flags=re.M):
        netns, pid = name
        if _alive(int(pid)):
            continue
        for proc in _netns_pids(netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc, signal.SIGKILL)
        _run("ip", "netns", "del", netns, check=False)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for name, pid in re.findall(rf"^\d+: ({_PREFIX}(\d+)x[^:@\s]*)", links, flags=re.M):
        if not _alive(int(pid)):
            _run("ip", "link", "del", name, check=False)


def _netns_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.128.0.0/9 that no route of this machine covers."""
    routes = _run("ip", "-o", "-4", "route", "show", "table", "all", check=False).stdout
    taken = []
    for word in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", routes):
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(word, strict=False))
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(128, 255)}.{rng.randrange(0, 255)}.0/24")
        if not any(net.overlaps(other) for other in taken if other.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the cluster's bridge")


@dataclass
class Host:
    """One virtual machine: its name (hostname and SLURM node name), address, network namespace, the link's end
    on the bridge, and the process that holds its UTS and mount namespaces."""

    name: str
    address: str
    netns: str
    link: str
    holder: subprocess.Popen | None = None
    daemon: subprocess.Popen | None = None
    hidden: list[str] = field(default_factory=list)

    def enter(self) -> list[str]:
        """The argv prefix that runs a command on this host (its network, hostname and mounts)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "-t", str(self.holder.pid), "--uts", "--mount"]


class SlurmCluster:
    """``nodes`` hosts running slurmd, a controller host running slurmctld, one munged: see the module's text."""

    def __init__(self, root: Path, nodes: int = 3, *, slurmd_timeout_s: int = 10, kill_wait_s: int = 30):
        self.root = root
        self.id = f"{_PREFIX}{os.getpid()}x{random.randrange(16**2):02x}"  # the pid ends at the x (see sweep)
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.bridge = self.id  # at most 15 characters (Linux interface names)
        self.bridge_address = str(hosts[0])
        self.controller = Host("ctl", str(hosts[1]), f"{self.id}-c", f"{self.id}c")
        self.hosts = [Host(f"node{i}", str(hosts[9 + i]), f"{self.id}-{i}", f"{self.id}h{i}")
                      for i in range(1, nodes + 1)]
        self.shared = root / "shared"
        self.conf = root / "slurm.conf"
        self.slurmd_timeout_s = slurmd_timeout_s
        self.kill_wait_s = kill_wait_s
        self._munged: int | None = None
        self._ctld: subprocess.Popen | None = None

    # ------------------------------------------------------------------ up and down
    def up(self) -> SlurmCluster:
        try:
            for folder in ("munge", "state", "log", "run", "spool", "etc", "shared"):
                (self.root / folder).mkdir(parents=True, exist_ok=True)
            self._network()
            self._munge()
            self._write_files()
            for host in (self.controller, *self.hosts):
                self._hold(host)
            self._ctld = self._daemon(self.controller, ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
            self._wait_controller()
            for host in self.hosts:
                self.start_slurmd(host)
            self.wait_idle([h.name for h in self.hosts])
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop everything this cluster started and remove what it made; never raises."""
        with contextlib.suppress(Exception):
            if self._ctld is not None and self._ctld.poll() is None:
                _run("scancel", "--full", "-u", "root", env=self.env(), check=False, timeout=10)
        for host in self.hosts:
            self._stop_host(host)
        if self._ctld is not None:
            self._kill(self._ctld)
        self._stop_host(self.controller)
        if self._munged is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._munged, signal.SIGKILL)
        for host in (self.controller, *self.hosts):
            _run("ip", "link", "del", host.link, check=False)
            _run("ip", "netns", "del", host.netns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def _stop_host(self, host: Host) -> None:
        for pid in _netns_pids(host.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in (host.daemon, host.holder):
            if proc is not None:
                self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _network(self) -> None:
        prefix = self.net.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in (self.controller, *self.hosts):
            _run("ip", "netns", "add", host.netns)
            _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _run("ip", "link", "set", host.link, "master", self.bridge, "up")
            ns = ["ip", "-n", host.netns]
            _run(*ns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
            _run(*ns, "link", "set", "eth0", "up")
            _run(*ns, "link", "set", "lo", "up")
            _run(*ns, "route", "add", "default", "via", self.bridge_address)

    def _munge(self) -> None:
        folder = self.root / "munge"
        folder.chmod(0o711)
        key = folder / "munge.key"
        _run("mungekey", "--create", f"--keyfile={key}", "--bits=1024")
        key.chmod(0o400)
        _run("munged", "--force", f"--key-file={key}", f"--socket={folder / 'socket'}",
             f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
             f"--seed-file={folder / 'munged.seed'}")
        self._munged = int((folder / "munged.pid").read_text().split()[0])

    def _write_files(self) -> None:
        etc = self.root / "etc"
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in (self.controller, *self.hosts)))
        # a resolver nobody answers at once: names come from /etc/hosts, and an address with no name there fails
        # fast (torch's c10d asks for its peers' names), as on a cluster without reverse DNS
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        r = self.root
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={os.cpu_count() or 2} "
                        "RealMemory=2000 State=UNKNOWN\n" for h in self.hosts)
        self.conf.write_text(f"""\
ClusterName={self.id}
SlurmctldHost=ctl({self.controller.address})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r / 'munge' / 'socket'},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'run'}/slurmctld.pid
SlurmdPidFile={r / 'run'}/slurmd-%n.pid
SlurmctldLogFile={r / 'log'}/slurmctld.log
SlurmdLogFile={r / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SlurmdTimeout={self.slurmd_timeout_s}
KillWait={self.kill_wait_s}
InactiveLimit=0
MinJobAge=600
JobRequeue=1
{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _hold(self, host: Host) -> None:
        """The process that keeps the host's UTS and mount namespaces (its hostname, /etc/hosts, resolver)."""
        etc = self.root / "etc"
        script = (f"hostname {host.name} && mount --bind {etc / 'hosts'} /etc/hosts && "
                  f"mount --bind {etc / 'resolv.conf'} /etc/resolv.conf && echo ready && exec sleep infinity")
        host.holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = host.holder.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"host {host.name} could not be made: {host.holder.stderr.read().strip()}")

    def _daemon(self, host: Host, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon's own file, kept open by it
        try:
            return subprocess.Popen([*host.enter(), *argv], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env())
        finally:
            log.close()

    def start_slurmd(self, host: Host) -> None:
        (self.root / "spool" / host.name).mkdir(parents=True, exist_ok=True)
        host.daemon = self._daemon(host, ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)],
                                   f"slurmd-{host.name}")

    def _wait_controller(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ctld.poll() is not None:
                raise RuntimeError(f"slurmctld exited: {self.log('slurmctld')[-2000:]}")
            if _run("scontrol", "ping", env=self.env(), check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurmctld did not answer within {timeout}s: {self.log('slurmctld')[-2000:]}")

    # ------------------------------------------------------------------ using it
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a SLURM command and of what it submits: this cluster's config, the test's Python
        first on PATH (the job's ``multigpu`` is this checkout's), one thread per rank unless said. Python's output
        buffered as a user's is (``PYTHONUNBUFFERED`` set here hid that the launcher held the ranks' lines back)."""
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
               "OMP_NUM_THREADS": "1"}
        for name in ("SLURM_JOB_ID", "PYTHONUNBUFFERED"):
            env.pop(name, None)
        return {**env, **extra}

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def slurm(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        return _run(*argv, env=self.env(), check=check, timeout=timeout).stdout

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` as written from its folder (options on the command line, as a user adds them; ``env``
        added to the environment the job inherits); the job's id."""
        out = _run("sbatch", "--parsable", *options, str(script), env=self.env(**(env or {})),
                   cwd=script.parent).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict ({} when SLURM no longer knows it)."""
        out = _run("scontrol", "-o", "show", "job", str(job_id), env=self.env(), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float, *, restarts: int | None = None) -> dict:
        """Wait until the job is in one of ``states`` (and, if given, has been restarted ``restarts`` times)."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            count = int(info.get("Restarts", "0") or 0)
            if info.get("JobState") in states and (restarts is None or count >= restarts):
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} within {timeout}s (restarts {restarts}): {info}\n"
                           f"{self.log('slurmctld')[-3000:]}")

    def wait_idle(self, names: list[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in names):
                return
            time.sleep(0.3)
        raise RuntimeError(f"nodes {names} not idle within {timeout}s: {states}\n{self.log('slurmctld')[-2000:]}")

    def on(self, host: Host | str, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on a host (outside SLURM: the same machine as a user's ssh session would be)."""
        host = self.host(host) if isinstance(host, str) else host
        cwd = popen.pop("cwd", None)  # entering the host's mounts starts at its root: nsenter changes folder after
        where = [f"--wd={cwd}"] if cwd is not None else []
        return subprocess.Popen([*host.enter(), *where, *argv], env=popen.pop("env", self.env()), **popen)

    # ------------------------------------------------------------------ faults
    def kill_host(self, host: Host | str) -> None:
        """Every process of the host dies at once (its launcher, ranks, slurmd, slurmstepd): a machine that
        died. The host's namespaces stay (its holder), so :meth:`heal` starts it again."""
        host = self.host(host) if isinstance(host, str) else host
        for pid in _netns_pids(host.netns):
            if pid != host.holder.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def partition(self, host: Host | str) -> None:
        """The host's link goes down: its processes run on, unreachable (a network partition)."""
        host = self.host(host) if isinstance(host, str) else host
        _run("ip", "link", "set", host.link, "down")

    def slow_link(self, host: Host | str, mbit_s: float) -> None:
        """The host's link carries at most ``mbit_s`` megabits a second each way (``tc``'s token bucket on both
        ends). A rate, not a delay: this machine's kernel has no ``netem`` (CONFIG_NET_SCH_NETEM is not set)."""
        host = self.host(host) if isinstance(host, str) else host
        shape = ["root", "tbf", "rate", f"{mbit_s:g}mbit", "burst", "16kb", "latency", "2s"]
        _run("tc", "qdisc", "replace", "dev", host.link, *shape)
        _run("nsenter", f"--net=/run/netns/{host.netns}", "tc", "qdisc", "replace", "dev", "eth0", *shape)

    def hide(self, host: Host | str, folder: Path) -> None:
        """``folder`` on this host is a private, empty one (a tmpfs in its mount namespace): not shared."""
        host = self.host(host) if isinstance(host, str) else host
        folder.mkdir(parents=True, exist_ok=True)
        _run("nsenter", "-t", str(host.holder.pid), "--mount", "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs",
             str(folder))
        host.hidden.append(str(folder))

    def heal(self, host: Host | str) -> None:
        """The host as it was made: link up, no delay, nothing hidden, slurmd running and the node idle."""
        host = self.host(host) if isinstance(host, str) else host
        _run("ip", "link", "set", host.link, "up")
        _run("tc", "qdisc", "del", "dev", host.link, "root", check=False)
        _run("nsenter", f"--net=/run/netns/{host.netns}", "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        for folder in reversed(host.hidden):
            _run("nsenter", "-t", str(host.holder.pid), "--mount", "umount", "-l", folder, check=False)
        host.hidden.clear()
        if host.daemon is None or host.daemon.poll() is not None:
            self.start_slurmd(host)
        self.slurm("scontrol", "update", f"nodename={host.name}", "state=resume", check=False)
        self.wait_idle([host.name], timeout=60)
