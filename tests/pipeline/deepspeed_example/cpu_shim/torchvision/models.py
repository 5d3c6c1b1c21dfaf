"""An AlexNet with torchvision's module layout (``features`` / ``avgpool`` / ``classifier``, the
same layers at the same indices, built in the same order), written here from the architecture
(Krizhevsky et al. 2012, single-tower variant) so that the same seed gives the same initial
weights as ``torchvision.models.AlexNet`` without installing torchvision."""

import torch
from torch import nn

__all__ = ["AlexNet", "vgg19"]

# (in, out, kernel, stride, padding, max-pool after)
_CONVS = [
    (3, 64, 11, 4, 2, True),
    (64, 192, 5, 1, 2, True),
    (192, 384, 3, 1, 1, False),
    (384, 256, 3, 1, 1, False),
    (256, 256, 3, 1, 1, True),
]
_POOLED = 6  # the classifier sees 256 channels of 6 x 6


def _feature_layers() -> list[nn.Module]:
    layers: list[nn.Module] = []
    for cin, cout, kernel, stride, padding, pool in _CONVS:
        layers += [nn.Conv2d(cin, cout, kernel_size=kernel, stride=stride, padding=padding), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2))
    return layers


def _classifier_layers(num_classes: int, dropout: float) -> list[nn.Module]:
    width = 4096
    return [
        nn.Dropout(p=dropout),
        nn.Linear(256 * _POOLED * _POOLED, width),
        nn.ReLU(inplace=True),
        nn.Dropout(p=dropout),
        nn.Linear(width, width),
        nn.ReLU(inplace=True),
        nn.Linear(width, num_classes),
    ]


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(*_feature_layers())
        self.avgpool = nn.AdaptiveAvgPool2d((_POOLED, _POOLED))
        self.classifier = nn.Sequential(*_classifier_layers(num_classes, dropout))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(images)), 1))


def vgg19(*args, **kwargs):
    """Imported by the script (in a comment's alternative), never called."""
    raise NotImplementedError("the CPU harness's torchvision has AlexNet only; install torchvision for vgg19")
