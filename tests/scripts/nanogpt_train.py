"""nanoGPT's train.py in miniature, as a user brings it from torchrun: its own globals overridden by ``--key=value``
(nanoGPT's configurator), ``init_process_group(backend=backend)`` with NCCL by default, ``cuda:{local_rank}`` pinned
by hand, a per-rank seed (``seed_offset = ddp_rank``), the accumulation steps divided by the world size, random
batches drawn by each rank (``get_batch``), a DDP-wrapped GPT that returns ``(logits, loss)``.

``--moved=True`` is the script after the move: the device from ``mg.device()`` and the final loss recorded for
``multigpu verify`` (``mg.verify.record``). ``--seed_offset_by_rank=False`` seeds every rank alike.
"""
import os
import sys

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

# default config values (nanoGPT's style: globals, overridden from the command line)
backend = "nccl"
device = "cuda"
gradient_accumulation_steps = 4
batch_size = 4
block_size = 16
max_iters = 6
learning_rate = 1e-2
moved = False
seed_offset_by_rank = True
for arg in sys.argv[1:]:  # nanoGPT's configurator.py, in one loop
    key, _, value = arg.removeprefix("--").partition("=")
    globals()[key] = type(globals()[key])(value) if not isinstance(globals()[key], bool) else value == "True"

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    if moved:
        import multigpu as mg

        device = mg.device()
    else:
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank if seed_offset_by_rank else 0
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
torch.manual_seed(1337 + seed_offset)

data = torch.randint(0, 65, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


model = GPT(GPTConfig(block_size=block_size, vocab_size=65)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if ddp:
    model = DDP(model)
for _iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch()
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
final = loss.item() * gradient_accumulation_steps
if master_process:
    sys.stdout.write(f"iter {max_iters}: loss {final:.4f}\n")
if moved:
    mg.verify.record("final_loss", final)
if ddp:
    destroy_process_group()
