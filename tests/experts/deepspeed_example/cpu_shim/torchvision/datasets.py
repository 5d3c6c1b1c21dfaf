"""A synthetic CIFAR-10 of CIFAR's shape (3 x 32 x 32, labels 0-9), the same on every process (a
fixed seed): ``EXAMPLE_SAMPLES`` training images (default 160) and ``EXAMPLE_TEST_SAMPLES`` test
images (default 16). Each class is a fixed random color plus pixel noise, so the script's
network learns it within a few steps."""

import os

import torch

__all__ = ["CIFAR10"]


class CIFAR10(torch.utils.data.Dataset):
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root=None, train=True, download=False, transform=None, target_transform=None, seed=2025):
        n = int(os.environ.get("EXAMPLE_SAMPLES" if train else "EXAMPLE_TEST_SAMPLES", "160" if train else "16"))
        g = torch.Generator().manual_seed(seed + (0 if train else 1))
        patterns = torch.randn(len(self.classes), 3, 1, 1, generator=g).expand(-1, -1, 32, 32)
        self.targets = torch.randint(0, len(self.classes), (n,), generator=g)
        self.data = patterns[self.targets] + 0.5 * torch.randn(n, 3, 32, 32, generator=g)
        self.root, self.train, self.transform = root, train, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        return self.data[index], int(self.targets[index])
