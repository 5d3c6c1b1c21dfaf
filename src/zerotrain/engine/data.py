"""The training dataloader ``initialize(training_data=...)`` builds: one micro-batch per rank."""

from __future__ import annotations

import itertools

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler


class _ResumableSampler(Sampler):
    """``DistributedSampler`` that can start an epoch part-way (after a checkpoint resume)."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler = sampler
        self.skip = 0  # indices of the next epoch to leave out (set by load_state_dict)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class DistributedDataLoader:
    """A DataLoader over this rank's part of ``dataset`` that reshuffles every epoch.

    Each ``iter()`` starts a new epoch (``DistributedSampler.set_epoch``), so a plain
    ``for epoch ...: for batch in loader`` loop sees a different order each epoch, the same
    on every rank. Iterable datasets are passed through unsharded: they shard themselves.
    ``state_dict()`` records the epoch and how many batches of it were handed out, so a resumed
    run (``engine.load_checkpoint``) continues the interrupted epoch where it stopped.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        collate_fn=None,
        drop_last: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.sampler: DistributedSampler | None = None
        self.world_size = world_size
        if not isinstance(dataset, IterableDataset):
            self.sampler = DistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            self._resumable = _ResumableSampler(self.sampler)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._resumable if self.sampler is not None else None,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.epoch = 0
        self._consumed = 0  # batches of epoch ``epoch - 1`` handed out so far
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) for the next iter

    @property
    def batch_size(self) -> int:
        batch_size = self.loader.batch_size
        assert batch_size is not None  # the loader is built with a batch size, not a batch_sampler
        return batch_size

    def __iter__(self):
        start = 0
        if self._resume is not None:
            self.epoch, start = self._resume
            self._resume = None
            self._resumable.skip = start * self.batch_size
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        self._consumed = start
        return self._count(iter(self.loader))

    def _count(self, batches):
        for batch in batches:
            self._consumed += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        """The position: the epoch being iterated and the batches of it handed out so far."""
        if self._resume is not None:  # loaded but not iterated yet: keep the loaded position
            epoch, consumed = self._resume
        else:
            epoch, consumed = max(self.epoch - 1, 0), self._consumed
        return {"epoch": epoch, "batches": consumed, "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """The next ``iter()`` continues epoch ``state["epoch"]`` after the batches already
        handed out. With another world size or micro-batch, the same number of samples of the
        epoch's global order is skipped (exact when the global batch is unchanged)."""
        if self.sampler is None:
            raise ValueError(
                "the dataloader iterates an IterableDataset, whose position "
                "zerotrain cannot restore; skip load_checkpoint's dataloader state "
                "by building the dataloader yourself"
            )
        batches = int(state["batches"])
        if state.get("world_size") != self.world_size or state.get("batch_size") != self.batch_size:
            samples = batches * int(state["batch_size"]) * int(state["world_size"])
            batches = samples // (self.batch_size * self.world_size)
        self._resume = (int(state["epoch"]), batches)


class RepeatingLoader:
    """Iterate over ``loader`` forever: when it is exhausted, start it again.

    Each restart calls ``iter(loader)`` anew, so a zerotrain engine dataloader (or any loader
    with a ``DistributedSampler`` whose epoch is advanced) yields a new shuffle per pass, while
    DeepSpeed's own dataloader repeats its first order (docs/compat.md).
    """

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration again
