"""strategy=fsdp's checks (no processes): what cannot be sharded is refused with one line and exit 2."""

from __future__ import annotations

import pytest
import torch

from multigpu.cli import main as cli_main
from multigpu.errors import ConfigError
from multigpu.train import TrainConfig
from multigpu.train.fsdp import check_fits, check_sharding, training_state_bytes


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
