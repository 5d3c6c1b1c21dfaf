"""The training dataloader ``initialize(training_data=...)`` builds: one micro-batch per rank."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


class DistributedDataLoader:
    """A DataLoader over this rank's part of ``dataset`` that reshuffles every epoch.

    Each ``iter()`` starts a new epoch (``DistributedSampler.set_epoch``), so a plain
    ``for epoch ...: for batch in loader`` loop sees a different order each epoch, the same
    on every rank. Iterable datasets are passed through unsharded: they shard themselves.
    """

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world_size: int,
                 collate_fn=None, drop_last: bool = False, shuffle: bool = True, seed: int = 0,
                 num_workers: int = 0, pin_memory: bool = False):
        self.sampler = None
        if not isinstance(dataset, IterableDataset):
            self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                              shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers, pin_memory=pin_memory)
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def __iter__(self):
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)
