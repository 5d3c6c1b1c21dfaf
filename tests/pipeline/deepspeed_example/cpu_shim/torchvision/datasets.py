"""A synthetic CIFAR-10: ``EXAMPLE_SAMPLES`` (default 256) normalized 3 x S x S float images
(S = ``EXAMPLE_IMAGE_SIZE``, default 64) with labels 0-9, the same on every process (a fixed
seed). Each class is a fixed random color plus pixel noise, so a classifier learns it within
a few steps."""

import os

import torch

__all__ = ["CIFAR10"]


class CIFAR10(torch.utils.data.Dataset):
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root=None, train=True, download=False, transform=None, target_transform=None, seed=2024):
        n = int(os.environ.get("EXAMPLE_SAMPLES", "256"))
        size = int(os.environ.get("EXAMPLE_IMAGE_SIZE", "64"))
        g = torch.Generator().manual_seed(seed + (0 if train else 1))
        patterns = 2 * torch.randn(len(self.classes), 3, 1, 1, generator=g).expand(-1, -1, size, size)
        self.targets = torch.randint(0, len(self.classes), (n,), generator=g)
        self.data = patterns[self.targets] + 0.5 * torch.randn(n, 3, size, size, generator=g)
        self.root, self.train, self.transform = root, train, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        return self.data[index], int(self.targets[index])
