"""The experts of a DeepSpeed MoE checkpoint (ZeRO 1-2), for ``zerotrain convert-deepspeed``.

DeepSpeed writes a MoE model's dense module to ``mp_rank_00_model_states.pt`` and each expert's
weights (and buffers) to ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` under its global id;
its ZeRO optimizer files hold, besides the dense groups, one flat buffer per expert param group
(``"moe": True``, named ``ep_size_N``) partitioned over the expert-data group. With DeepSpeed's
default layout (expert-parallel groups are contiguous blocks of ranks, expert-data groups stride
by N) data rank r holds expert-parallel rank ``r % N``'s experts, partition ``r // N``, under
*local* names (``deepspeed_experts.<j>``, global id ``ep_rank * num_local + j``).

Each (expert group, expert-parallel rank) becomes one flat unit of the converted checkpoint,
sharded like DeepSpeed's partitions and named by global expert id, its shards in the files of
the data ranks that held them (the unit's ``files``): a zerotrain engine then loads the experts by
name at any ``ep_size`` and world size.
"""

from __future__ import annotations

import math

from zerotrain.checkpoint.experts import EXPERTS_INFIX
from zerotrain.checkpoint.format import CheckpointError, shard_file


class DeepSpeedExperts:
    """The MoE layers (from the expert files) and the expert param groups of a checkpoint."""

    def __init__(self, source, main: dict, config: dict, param_groups: list[dict], world: int):
        self.source = source
        counts = main.get("num_experts")
        if not isinstance(counts, list):
            raise CheckpointError(
                f"{source.model_files[0]}: expert files but no per-layer 'num_experts' list "
                "(DeepSpeed's old MoE layout cannot be converted)"
            )
        if config.get("use_data_before_expert_parallelism"):
            raise CheckpointError(
                f"{source.folder}: use_data_before_expert_parallelism (D+E rank layout) "
                "cannot be converted; only DeepSpeed's default E+D layout can"
            )
        self.layers: list[tuple[str, int]] = []  # (the experts' key prefix, num_experts) by layer id
        for layer, count in enumerate(counts):
            ids = sorted(e for (lay, e) in source.expert_files if lay == layer)
            if ids != list(range(count)):
                raise CheckpointError(
                    f"{source.folder}: MoE layer {layer} has {count} experts but files for "
                    f"experts {ids}: copy every layer_{layer}_expert_*_mp_rank_00_model_states.pt"
                )
            prefix = None
            for key in self.expert_state(layer, 0):
                head, infix, _ = key.partition(EXPERTS_INFIX)
                if infix:
                    prefix = head + infix
            if prefix is None:
                raise CheckpointError(f"{source.expert_files[(layer, 0)]}: no '{EXPERTS_INFIX}' key")
            self.layers.append((prefix, count))
        extra = sorted(lay for lay, _ in source.expert_files if lay >= len(counts))
        if extra:
            raise CheckpointError(
                f"{source.folder}: expert files of layer {extra[0]}, the model-states file "
                f"lists {len(counts)} MoE layers"
            )
        # expert param group index -> its ep_size (DeepSpeed names the groups "ep_size_N")
        self.groups: dict[int, int] = {}
        for g, group in enumerate(param_groups):
            if group.get("moe"):
                name = str(group.get("name", ""))
                if not name.startswith("ep_size_") or not name[8:].isdigit():
                    raise CheckpointError(
                        f"{source.optim_files[0]}: expert param group {g} is named {name!r}, "
                        "not DeepSpeed's 'ep_size_N'"
                    )
                ep = int(name[8:])
                if world % ep:
                    raise CheckpointError(f"{source.optim_files[0]}: ep_size {ep} does not divide the {world} ranks")
                self.groups[g] = ep
        self.world = world

    def expert_state(self, layer: int, expert: int) -> dict:
        from zerotrain.checkpoint.deepspeed_files import safe_load

        path = self.source.expert_files[(layer, expert)]
        state = safe_load(path)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not an expert's state dict")
        return state

    def _layer(self, name: str) -> tuple[int, str, int]:
        for layer, (prefix, count) in enumerate(self.layers):
            if name.startswith(prefix):
                return layer, prefix, count
        raise CheckpointError(
            f"{self.source.optim_files[0]}: expert parameter {name!r} belongs to no MoE layer of the expert files"
        )

    def global_name(self, local: str, ep_rank: int, ep_size: int) -> str:
        layer, prefix, count = self._layer(local)
        number, _, rest = local[len(prefix) :].partition(".")
        return f"{prefix}{ep_rank * (count // ep_size) + int(number)}.{rest}"

    def shard_files(self, ep_rank: int, ep_size: int) -> list[str]:
        """The data ranks' files holding expert-parallel rank ``ep_rank``'s partitions, in order."""
        return [shard_file(ep_rank + k * ep_size) for k in range(self.world // ep_size)]

    def layers_meta(self, ep_of_layer: dict[int, int]) -> dict:
        layers = [
            {
                "id": i,
                "module": prefix[: -len(EXPERTS_INFIX) - 1] if prefix != EXPERTS_INFIX else "",
                "num_experts": count,
                "ep_size": ep_of_layer.get(i, 1),
                "num_local_experts": count // ep_of_layer.get(i, 1),
            }
            for i, (prefix, count) in enumerate(self.layers)
        ]
        return {"layers": layers, "num_experts": [count for _, count in self.layers]}

    def plan_group(self, g, group_shapes: dict, flat, count: int, paddings, units: list, dtype, mixed) -> ByExpertRank:
        """Expert group ``g``: one unit per expert-parallel rank (appended to ``units``),
        partitioned over its expert-data group like DeepSpeed's buffer, its parameters named by
        global expert id, its shards in the files of the data ranks that held them."""
        from zerotrain.checkpoint.deepspeed_params import unit_entry

        ep = self.groups[g]
        if count != self.world // ep:
            raise CheckpointError(
                f"{self.source.optim_files[0]}: expert group {g} (ep_size {ep}) is partitioned "
                f"over {count} ranks, not the {self.world // ep} of its expert-data group"
            )
        out = ByExpertRank()
        for ep_rank in range(ep):
            params, offset = [], 0
            for i, (name, shape) in enumerate(group_shapes.items()):
                numel = math.prod(shape)
                params.append([self.global_name(name, ep_rank, ep), offset, numel, list(shape)])
                offset += numel + (paddings[g][i] if paddings is not None else 0)
            unit = unit_entry(len(units), g, dtype, count, flat.numel(), params, mixed)
            unit["files"] = self.shard_files(ep_rank, ep)
            unit["_local"] = {p[0]: name for p, name in zip(params, group_shapes)}  # for the slice check
            units.append(unit)
            out[ep_rank] = unit
        return out

    def add_module_values(self, layout, units: list, buffer_names: set[str]) -> dict:
        """The experts' buffers and frozen parameters from the expert files into ``layout``, and
        every expert key into the key order (after its layer's gate: the single-process order).
        Returns the metadata's ``"moe"`` section."""
        ep_of_layer = {
            self._layer(name)[0]: self.groups[unit["group"]]
            for unit in units
            if unit.get("_local")
            for name, *_ in unit["params"]
        }
        trained = {name for unit in units for name, *_ in unit["params"]}
        for layer, (prefix, count) in enumerate(self.layers):
            ep = ep_of_layer.get(layer, 1)
            local_count = count // ep
            keys = []
            for expert in range(count):
                for key, value in self.expert_state(layer, expert).items():
                    keys.append(key)
                    if key in trained:
                        continue
                    number, _, rest = key[len(prefix) :].partition(".")
                    local = f"{prefix}{int(number) % local_count}.{rest}"
                    if local in buffer_names:
                        layout.buffers[key] = value
                    else:  # in no optimizer group: frozen
                        layout.frozen[key] = value
            moe = prefix[: -len("experts.deepspeed_experts.")]  # "<path>.deepspeed_moe."
            at = max((i + 1 for i, k in enumerate(layout.keys) if k.startswith(moe)), default=len(layout.keys))
            layout.keys[at:at] = keys
        return self.layers_meta(ep_of_layer)


class ByExpertRank(dict):
    """An expert param group's units, one per expert-parallel rank (``{ep_rank: unit}``)."""


__all__ = ["DeepSpeedExperts", "ByExpertRank"]
