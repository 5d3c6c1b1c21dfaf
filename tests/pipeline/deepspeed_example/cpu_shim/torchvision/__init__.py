"""The part of torchvision that DeepSpeedExamples' pipeline train.py uses, for a CPU run without
torchvision or a download (the CPU harness, ../../cpu_harness.py, puts this folder first on
sys.path):

- ``models.AlexNet``: torchvision's layout (models.py, written here: same layers at the same
  indices, built in the same order, so the same initial weights from the same seed);
- ``datasets.CIFAR10``: synthetic images of CIFAR-10's classes, already normalized, 64x64
  (``EXAMPLE_IMAGE_SIZE``), ``EXAMPLE_SAMPLES`` of them; the ``transform`` the script passes is
  not applied (it would resize to 224x224, too slow on two CPU cores);
- ``transforms``: the names the script builds its transform from.
"""

from . import datasets, models, transforms

__version__ = "0.0+cpu-harness"
__all__ = ["datasets", "models", "transforms"]
