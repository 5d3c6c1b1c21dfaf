"""Pieces of the checkpoint machinery that need no process group: the dataloader position, the
safetensors writer/ranged reader, size parsing."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from zerotrain.checkpoint.format import CheckpointError, TensorFile, write_safetensors
from zerotrain.checkpoint.zero_to_fp32 import parse_size
from zerotrain.engine.data import DistributedDataLoader


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b[0]]


def _loader(rank, world, batch):
    return DistributedDataLoader(TensorDataset(torch.arange(64)), batch_size=batch, rank=rank, world_size=world, seed=7)


def test_dataloader_resumes_inside_the_epoch():
    loader = _loader(0, 2, 4)
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1, three batches handed out
    seen = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    assert state == {"epoch": 1, "batches": 3, "batch_size": 4, "world_size": 2}
    fresh = _loader(0, 2, 4)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # before iterating, the loaded position is reported
    assert _ids(list(fresh)) == _ids(rest)
    assert _ids(list(fresh)) == _ids(list(_loader_at_epoch(2)))  # and the next epoch is epoch 2
    assert len(seen) == 3


def _loader_at_epoch(epoch):
    loader = _loader(0, 2, 4)
    for _ in range(epoch):
        list(loader)
    return loader


def test_dataloader_resumes_on_another_world_size_with_the_same_global_batch():
    """2 ranks x 4 after 3 batches -> 1 rank x 8: the rest of the epoch's global order."""
    loaders = [_loader(r, 2, 4) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    done = [[next(it) for _ in range(3)] for it in its]
    state = loaders[0].state_dict()
    seen = set(_ids(done[0]) + _ids(done[1]))
    single = _loader(0, 1, 8)
    single.load_state_dict(state)
    rest = _ids(list(single))
    assert len(rest) == 64 - 24 and not seen & set(rest) and seen | set(rest) == set(range(64))


def test_safetensors_written_streaming_read_by_ranges_and_by_the_library(tmp_path):
    tensors = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0),
    }
    info = write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    assert info["bytes"] == (tmp_path / "t.safetensors").stat().st_size
    from safetensors.torch import load_file

    loaded = load_file(tmp_path / "t.safetensors")
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)
    f = TensorFile(tmp_path / "t.safetensors")
    assert torch.equal(f.read("a", 3, 4), torch.arange(3, 7, dtype=torch.float32))
    assert torch.equal(f.read("b", 5, 5), tensors["b"].reshape(-1)[5:10])
    with pytest.raises(CheckpointError, match="has 10 elements"):
        f.read("a", 8, 4)
    f.close()
    (tmp_path / "bad").write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        TensorFile(tmp_path / "bad")


@pytest.mark.parametrize("text, value", [("5GB", 5 * 10**9), ("200MB", 2 * 10**8), ("1GiB", 2**30), (123, 123)])
def test_parse_size(text, value):
    assert parse_size(text) == value
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")
