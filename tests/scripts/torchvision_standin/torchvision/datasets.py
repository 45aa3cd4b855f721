"""``FakeData``: random images, the same for every index on every rank (seeded by the index)."""

import os

import torch


class FakeData(torch.utils.data.Dataset):
    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None, target_transform=None,
                 random_offset=0):
        self.size = min(size, int(os.environ.get("STANDIN_FAKEDATA_SIZE", "16")))
        side = int(os.environ.get("STANDIN_IMAGE_SIZE", "16"))
        self.image_size = (image_size[0], side, side)
        self.num_classes = num_classes
        self.transform = transform
        self.random_offset = random_offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index + self.random_offset)
        img = torch.rand(self.image_size, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        if self.transform is not None:
            img = self.transform(img)
        return img, target
