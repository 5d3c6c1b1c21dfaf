"""Real text that is on every machine: the Python standard library's own source files.

Byte-level tokens (vocabulary 256), so no tokenizer download is needed.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


class PythonSourceText:
    """UTF-8 bytes of the first ``max_bytes`` of the stdlib's ``.py`` files, in sorted order
    (deterministic on a given Python version)."""

    def __init__(self, max_bytes: int = 4_000_000, root: str | os.PathLike | None = None):
        root = Path(root or sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if not chunks:
            raise FileNotFoundError(f"no .py files under {root}")
        self.tokens = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class TokenBlocks(Dataset):
    """Non-overlapping blocks of ``seq_len`` tokens as ``{"input_ids", "labels"}`` (HF style)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        n = tokens.numel() // seq_len
        if n == 0:
            raise ValueError(f"{tokens.numel()} tokens make no block of {seq_len}")
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {"input_ids": block, "labels": block}
