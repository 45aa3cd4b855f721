"""PyTorch's DDP tutorial habit: pin the rank to a GPU by hand. On a machine without CUDA it dies in torch."""
import os

import torch

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
