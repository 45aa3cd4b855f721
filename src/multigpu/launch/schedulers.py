"""The node's place in a job, read from the scheduler that started the launcher, and job files for schedulers
(runs in the launcher).

``multigpu launch`` (and every workload command) started once per node by a scheduler takes the node
count, this node's rank, the rendezvous endpoint and the workers per node from the scheduler's
environment: SLURM, Kubeflow's PET_*, LSF and Open MPI, each one class of :mod:`multigpu.runtime.clusters`
(Lightning Fabric's cluster environments), which the ranks read too. Flags given by hand win; a flag that
contradicts the scheduler (``--nnodes 4`` in a 2-node SLURM step) is one line naming both. Pure:
everything is read from the mapping passed in.

``--print-sbatch`` and ``--print-k8s`` write the job file for a command (:func:`sbatch_script`,
:func:`pytorchjob_manifest`) with the resources its flags ask for (:class:`JobResources`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import ConfigError

__all__ = ["SchedulerPlacement", "from_environment"]


@dataclass(frozen=True)
class SchedulerPlacement:
    """What a scheduler says about this node; None where it says nothing."""

    scheduler: str
    nnodes: int
    node_rank: int
    rdzv_endpoint: str | None
    nproc_per_node: int | None = None
    min_nodes: int | None = None
    """An elastic job's MIN (Kubeflow's ``PET_NNODES=MIN:MAX``), else None."""


def from_environment(env: Mapping[str, str], hostname: str | None = None) -> SchedulerPlacement | None:
    """The scheduler's placement of this node, or None when no scheduler started this launcher.

    Each scheduler is one class of :mod:`multigpu.runtime.clusters`, which the ranks read too. SLURM counts only
    inside an ``srun`` step (``SLURM_STEP_ID``): an ``sbatch`` script's own shell also carries ``SLURM_NNODES``,
    but there only one launcher runs; a step of several tasks per node is refused (one launcher per node).
    """
    from multigpu.runtime import clusters

    cluster = clusters.node_environment(env, hostname)
    if cluster is None:
        return None
    if isinstance(cluster, clusters.SLURM) and (tasks := cluster.tasks_per_node()) is not None and tasks[0] != 1:
        raise ConfigError(f"multigpu launch runs once per node, but this srun step starts {env[tasks[1]]} tasks "
                          f"per node ({tasks[1]}); valid: srun --ntasks-per-node=1 multigpu launch ..., or run "
                          "your script under srun directly without the launcher (mg.init reads SLURM)")
    return SchedulerPlacement(cluster.name, cluster.nnodes(), cluster.node_rank(), cluster.rdzv_endpoint(),
                              cluster.nproc_per_node(), cluster.min_nodes())


_NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--print-sbatch", "--print-k8s")
"""Flags a scheduler's job file leaves out of the command: the scheduler says them on every node."""
_NO_VALUE = ("--print-sbatch", "--print-k8s")


def command_for_scheduler(ours: list[str], script_args: list[str] = ()) -> list[str]:
    """The command without the flags each node gets from its scheduler (and without the print flags).

    ``ours``: the command line up to and including the script; ``script_args``: everything after the script,
    which belongs to the script and is kept verbatim (``--nnodes 7`` there is the script's own argument).
    """
    out, skip = [], False
    for arg in ours:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg
        if name in _NODE_FLAGS:
            skip = "=" not in arg and name not in _NO_VALUE
            continue
        out.append(arg)
    return [*out, *script_args]


_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:([0-9]+)")
"""A GPU count in SLURM's GRES text: ``gpu:4``, ``gpu:a100:8``, ``gpu:h100:4(S:0-1)``."""


def slurm_gpus_per_node(env: Mapping[str, str], run=None) -> int | None:
    """GPUs per node of the partition an ``sbatch`` from here would use (``SBATCH_PARTITION``, else the cluster's
    default partition), as SLURM's own ``sinfo`` says; 0 on a partition whose nodes have none; None where SLURM
    cannot be asked (no ``sinfo`` here, or it fails). The most of any node of the partition."""
    import shutil
    import subprocess

    if shutil.which("sinfo", path=env.get("PATH")) is None:
        return None
    run = run or subprocess.run
    try:
        done = run(["sinfo", "--noheader", "--format=%P %G"], capture_output=True, text=True, timeout=15,
                   env=dict(env))
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    wanted = env.get("SBATCH_PARTITION")
    counts: dict[str, int] = {}
    default = None
    for line in done.stdout.splitlines():
        name, _, gres = line.strip().partition(" ")
        if not name:
            continue
        if name.endswith("*"):
            name = name[:-1]
            default = default or name
        found = [int(n) for n in _GRES_GPU.findall(gres)]
        counts[name] = max(counts.get(name, 0), *found, 0)
    partition = wanted or default
    if partition is None or partition not in counts:
        return None
    return counts[partition]


@dataclass(frozen=True)
class JobResources:
    """What one node of the job asks its scheduler for, from the job's own flags (never from this machine)."""

    nnodes: int
    workers: int
    """Workers (ranks) per node."""
    gpus: int
    """GPUs per node (0: a CPU job)."""
    cpus: int | None
    """CPU cores per node (``--threads`` × workers), None: the whole node (``--exclusive``)."""
    said: str
    """Where ``gpus`` came from, for the job file's comment."""
    min_nodes: int | None = None
    """``--nnodes MIN:MAX``'s MIN (an elastic job), else None."""
    asked_slurm: bool = False
    """Whether SLURM's ``sinfo`` said that the nodes have no GPUs (``said`` then tells it, for the job file)."""
    max_restarts: int = 0
    """The restarts each launcher of the job gets (``--max-restarts``, else the launcher's default)."""

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: the job goes on when nodes are lost, and grows when they join."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes


def rfc1123_name(what: str, *, limit: int = 40) -> str:
    """A Kubernetes object name for ``what`` (a script path or a workload): ``multigpu-<stem>``, lower case
    letters, digits and '-', starting with a letter and ending with a letter or digit, at most ``limit``
    characters (the operator names pods and services ``<name>-worker-<i>``, which must stay within 63)."""
    import re

    stem = what.rsplit("/", 1)[-1].removesuffix(".py").lower()
    stem = re.sub(r"[^a-z0-9]+", "-", stem).strip("-")
    name = f"multigpu-{stem}" if stem else "multigpu-job"
    return name[:limit].rstrip("-")


def _job_name(what: str) -> str:
    import re

    stem = what.rsplit("/", 1)[-1].removesuffix(".py")
    return "multigpu-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "job")


_SECRET_LINE = ("export MULTIGPU_RDZV_SECRET=\"$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')\"")
"""Made once per job by the batch script, before ``srun``: srun hands the environment to every node's launcher;
the secret is never written to a file."""


WARNING_S = 120
"""Seconds before the end (time limit, or pre-emption with a grace time) at which SLURM warns the batch script
(``--signal=B:USR1@WARNING_S``): time for the step in progress, a checkpoint, and the launcher's shutdown."""

_JOB_ID = "@@SLURM_JOB_ID@@"
"""Stands for ``${SLURM_JOB_ID}`` in the command until it is quoted (``@`` needs no quoting in a shell)."""


def sbatch_script(ours: list[str], script_args: list[str] = (), *, what: str, resources: JobResources,
                  run_folder: bool | None = None, stop_flag: str | None = None, resume: bool = False) -> str:
    """A ready ``sbatch`` script for ``multigpu OURS SCRIPT_ARGS``: one launcher per node under srun, which reads
    SLURM's variables (:func:`from_environment`); the rendezvous secret is made in the script, once per job.

    Pre-emption and the time limit: the job asks SLURM for a warning (``--signal=B:USR1@WARNING_S``) and may be
    requeued (``--requeue``). The script's trap passes the warning on to every node's launcher through SLURM
    (``scancel --signal=USR1 $SLURM_JOB_ID`` signals the job's steps, not this script; SLURM takes a SIGTERM sent
    that way for a cancel, and a SIGTERM sent to ``srun`` makes it kill its step at once), which stops its ranks
    as at a SIGTERM (:data:`multigpu.launch.processes.WARNING_SIGNAL`); they finish their step, write its
    checkpoint and exit 143; the script then requeues the job (``scontrol requeue $SLURM_JOB_ID``), whose next start continues the
    run. A SIGTERM that comes without the warning is SLURM ending the job (``scancel``, the time limit reached):
    the job is not requeued.

    One launcher per node: ``srun --ntasks-per-node=1`` (in the header, ``--ntasks-per-node`` makes SLURM give a
    ``--nodes=MIN-MAX`` job its MIN nodes however many are free; without it SLURM gives as many as are free).

    ``run_folder``: add ``--run-dir runs/<workload>/<job name>-$SLURM_JOB_ID`` (one folder per job: a requeued job
    keeps its id, a new submission gets a new folder), and ``--resume auto`` when True; None: add nothing (a
    script's own resume is its own). ``stop_flag``: the workload's flag that makes a signal a last checkpoint
    (train's ``--checkpoint-on-interrupt``), added to the command. ``resume``: add ``--resume auto`` alone (the
    user's own ``--run-dir`` of a workload that resumes: a requeued start continues it).
    """
    import shlex

    name = _job_name(what)
    workload = next((a for a in ours if not a.startswith("-")), "job")
    r = resources
    elastic = r.elastic
    extra = [stop_flag] if stop_flag else []
    if run_folder is not None:
        extra += ["--run-dir", f"runs/{workload}/{name}-{_JOB_ID}", *(["--resume", "auto"] if run_folder else [])]
    elif resume:
        extra += ["--resume", "auto"]
    command = command_for_scheduler([*ours, *extra], script_args)
    if elastic:  # after the command's own flags: SLURM says the node count, the launcher needs the range
        command.insert(command.index(workload) + 1 if workload in command else 0, f"--nnodes={r.min_nodes}:{r.nnodes}")
    command = shlex.join(["multigpu", *command]).replace(_JOB_ID, "${SLURM_JOB_ID}")
    gpus = [f"#SBATCH --gpus-per-node={r.gpus}            # {r.said}"] if r.gpus else \
        [f"# no --gpus-per-node: {r.said}"] if r.asked_slurm else []
    cpus = (f"#SBATCH --cpus-per-task={r.cpus}           # --threads × {r.workers} worker(s)" if r.cpus else
            "#SBATCH --exclusive                  # the whole node: each worker gets cores // workers threads "
            "(or pass --threads T for --cpus-per-task)")
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        *([f"#SBATCH --nodes={r.min_nodes}-{r.nnodes}".ljust(37) + f"# elastic (--nnodes {r.min_nodes}:{r.nnodes}): it "
           f"starts on as many of {r.nnodes} node(s) as are free ({r.min_nodes} at least) and goes on down to "
           f"{r.min_nodes}",
           "#SBATCH --no-kill                    # a node that fails does not end the allocation: the job goes on "
           "without it"]
          if elastic else [f"#SBATCH --nodes={r.nnodes}"]),
        *gpus,
        cpus,
        "#SBATCH --time=01:00:00              # edit: the job's time limit",
        f"#SBATCH --signal=B:USR1@{WARNING_S}        # a warning to this script {WARNING_S} s before the time limit "
        "or a pre-emption",
        "#SBATCH --requeue                    # then the job goes back in the queue and continues where it stopped",
        "#SBATCH --open-mode=append           # a requeued start adds to the same output files",
        f"#SBATCH --output={name}-%j.out",
        f"#SBATCH --error={name}-%j.err",
        "set -euo pipefail",
        "",
        "# Every node signs the rendezvous state with one secret, made here once per job; srun passes it to each",
        "# node's launcher in the environment (it is in no file).",
        _SECRET_LINE,
        "",
        "# The warning (USR1) is passed on to every node's launcher through SLURM (scancel signals the job's steps,",
        "# not this script; a SIGTERM sent that way, or to srun, is taken for a cancel and kills the step), which",
        "# stops its ranks as at a SIGTERM: they finish the step they are in, write its checkpoint and exit 143;",
        "# the job is requeued below once srun has ended. A SIGTERM without the warning is SLURM ending the job",
        "# (scancel, the time limit reached): it is not requeued.",
        "stop=\"\" srun_pid=\"\"",
        "trap 'if [ -z \"$stop\" ]; then stop=USR1; scancel --signal=USR1 \"$SLURM_JOB_ID\" || true; fi' USR1",
        "trap 'stop=${stop:-TERM}' TERM",
        f"# One launcher per node (it starts {r.workers} worker(s)); each reads SLURM_NNODES, SLURM_NODEID and",
        "# SLURM_JOB_NODELIST (the first node hosts the rendezvous, on a port derived from the job id unless",
        "# MASTER_PORT is set): no node flags are needed. The nodes agree on one run folder (under this folder,",
        "# which every node must see: a shared file system).",
        *(["# Elastic: a node that is lost (or whose launcher fails) does not end the step (no --kill-on-bad-exit):",
           "# the launchers left name it, re-form the job without it and resume from the newest checkpoint, re-split.",
           "# SLURM never adds a node to a running job, so it does not grow back; losing the first node (the",
           "# rendezvous host) ends the job.",
           f"srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 {command} &"] if elastic else
          ["# --kill-on-bad-exit: a node whose launcher fails ends the whole step.",
           f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {command} &"]),
        "srun_pid=$!",
        "code=0",
        "wait \"$srun_pid\" || code=$?",
        "while kill -0 \"$srun_pid\" 2>/dev/null; do code=0; wait \"$srun_pid\" || code=$?; done  # a trap ended "
        "the wait",
        "if [ \"$stop\" = USR1 ] && [ \"$code\" -ne 0 ]; then",
        "  echo \"multigpu: stopped by $stop before the end (exit $code): requeueing job $SLURM_JOB_ID\" >&2",
        "  scontrol requeue \"$SLURM_JOB_ID\"",
        "fi",
        "exit \"$code\"",
        "",
    ])


GRACE_S = 90
"""A pod's time between Kubernetes' SIGTERM and its SIGKILL: the step in progress, its checkpoint, the launcher's
shutdown (which waits up to 30 s for the ranks)."""

RUNS_MOUNT = "/runs"
"""Where the PyTorchJob mounts its shared volume: every pod's run folders and logs."""
RDZV_PORT = 29400
"""An elastic PyTorchJob's rendezvous port (torchrun's default for c10d), on its worker 0."""
INDEX_LABEL = "training.kubeflow.org/replica-index"
"""The label the training operator puts on each pod: its index among the replicas of its type."""
RUNS_CLAIM = "multigpu-runs"
"""The ReadWriteMany PersistentVolumeClaim of that volume, shared by every job made this way."""


class _Quoted(str):
    """A string YAML must keep a string: ``1e-3``, ``5E-4``, ``0o17``, ``yes`` are numbers or booleans to a YAML 1.2
    (or 1.1) reader when written bare."""


def _yaml_dump(documents: list[dict]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # no &id001 anchors: every value written out where it is used
            return True

    Dumper.add_representer(_Quoted, lambda dumper, data: dumper.represent_scalar(
        "tag:yaml.org,2002:str", str(data), style='"'))
    return "---\n".join(yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=1 << 16) for doc in documents)


def pytorchjob_manifest(ours: list[str], script_args: list[str] = (), *, what: str, resources: JobResources,
                        run_folder: bool | None = None, stop_flag: str | None = None, resume: bool = False,
                        image: str = "<your-image>") -> str:
    """Kubernetes manifests for ``multigpu OURS SCRIPT_ARGS`` as a Kubeflow ``PyTorchJob`` (a Master and
    nnodes - 1 Workers; Kubeflow sets the PET_* variables each node's launcher reads), with:

    * a ``Secret`` holding the rendezvous secret, made here once per job and given to every pod through
      ``secretKeyRef`` (the job's spec holds only its name);
    * a ReadWriteMany ``PersistentVolumeClaim`` mounted at :data:`RUNS_MOUNT` in every pod, where a workload's
      run folder goes (``run_folder``: add ``--run-dir RUNS_MOUNT/<job name>``, and ``--resume auto`` when True,
      so that a pod Kubernetes restarts continues its run instead of refusing the used folder; None: add
      nothing), and ``/dev/shm`` in memory (the container runtime's 64 MB default is too small for data-loader
      workers and NCCL);
    * one name per printed job: ``multigpu-<script or workload>-<6 random hex digits>``, a valid RFC 1123 label
      (applying the same file again is the same job: same folder, same secret).
    * ``restartPolicy: ExitCode``: a pod is restarted when killed (exit code 128 + signal: preemption, OOM), not
      when the job's own input is wrong (exit 2) or a rank failed (exit 1);
    * pre-emption: Kubernetes sends SIGTERM to the launcher (the container's first process), which passes it to
      the ranks; with ``stop_flag`` (train's ``--checkpoint-on-interrupt``) they finish the step, write its
      checkpoint and exit 143, and the restarted pod continues the run. ``terminationGracePeriodSeconds`` gives
      them :data:`GRACE_S` seconds before Kubernetes' SIGKILL (its default, 30 s, is the launcher's own wait).
    """
    import secrets

    name = f"{rfc1123_name(what, limit=33)}-{secrets.token_hex(3)}"
    r = resources
    run_flags = [stop_flag] if stop_flag else []
    if run_folder is not None:
        run_flags += ["--run-dir", f"{RUNS_MOUNT}/{name}", *(["--resume", "auto"] if run_folder else [])]
    elif resume:  # the user's own --run-dir: a restarted pod continues it
        run_flags += ["--resume", "auto"]
    command = command_for_scheduler([*ours, *run_flags], script_args)
    if r.elastic:  # the operator's PET_NNODES says the same; written out, the command says it on its own
        workload = next((a for a in ours if not a.startswith("-")), None)
        command.insert(command.index(workload) + 1 if workload in command else 0, f"--nnodes={r.min_nodes}:{r.nnodes}")
    command = [_Quoted(a) for a in ["multigpu", *command]]
    secret_name = f"{name}-rdzv"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name}, "type": "Opaque",
              "stringData": {"MULTIGPU_RDZV_SECRET": _Quoted(secrets.token_hex(16))}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": RUNS_CLAIM},
             "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}}

    def replica(count: int) -> dict:
        limits: dict = {"nvidia.com/gpu": r.gpus} if r.gpus else {}
        if r.cpus:
            limits["cpu"] = r.cpus
        env = [{"name": "MULTIGPU_RDZV_SECRET",
                "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "MULTIGPU_RDZV_SECRET"}}}]
        if r.elastic:  # the pod's index: the operator sets no node rank on an elastic job's pods
            env.append({"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{INDEX_LABEL}']"}}})
        container = {
            "name": "pytorch", "image": image, "command": command, "env": env,
            "volumeMounts": [{"name": "runs", "mountPath": RUNS_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
        }
        if r.elastic:  # the rendezvous port: the operator makes PET_RDZV_ENDPOINT=<job>-worker-0:<it>
            container["ports"] = [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}]
        if limits:
            container["resources"] = {"limits": limits}
        volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": RUNS_CLAIM}},
                   {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        return {"replicas": count, "restartPolicy": "ExitCode",
                "template": {"spec": {"terminationGracePeriodSeconds": GRACE_S, "containers": [container],
                                      "volumes": volumes}}}

    spec: dict = {"nprocPerNode": _Quoted(str(r.workers))}
    if r.elastic:  # only Workers (the operator's elastic form): c10d's store on worker 0, MIN to MAX of them
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": r.min_nodes, "maxReplicas": r.nnodes,
                                 "maxRestarts": r.max_restarts}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(r.nnodes)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
        if r.nnodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replica(r.nnodes - 1)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": spec}
    size = f"{r.min_nodes} to {r.nnodes} pod(s) (elastic)" if r.elastic else f"{r.nnodes} pod(s)"
    header = "\n".join([
        f"# {name}: a Kubeflow PyTorchJob of {size}, {r.workers} worker(s) each. Apply with kubectl apply -f.",
        "# The Secret below holds this job's rendezvous secret (made when this file was printed): keep the file",
        f"# private, or pipe it straight into kubectl apply -f -. The run folder is on the claim {RUNS_CLAIM}",
        "# (ReadWriteMany: NFS, CephFS, EFS, Filestore...; edit its storageClassName/size, or point claimName at",
        "# yours). Edit the image.",
        "",
    ])
    return header + _yaml_dump([secret, claim, job])
