"""A model table with one small entry under torchvision's name (``main.py`` lists ``models.__dict__``)."""

from torch import nn


def resnet18(pretrained=False, num_classes=1000):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
