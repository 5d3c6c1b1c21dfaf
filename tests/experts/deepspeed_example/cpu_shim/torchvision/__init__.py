"""The part of torchvision that DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py`` uses,
for a CPU run without torchvision or a download (../../cpu_harness.py puts this folder first on
sys.path): ``datasets.CIFAR10`` (synthetic 32x32 images, datasets.py) and the ``transforms``
names the script composes (not applied: the images are already normalized tensors)."""

from . import datasets, transforms

__version__ = "0.0+cpu-harness"
__all__ = ["datasets", "transforms"]
