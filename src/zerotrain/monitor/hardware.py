"""Per-step hardware figures of every rank: CPU utilisation and RSS (psutil), and on CUDA the
device's utilisation and memory (NVIDIA's management library, ``pynvml``, when installed) and
torch's allocated bytes. Gathered to every rank of one engine's data-parallel group with one small
all-gather per step; each row is named by its global rank (``Hardware/rank{r}/...``)."""

from __future__ import annotations

import psutil
import torch

_MB = 2**20


class HardwareSampler:
    """Samples this process; ``gather`` exchanges the samples over ``group`` (the engine's data
    group, whose members in group order are the global ``ranks``; None with one rank)."""

    def __init__(self, group=None, ranks: list[int] | None = None):
        self.group = group
        self.ranks = list(ranks) if ranks is not None else [0]
        if len(self.ranks) > 1 and group is None:
            raise ValueError(
                "HardwareSampler: pass the group of the ranks it gathers over "
                "(the engine's topology.data_group); None would be the whole world"
            )
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the interval
        self._cuda = torch.cuda.is_available()
        self._nvml = None
        if self._cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
            except Exception:  # not installed or no driver access: torch's figures only
                self._nvml = None
        self.names = ["cpu_percent", "rss_MB"]
        if self._cuda:
            self.names += ["gpu_allocated_MB", "gpu_max_allocated_MB"]
            if self._nvml is not None:
                self.names += ["gpu_util_percent", "gpu_used_MB"]

    def sample(self) -> list[float]:
        """This process's CPU % since the last sample (100 = one core busy) and RSS in MiB, then
        the CUDA figures."""
        values = [self._process.cpu_percent(None), self._process.memory_info().rss / _MB]
        if self._cuda:
            values += [torch.cuda.memory_allocated() / _MB, torch.cuda.max_memory_allocated() / _MB]
            if self._nvml is not None:
                pynvml, handle = self._nvml
                values += [
                    float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    pynvml.nvmlDeviceGetMemoryInfo(handle).used / _MB,
                ]
        return values

    def gather(self, device) -> torch.Tensor:
        """``[len(ranks), len(names)]``: every rank's sample, in group order."""
        mine = torch.tensor(self.sample(), dtype=torch.float64, device=device)
        if len(self.ranks) == 1:
            return mine.unsqueeze(0).cpu()
        from zerotrain.comm import collectives

        out = torch.empty(len(self.ranks) * mine.numel(), dtype=mine.dtype, device=device)
        collectives.all_gather_into(out, mine, group=self.group)
        return out.view(len(self.ranks), -1).cpu()

    def events(self, table: torch.Tensor, step: int) -> list[tuple[str, float, int]]:
        return [
            (f"Hardware/rank{self.ranks[row]}/{name}", float(table[row, i]), step)
            for row in range(table.shape[0])
            for i, name in enumerate(self.names)
        ]
