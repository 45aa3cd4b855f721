"""`--print-sbatch` and `--print-k8s` write jobs that run as written (in-process: cli.main, nothing launched).

Pins what the generated files got wrong: no rendezvous secret (every node exits 2), `--cpus-per-task=16` and GPUs
per node taken from this machine, a YAML anchor (`&id001`), no shared volume, no `/dev/shm`, bare `1e-3`/`0o17`
that a YAML 1.2 reader takes for numbers, names such as `multigpu-train-` that Kubernetes refuses, and script
arguments that look like launcher flags dropped (`hello.py --nnodes 7 --rdzv-endpoint foo x` became `hello.py x`).
Also: abbreviated launcher flags were accepted (and written into the files), and a script's own `--n 5` was
refused as an ambiguous prefix. The files are run as written in test_schedulers_e2e.py.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from unittest import mock

import pytest
import yaml

from multigpu.cli import main
from tests.conftest import SCRIPTS

HELLO = str(SCRIPTS / "allreduce_loop.py")
_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""A DNS-1035 label (RFC 1123 with a leading letter): what the training operator needs of a job's name."""


def _print(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _docs(text: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def _container(job: dict, role: str = "Master") -> dict:
    return job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def test_everything_after_the_script_is_the_scripts_in_both_files_and_in_the_launch(capsys, fake_gpus, monkeypatch):
    theirs = ["--nnodes", "7", "--rdzv-endpoint", "foo", "x", "--debug", "--print-k8s", "--n", "5"]
    script = _print(capsys, "launch", "--nnodes", "2", "--nproc-per-node", "4", "--print-sbatch", HELLO, *theirs)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))  # in the background: see the trap
    assert srun.endswith(f"multigpu launch --nproc-per-node 4 {HELLO} " + " ".join(theirs) + " &"), srun
    job = _docs(_print(capsys, "launch", "--nnodes=2", "--gpus", "0,1", "--print-k8s", HELLO, *theirs))["PyTorchJob"]
    assert _container(job)["command"] == ["multigpu", "launch", "--gpus", "0,1", HELLO, *theirs]
    # and launched: the script gets them all, and a --debug of the script's is not the launcher's
    fake_gpus(0)
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch",
                    side_effect=lambda config, entry, args: seen.append((args, os.environ.get("MULTIGPU_DEBUG")))):
        assert main(["launch", HELLO, "--n", "5", "--t", "--p", "--m", "--s", "--num", "--pr", "--mi", "--debug"]) == 0
    args, debug = seen[0]
    assert args[args.index(HELLO) + 1:] == ["--n", "5", "--t", "--p", "--m", "--s", "--num", "--pr", "--mi", "--debug"]
    assert debug is None


@pytest.mark.parametrize("argv,word", [
    (["--nnod", "2", "--print-sb"], "--nnod"),
    (["--nproc", "2"], "--nproc"),
    (["--stand"], "--stand"),  # --standalone, abbreviated
])
def test_abbreviated_launcher_flags_are_refused(argv, word, capsys):
    assert main(["launch", *argv, HELLO]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: unrecognized arguments: ") and word in err and err.count("\n") == 1


def test_resources_come_from_the_jobs_flags_never_from_this_machine(capsys, fake_gpus):
    fake_gpus(8, cores=2)  # this machine's GPUs and cores are no guide to the cluster's nodes
    for argv in (["launch"], ["launch", "--gpus", "all"], ["launch", "--nproc-per-node", "gpu"]):
        for flag in ("--print-sbatch", "--print-k8s"):
            assert main([*argv, "--nnodes", "2", flag, HELLO]) == 2
            out, err = capsys.readouterr()
            assert out == "" and "how many GPUs each node of the job has" in err and err.count("\n") == 1, err
    lines = _print(capsys, "launch", "--nnodes", "2", "--cpu", "--nproc-per-node", "2", "--threads", "3",
                   "--print-sbatch", HELLO).splitlines()
    assert "#SBATCH --nodes=2" in lines and not any("--gpus-per-node" in line for line in lines)
    assert any(line.startswith("#SBATCH --cpus-per-task=6 ") for line in lines)  # --threads 3 × 2 workers
    lines = _print(capsys, "train", "-f", "nano", "--nnodes", "3", "--gpus", "2", "--print-sbatch").splitlines()
    assert any(line.startswith("#SBATCH --gpus-per-node=2 ") for line in lines)
    assert any(line.startswith("#SBATCH --exclusive ") for line in lines)  # no --threads: the whole node
    assert not any(line.startswith("#SBATCH --cpus-per-task") for line in lines)
    job = _docs(_print(capsys, "launch", "--cpu", "--nproc-per-node", "2", "--threads", "3", "--print-k8s",
                       HELLO))["PyTorchJob"]
    assert _container(job)["resources"] == {"limits": {"cpu": 6}} and job["spec"]["nprocPerNode"] == "2"
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]


def test_the_batch_script_makes_the_secret_once_before_srun_and_holds_none(capsys, tmp_path):
    script = _print(capsys, "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1", "--print-sbatch")
    lines = script.splitlines()
    secret = next(i for i, line in enumerate(lines) if line.startswith("export MULTIGPU_RDZV_SECRET="))
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert secret < srun and "--kill-on-bad-exit=1" in lines[srun]
    assert [line for line in lines[srun + 1:] if line.startswith("srun ")] == [] and lines[-1] == 'exit "$code"'
    assert not re.search(r"[0-9a-f]{32}", script)  # made when the job runs, not written here
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    made = subprocess.run(["bash", "-c", lines[secret] + '; printf %s "$MULTIGPU_RDZV_SECRET"'], capture_output=True,
                          text=True, check=True).stdout
    assert re.fullmatch(r"[0-9a-f]{32}", made)  # 16 random bytes: what every node's launcher requires


def test_the_pytorchjob_is_valid_kubernetes_with_a_secret_a_shared_volume_and_shm(capsys):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the [dev] extra
    jsonschema = pytest.importorskip("jsonschema")
    text = _print(capsys, "train", "-f", "nano", "--nnodes", "3", "--nproc-per-node", "2", "--print-k8s",
                  "lr=1e-3", "--set", "min_lr=5E-4")
    assert not re.search(r"[&*]id\d+", text)  # no YAML anchors or aliases
    docs = _docs(text)
    assert sorted(docs) == ["PersistentVolumeClaim", "PyTorchJob", "Secret"]
    version = kubernetes_validate.latest_version()
    for kind in ("Secret", "PersistentVolumeClaim"):
        kubernetes_validate.validate(docs[kind], version, strict=True)
    job = docs["PyTorchJob"]
    jsonschema.validate(job, _PYTORCHJOB)
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                    "template": spec["template"]}
        kubernetes_validate.validate(template, version, strict=True)  # the pods, against Kubernetes' own schema
    assert (job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"], job["spec"]["nprocPerNode"]) == (2, "2")
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1 and "elasticPolicy" not in job["spec"]
    name = job["metadata"]["name"]
    container = _container(job, "Worker")
    secret = docs["Secret"]
    ref = container["env"][0]["valueFrom"]["secretKeyRef"]
    assert container["env"][0]["name"] == "MULTIGPU_RDZV_SECRET" and "value" not in container["env"][0]
    assert ref["name"] == secret["metadata"]["name"] and re.fullmatch(r"[0-9a-f]{32}", secret["stringData"][ref["key"]])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    claim = volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    command = container["command"]
    assert command[command.index("--run-dir") + 1] == f"/runs/{name}" and command[-2:] == ["--resume", "auto"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert {spec["restartPolicy"] for spec in job["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}


_PYTORCHJOB = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": _LABEL.pattern, "maxLength": 63}}},
        "spec": {
            "type": "object", "required": ["pytorchReplicaSpecs"], "additionalProperties": False,
            "properties": {
                "nprocPerNode": {"type": "string"},
                "elasticPolicy": {"type": "object", "additionalProperties": False,
                                  "required": ["rdzvBackend", "minReplicas", "maxReplicas"],
                                  "properties": {"rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2"]},
                                                 "minReplicas": {"type": "integer", "minimum": 1},
                                                 "maxReplicas": {"type": "integer", "minimum": 1},
                                                 "maxRestarts": {"type": "integer", "minimum": 0}}},
                "runPolicy": {"type": "object"},
                "pytorchReplicaSpecs": {
                    "type": "object", "minProperties": 1, "additionalProperties": False,
                    "properties": {role: {
                        "type": "object", "required": ["replicas", "template"], "additionalProperties": False,
                        "properties": {"replicas": {"type": "integer", "minimum": 1},
                                       "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                                       "template": {"type": "object"}}} for role in ("Master", "Worker")}}}}}}
"""The part of Kubeflow's PyTorchJob (kubeflow.org/v1) CRD schema a job file uses; its pod templates are checked
against Kubernetes' own schema (kubernetes-validate, as PodTemplates)."""


def test_every_command_element_stays_a_string_and_names_are_rfc_1123(capsys, tmp_path):
    tricky = ["1e-3", "5E-4", "0o17", "yes", "null", "0x1F", "1_000", "~", "2024-01-01"]
    text = _print(capsys, "launch", "--nproc-per-node", "1", "--print-k8s", str(tmp_path / "train_.py"), *tricky)
    job = _docs(text)["PyTorchJob"]
    assert _container(job)["command"][-len(tricky):] == tricky  # strings to a YAML 1.1 reader (PyYAML) ...
    block = text[text.index("command:"):text.index("env:")]
    items = [line.strip()[2:] for line in block.splitlines()[1:] if line.strip()]
    assert items and all(re.fullmatch(r'"[^"]*"', item) for item in items), items  # ... and quoted for YAML 1.2
    names = {_docs(_print(capsys, "launch", "--nproc-per-node", "1", "--print-k8s", what))["PyTorchJob"]["metadata"]["name"]
             for what in (str(tmp_path / "train_.py"), "x" * 80 + ".py", "_.py", "Ünïcode Script.py")}
    assert all(_LABEL.match(n) and len(n) <= 40 for n in names), names
    first, again = (_docs(_print(capsys, "launch", "--nproc-per-node", "1", "--print-k8s", HELLO)) for _ in range(2))
    assert first["PyTorchJob"]["metadata"]["name"] != again["PyTorchJob"]["metadata"]["name"]  # one name per job
    assert first["Secret"]["stringData"] != again["Secret"]["stringData"]  # one secret per job


def test_a_manifest_written_to_a_file_is_this_users_only(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    with open(path, "w") as fh:
        os.chmod(path, 0o644)
        monkeypatch.setattr("sys.stdout", fh)
        assert main(["launch", "--nproc-per-node", "1", "--print-k8s", HELLO]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "MULTIGPU_RDZV_SECRET" in path.read_text()


def test_a_preempted_pod_or_batch_job_checkpoints_its_step_and_continues_its_run(capsys):
    """Kubernetes' SIGTERM reaches the launcher (the container's first process), and train then writes the step's
    checkpoint only with --checkpoint-on-interrupt: before, the PyTorchJob left it out (the pod was killed where it
    stood, and restarted from the last cadence checkpoint) and gave the pod Kubernetes' default 30 s between
    SIGTERM and SIGKILL, all of which the launcher's own wait for the ranks takes."""
    job = _docs(_print(capsys, "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1", "--cpu",
                       "--print-k8s"))["PyTorchJob"]
    for role in ("Master", "Worker"):
        spec = job["spec"]["pytorchReplicaSpecs"][role]
        assert spec["restartPolicy"] == "ExitCode" and spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
        command = spec["template"]["spec"]["containers"][0]["command"]
        assert "--checkpoint-on-interrupt" in command and command[-2:] == ["--resume", "auto"]
    lines = _print(capsys, "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1", "--cpu", "--run-dir",
                   "mine", "--checkpoint-on-interrupt", "--print-sbatch").splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun.count("--checkpoint-on-interrupt") == 1 and srun.count("--run-dir") == 1  # the user's own, kept
    # ... and continued by a requeued start (issue 48: without --resume auto the second start found the folder used
    # and was refused): the first start begins it, as --resume auto does on a new folder
    assert "#SBATCH --requeue" in "\n".join(lines) and srun.count("--resume auto") == 1
    job = _docs(_print(capsys, "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1", "--cpu", "--run-dir",
                       "/data/mine", "--print-k8s"))["PyTorchJob"]
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command.count("--run-dir") == 1 and command[-2:] == ["--resume", "auto"]
    given = next(line for line in _print(capsys, "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1",
                                         "--cpu", "--run-dir", "mine", "--resume", "auto", "--print-sbatch"
                                         ).splitlines() if line.startswith("srun "))
    assert given.count("--resume") == 1  # given already: not twice
    # a workload that cannot resume starts a new run folder of its own at each start (the next would be refused)
    srun = next(line for line in _print(capsys, "infer", "--nnodes", "2", "--nproc-per-node", "1", "--cpu",
                                        "--print-sbatch").splitlines() if line.startswith("srun "))
    assert "--run-dir" not in srun and "--resume" not in srun
    # a user script under `launch`: its resume is its own, the job still asks for the warning and the requeue
    lines = _print(capsys, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--cpu", "--print-sbatch",
                   HELLO).splitlines()
    assert any(line.startswith("#SBATCH --signal=B:USR1@") for line in lines)
    assert not any(flag in line for line in lines for flag in ("--run-dir", "--resume", "--checkpoint-on-interrupt"))


def _launch_config(command: list[str], env: dict[str, str]):
    """What the launcher makes of a job file's command on a node whose scheduler set ``env`` (nothing launched)."""
    from multigpu.cli import build_parser
    from multigpu.launch.flags import config_from_args

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    with mock.patch.dict(os.environ, {**clean, "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123", **env}, clear=True):
        return config_from_args(build_parser(command[1]).parse_args(command[1:]))


def test_an_elastic_batch_script_asks_min_to_max_nodes_and_a_lost_node_does_not_end_the_step(capsys, tmp_path):
    """Before, --nnodes 1:2 gave the script of a fixed 2-node job: srun --kill-on-bad-exit=1 ended the survivors
    when the lost node's task ended, and the launchers, without the range, were not elastic."""
    script = _print(capsys, "sim", "-f", "sir", "--nnodes", "1:2", "--cpu", "--nproc-per-node", "2", "--print-sbatch")
    lines = script.splitlines()
    assert any(line.startswith("#SBATCH --nodes=1-2 ") and "elastic" in line for line in lines), script
    assert any(line.startswith("#SBATCH --no-kill ") for line in lines)  # the allocation outlives a failed node
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert srun.startswith("srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 multigpu sim --nnodes=1:2 -f "
                           "sir ") and "--kill-on-bad-exit=1" not in script, srun
    # in the header, --ntasks-per-node makes SLURM give a --nodes=MIN-MAX job its MIN nodes, however many are free
    assert not any(line.startswith("#SBATCH --ntasks-per-node") for line in lines), script
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    command = srun.removeprefix("srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 ").removesuffix(" &").split()
    # SLURM gave the job 2 nodes, or only 1 of the 1-2 it asked for: an allocation never grows, so that is the most
    for nodes, expected in (("2", (1, 2, 3)), ("1", (1, 1, 0))):
        env = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NNODES": nodes, "SLURM_NODEID": "0",
               "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NTASKS_PER_NODE": "1"}
        cfg = _launch_config([a.replace("${SLURM_JOB_ID}", "4242") for a in command], env)
        assert (cfg.min_nodes, cfg.nnodes, cfg.max_restarts) == expected  # elastic: restarts left to re-form
    fixed = _print(capsys, "sim", "-f", "sir", "--nnodes", "2", "--cpu", "--nproc-per-node", "2", "--print-sbatch")
    assert "#SBATCH --nodes=2" in fixed.splitlines() and "--no-kill" not in fixed and "--kill-on-bad-exit=1" in fixed


def test_an_elastic_pytorchjob_has_the_operators_elastic_policy_and_its_pods_form_an_elastic_job(capsys):
    """--print-k8s with --nnodes MIN:MAX: Workers only with an elasticPolicy (c10d, MIN/MAX replicas, the restarts
    the launchers get), the rendezvous port the operator builds PET_RDZV_ENDPOINT from, and each pod's index as
    its node rank; valid Kubernetes, and each pod's command with the variables the operator sets is an elastic
    launch. Before, the job was a fixed-size one of MAX pods."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    text = _print(capsys, "rl", "-f", "ppo-cartpole", "--nnodes", "1:3", "--cpu", "--nproc-per-node", "2",
                  "--max-restarts", "5", "--print-k8s")
    assert not re.search(r"[&*]id\d+", text)
    docs = _docs(text)
    job = docs["PyTorchJob"]
    jsonschema.validate(job, _PYTORCHJOB)
    version = kubernetes_validate.latest_version()
    for kind in ("Secret", "PersistentVolumeClaim"):
        kubernetes_validate.validate(docs[kind], version, strict=True)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 3  # the operator's elastic form
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3,
                                            "maxRestarts": 5}
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                "template": specs["Worker"]["template"]}
    kubernetes_validate.validate(template, version, strict=True)
    container = _container(job, "Worker")
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400}]
    rank = next(e for e in container["env"] if e["name"] == "PET_NODE_RANK")
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['training.kubeflow.org/replica-index']"
    assert container["command"][:3] == ["multigpu", "rl", "--nnodes=1:3"]
    assert "# multigpu-rl-" in text.splitlines()[0] and "1 to 3 pod(s) (elastic)" in text.splitlines()[0]
    # what the training operator sets on an elastic job's pod (its elasticPolicy), plus the pod's index label
    name = job["metadata"]["name"]
    env = {"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": f"{name}-worker-0:29400", "PET_RDZV_BACKEND": "c10d",
           "PET_MAX_RESTARTS": "5", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_NODE_RANK": "2"}
    for command in (container["command"], [a for a in container["command"] if not a.startswith("--nnodes")]):
        cfg = _launch_config(command, env)  # the range from the command, or from PET_NNODES alone
        assert (cfg.min_nodes, cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint, cfg.max_restarts) == \
            (1, 3, 2, f"{name}-worker-0:29400", 5)
    with pytest.raises(Exception, match=r"PET_NNODES='3:1' must be a number of nodes or MIN:MAX"):
        _launch_config(container["command"][:2] + container["command"][3:], {**env, "PET_NNODES": "3:1"})
