"""Per-layer MoE statistics in the step log and the monitors: the routes each expert was given,
the share of routes the capacity dropped, and ``l_aux`` (docs/moe.md, "Statistics").

``MoEStats.attach(module, group)`` hooks every ``MOELayer`` of the module (None when it has none).
Each training forward adds the layer's ``exp_counts`` (routes per expert before the drops), the
routes over capacity (``sum(max(count - capacity, 0))``: every gate keeps ``min(count, capacity)``
routes per expert; none in dropless mode) and ``l_aux``. The engine calls ``step_done`` at every
optimizer step on every rank: the sums are added over the data-parallel group (every rank's
tokens), the monitors get the step's figures, and the step log line (every ``steps_per_print``)
the figures since the last line. Evaluation forwards (``module.eval()``) are not counted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain import comm
from zerotrain.log import log_rank0


class MoEStats:
    def __init__(self, layers: list[tuple[str, nn.Module]], group) -> None:
        self.names = [name for name, _ in layers]
        self.layers = [layer for _, layer in layers]
        self.group = group
        # per layer: [count of expert 0..E-1, dropped routes, sum of l_aux, forwards]
        self._step: list[torch.Tensor | None] = [None] * len(layers)
        self._window: list[torch.Tensor | None] = [None] * len(layers)
        self._hooks = [layer.register_forward_hook(self._recorder(i)) for i, (_, layer) in enumerate(layers)]

    @classmethod
    def attach(cls, module: nn.Module, group) -> MoEStats | None:
        from zerotrain.experts.layer import MOELayer

        layers = [(name, m) for name, m in module.named_modules() if isinstance(m, MOELayer)]
        return cls(layers, group) if layers else None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _recorder(self, index: int) -> Callable:
        def record(layer, inputs, output) -> None:
            if not layer.training or layer.exp_counts is None:
                return
            counts = layer.exp_counts.detach().to(torch.float64)
            capacity = getattr(layer, "capacity", None)
            dropped = (counts - capacity).clamp(min=0).sum() if capacity is not None else counts.new_zeros(())
            # Kept where the gate computed it: no host sync per layer per forward, and the step's
            # one all-reduce runs on the collective backend's device (NCCL takes no CPU tensor).
            figures = torch.cat(
                [counts, dropped.view(1), layer.l_aux.detach().to(torch.float64).view(1), counts.new_ones(1)]
            )
            self._step[index] = figures if self._step[index] is None else self._step[index] + figures

        return record

    def _reduced(self, sums: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The sums over the data group (one all-reduce; a layer no forward reached counts zeros)."""
        sizes = [int(layer.gate.wg.out_features) + 3 for layer in self.layers]
        device = self.layers[0].gate.wg.weight.device
        flat = torch.cat(
            [s if s is not None else torch.zeros(n, dtype=torch.float64, device=device) for s, n in zip(sums, sizes)]
        )
        if comm.get_world_size(self.group) > 1:  # group None: the whole world
            comm.all_reduce(flat, group=self.group)
        parts = list(flat.cpu().split(sizes))
        return [p if p[-1] > 0 else None for p in parts]

    @staticmethod
    def figures(sums: torch.Tensor) -> dict:
        counts, dropped, l_aux, forwards = sums[:-3], float(sums[-3]), float(sums[-2]), float(sums[-1])
        routes = float(counts.sum())
        return {
            "counts": [int(c) for c in counts.tolist()],
            "drop_rate": dropped / routes if routes else 0.0,
            "l_aux": l_aux / forwards,
        }

    def step_done(self, engine, print_now: bool) -> None:
        """Called on every rank after each optimizer step (collective when it reports)."""
        step, self._step = self._step, [None] * len(self._step)
        self._window = [s if w is None else (w if s is None else w + s) for w, s in zip(self._window, step)]
        if engine.monitor.enabled:
            events = []
            for name, sums in zip(self.names, self._reduced(step)):
                if sums is None:
                    continue
                figures = self.figures(sums)
                tag = f"Train/Samples/moe/{name}"
                events.append((f"{tag}/l_aux", figures["l_aux"], engine.global_samples))
                events.append((f"{tag}/drop_rate", figures["drop_rate"], engine.global_samples))
                events.extend(
                    (f"{tag}/expert_{e}_count", float(c), engine.global_samples)
                    for e, c in enumerate(figures["counts"])
                )
            engine.monitor.write_events(events)
        if print_now:
            window, self._window = self._reduced(self._window), [None] * len(self._window)
            parts = []
            for name, sums in zip(self.names, window):
                if sums is not None:
                    f = self.figures(sums)
                    parts.append(
                        f"{name}: counts={f['counts']}, dropped={100 * f['drop_rate']:.2f}%, l_aux={f['l_aux']:.4f}"
                    )
            if parts:
                log_rank0("moe | " + " | ".join(parts), topology=engine.topology)
