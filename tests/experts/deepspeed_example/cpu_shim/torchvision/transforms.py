"""The transform names the script composes; the synthetic CIFAR10 (datasets.py) does not apply
them: its images are already normalized tensors."""

__all__ = ["Compose", "ToTensor", "Normalize"]


class _Transform:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


class Compose(_Transform):
    pass


class ToTensor(_Transform):
    pass


class Normalize(_Transform):
    pass
