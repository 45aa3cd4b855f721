"""strategy=fsdp's checks (no processes): what cannot be sharded is refused with one line and exit 2."""

from __future__ import annotations

import pytest
import torch

from multigpu.cli import main as cli_main
from multigpu.errors import ConfigError
from multigpu.train import TrainConfig
from multigpu.train.strategy_checks import check_fits, check_sharding, training_state_bytes


def no_params():
    """A model factory whose model has nothing to shard."""
    return torch.nn.Identity()


def reads_a_weight():
    """A model factory that reads a parameter's value while building (cannot run on the meta device)."""
    net = torch.nn.Linear(4, 4)
    if net.weight.sum().item() > 1e9:
        raise AssertionError("unreachable")
    return net


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.ones(4))  # its own parameter, and no reset_parameters()

    def forward(self, x):
        return self.linear(x) * self.gain


def no_reset():
    """A model factory whose module holds a parameter that nothing can initialize after a meta build."""
    return _Scale()


def two_rows():
    """A model factory whose largest parameter has 2 rows (weight 2 x 3, bias 2)."""
    return torch.nn.Linear(3, 2)


def test_check_sharding_refuses_what_cannot_be_sharded():
    with pytest.raises(ConfigError, match="has no parameters"):
        check_sharding(torch.nn.ReLU(), 2)
    with pytest.raises(ConfigError, match=r"Nope is not a module class of this model; valid: .*Linear"):
        check_sharding(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, ["Nope"])
    with pytest.raises(ConfigError, match="leaves rank 2 with no parameters .* at most 2 ranks"):
        check_sharding(torch.nn.Linear(3, 2), 3)  # 2 rows of weight and bias: ceil(2/3) = 1 row each, rank 2 none
    check_sharding(torch.nn.Linear(3, 2), 2)


def test_planned_training_state_falls_with_the_ranks():
    net = torch.nn.Linear(10, 6, bias=False)  # 60 fp32 numbers = 240 bytes
    assert training_state_bytes(net, 1, sharded=False) == {"params": 240, "grads": 240, "optimizer": 480}
    assert training_state_bytes(net, 3, sharded=False)["params"] == 240  # DDP: a whole replica on every rank
    assert training_state_bytes(net, 3, sharded=True) == {"params": 80, "grads": 80, "optimizer": 160}
    assert training_state_bytes(net, 4, sharded=True)["params"] == 80  # ceil(6/4) = 2 rows on the largest shard


def test_a_replica_that_does_not_fit_is_refused_naming_the_planned_memory():
    net = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of fp32 parameters: 16 MiB of training state
    with pytest.raises(ConfigError, match=r"^strategy=ddp: the planned training state per rank is 16 MiB \(parameters "
                       r"4 MiB, gradients 4 MiB, Adam 8 MiB: a whole replica on every rank\) but a rank may fill about "
                       r"10 MiB \(the cap\); valid: --strategy fsdp \(8 MiB per rank on 2 ranks\)"):
        check_fits(net, 2, "ddp", 10 << 20, "the cap")
    check_fits(net, 2, "fsdp", 10 << 20, "the cap")  # 8 MiB each
    with pytest.raises(ConfigError, match=r"^strategy=fsdp: .* is 8 MiB .*sharded over 2 ranks.*valid: more ranks"):
        check_fits(net, 2, "fsdp", 6 << 20, "the cap")


def test_bad_fsdp_input_is_one_line_and_exit_2(tmp_path, capsys, fake_gpus):
    fake_gpus(0)
    for argv, message in [
        (["strategy=fsdp", "fsdp_blocks=[Nope]"], "fsdp_blocks: Nope is not a module class of this model"),
        (["strategy=fsdp", "--model", "tests.unit.test_fsdp_checks:no_params"], "has no parameters"),
        (["--strategy", "fsdp", "fsdp_cpu_offload=true"], "fsdp_cpu_offload=true needs GPU ranks"),
        (["--strategy", "fsdp", "--precision", "fp16"], "strategy=fsdp with precision=fp16"),
        (["strategy=fsdp", "--model", "tests.unit.test_fsdp_checks:reads_a_weight"],
         "cannot be built on the meta device (model.factory 'tests.unit.test_fsdp_checks:reads_a_weight': calling "
         "it failed: RuntimeError: Tensor.item() cannot be called on meta tensors"),
        (["strategy=fsdp", "--model", "tests.unit.test_fsdp_checks:no_reset"],
         "the root module (_Scale) has parameters or buffers but no reset_parameters()"),
    ]:
        code = cli_main(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
        assert not (tmp_path / "run").exists()


def test_fsdp_where_it_cannot_run_on_the_job_devices_is_one_line_and_exit_2(tmp_path, capsys, fake_gpus):
    """A hybrid job (its CPU ranks' shards would need a mesh of their own), and CPU offload at world size 1
    (sharding over one rank needs a process group the job does not have: it was silently ignored)."""
    fake_gpus(1)
    for argv, message in [
        (["--nproc-per-node", "2", "--allow-cpu-ranks", "--strategy", "fsdp"], "strategy=fsdp in a hybrid job"),
        (["--nproc-per-node", "1", "--strategy", "fsdp", "fsdp_cpu_offload=true"], "fsdp_cpu_offload=true at world "
                                                                                  "size 1"),
    ]:
        code = cli_main(["train", "--run-dir", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
        assert not (tmp_path / "run").exists()


def test_bad_hsdp_input_is_one_line_and_exit_2(tmp_path, capsys, fake_gpus):
    """hsdp from the command line (it was refused whole: "runs through the Trainer API for now"): a shard size
    that does not tile the world size, a hybrid job, a replica whose ranks would hold nothing."""
    fake_gpus(0)
    for argv, message in [
        (["--nproc-per-node", "4", "--strategy", "hsdp", "hsdp_shard_size=3"],
         "strategy=hsdp: hsdp_shard_size=3 does not divide the world size 4 into whole replicas; valid: 1, 2, 4"),
        (["--nproc-per-node", "4", "--strategy", "hsdp", "hsdp_shard_size=4", "--model",
          "tests.unit.test_fsdp_checks:two_rows"],
         "strategy=hsdp with hsdp_shard_size=4 leaves rank 2 of each replica with no parameters (the largest "
         "parameter has 2 rows); valid: hsdp_shard_size at most 2, or strategy=ddp"),
    ]:
        code = cli_main(["train", "--run-dir", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
        assert not (tmp_path / "run").exists()
    fake_gpus(1)
    code = cli_main(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", "--allow-cpu-ranks",
                     "--strategy", "hsdp"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "error: strategy=hsdp in a hybrid job (GPU and CPU ranks)" in err, err


def test_hsdp_plans_one_shard_of_a_replica_per_rank():
    """Each rank holds 1/hsdp_shard_size of the state (a replica's share), not 1/world_size."""
    net = torch.nn.Linear(1024, 1024, bias=False)  # 16 MiB of training state: 8 MiB over 2 ranks, 4 MiB over 4
    check_fits(net, 4, "hsdp", 5 << 20, "the cap", shard_size=4)
    with pytest.raises(ConfigError, match=r"^strategy=hsdp: the planned training state per rank is 8 MiB \(parameters "
                       r"2 MiB, gradients 2 MiB, Adam 4 MiB: sharded over 2 ranks of a replica, 2 replicas\) but a "
                       r"rank may fill about 5 MiB \(the cap\); valid: a larger hsdp_shard_size \(up to 4: 4 MiB "
                       r"per rank\)"):
        check_fits(net, 4, "hsdp", 5 << 20, "the cap", shard_size=2)


def test_the_launcher_plans_hsdp_memory_per_replica_shard(tmp_path, capsys, fake_gpus):
    """`multigpu train --strategy hsdp` on 4 ranks: with hsdp_shard_size=2 each rank plans half the 85M GPT's
    1,298 MiB (649 MiB), more than its 500 MiB share of this node, so it is refused before anything starts,
    where fsdp over the 4 ranks would plan 325 MiB."""
    from multigpu.launch.devices import RANK_RESIDENT_BYTES

    fake_gpus(0, available_bytes=4 * ((500 << 20) + RANK_RESIDENT_BYTES))
    code = cli_main(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "4", "--strategy", "hsdp",
                     "hsdp_shard_size=2", "model.kwargs.n_layer=12", "model.kwargs.n_embd=768",
                     "model.kwargs.n_head=12", "block_size=64"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("error: strategy=hsdp: the planned training state per rank is 649 MiB (") and \
        "sharded over 2 ranks of a replica, 2 replicas) but a rank may fill about 500 MiB" in err, err
    assert not (tmp_path / "run").exists()


def test_a_ddp_checkpoint_is_refused_under_fsdp_and_hsdp_before_anything_starts(tmp_path, capsys, fake_gpus):
    """Whole state dicts (ddp's) do not load into shards: one line in the launcher, naming what would load it
    (under fsdp the ranks used to start and fail: "it holds no sharded state"). DCP shards load under any
    strategy (tests/cli/test_hsdp_e2e.py resumes an hsdp checkpoint under ddp)."""
    from multigpu.checkpoint import CheckpointStore
    from tests.conftest import assert_bad_input

    fake_gpus(0)
    path = CheckpointStore(tmp_path / "old" / "checkpoints").save(1, {"model": {"w": torch.zeros(2)}, "trainer": {}})
    for strategy in ("fsdp", "hsdp"):
        assert_bad_input(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", "--strategy", strategy,
                          "--resume", str(path)],
                         f"checkpoint {path} holds whole state dicts (written under strategy=ddp), which "
                         f"strategy={strategy} does not load; valid: resume it with strategy=ddp", capsys, tmp_path / "run")


def test_the_trainer_refuses_cpu_offload_alone_too(single_rank_group):
    """The same refusal inside a rank (a script using the Trainer without the launcher)."""
    from multigpu.train import Trainer

    model = torch.nn.Linear(4, 4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.zeros(4), 0)] * 8,
                      config=TrainConfig(strategy="fsdp", fsdp_cpu_offload=True, global_batch_size=2))
    with pytest.raises(ConfigError, match="fsdp_cpu_offload=true at world size 1"):
        trainer.setup()


def test_init_from_is_checked_against_the_model_the_ranks_will_build(tmp_path, capsys, fake_gpus):
    """A Hugging Face model takes its vocabulary from the (default) data: the launcher's check builds it with that
    vocabulary too (it built it with the config's 32,000 and refused the matching weights); another model's
    weights are one line and exit 2."""
    from multigpu.factory import Factory
    from multigpu.train.data import VOCAB
    from multigpu.train.hf import causal_lm
    from multigpu.train.job import TrainJobConfig, _check_init_from
    from tests.conftest import assert_bad_input

    fake_gpus(0)
    shape = {"config": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2}
    weights = tmp_path / "weights"
    causal_lm(vocab_size=len(VOCAB), **shape).save_pretrained(weights)
    cfg = TrainJobConfig(model=Factory(factory="multigpu.train.hf:causal_lm", kwargs=shape), init_from=str(weights),
                         strategy="fsdp")
    _check_init_from(cfg)  # the ranks' model: no error
    capsys.readouterr()  # save_pretrained's progress bar
    assert_bad_input(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", f"init_from={weights}"],
                     "no tensor named 'tok.weight' or 'head.weight' for this model", capsys, tmp_path / "run")
