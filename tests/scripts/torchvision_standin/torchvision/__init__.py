"""A stand-in for torchvision, for running pytorch/examples' imagenet ``main.py`` (tests/third_party/imagenet)
unchanged on this machine's CPU torch.

torchvision's wheels on PyPI are built against CUDA torch: their C extension does not load against the CPU torch
the tests run on, and ``import torchvision`` then fails (``operator torchvision::nms does not exist``). ``main.py``
uses three of its names with ``--dummy``: the model table (``models.__dict__``, ``models.resnet18()``),
``datasets.FakeData`` and ``transforms.ToTensor``. These are those names, small enough that an epoch takes
seconds: ``FakeData`` holds ``STANDIN_FAKEDATA_SIZE`` images (default 16) of ``STANDIN_IMAGE_SIZE`` pixels a side
(default 16) whatever size ``main.py`` asks for, and ``resnet18`` is a two-layer conv net with a 1000-way head.
Put this folder on ``PYTHONPATH`` to use it; nothing else imports it.
"""

from . import datasets, models, transforms  # noqa: F401

__version__ = "0.0-standin"
