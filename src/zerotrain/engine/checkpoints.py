"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` (DeepSpeed's signatures).

A mixin of ``ZeroTrainEngine``; the format and the work live in ``zerotrain.checkpoint``.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from zerotrain.checkpoint.format import CheckpointError, CheckpointReader, resolve_tag
from zerotrain.checkpoint.layout import data_rank
from zerotrain.checkpoint.load import load_into
from zerotrain.checkpoint.pipeline import FileNames
from zerotrain.checkpoint.save import PendingSave, RankSnapshot, capture, check_tag, prepare
from zerotrain.checkpoint.stateful import Stateful
from zerotrain.engine.components import engine_components

if TYPE_CHECKING:
    from zerotrain.config.schema import ZeroTrainConfig
    from zerotrain.engine.step_core import StepCore
    from zerotrain.topology import Topology
    from zerotrain.zero.interface import StageInterface


class EngineCheckpointing:
    """Sharded checkpoints that resume exactly and reload on any world size and stage."""

    _checkpoint_thread: threading.Thread | None = None
    _checkpoint_pending: PendingSave | None = None
    _checkpoint_error: BaseException | None = None

    # What this mixin reads of ZeroTrainEngine (set in its __init__; annotations only).
    _config: ZeroTrainConfig
    _core: StepCore
    _zero: StageInterface
    topology: Topology
    global_steps: int

    def checkpoint_components(self) -> dict[str, Stateful]:
        """The engine's checkpointed components, ``{checkpoint key: Stateful}`` (counters, loss
        scaler, LR scheduler, dataloader position, PLD: ``engine/components.py``). A save stores
        each one's ``state_dict()``, a load hands each its saved state."""
        return engine_components(self)

    def checkpoint_layout(self) -> FileNames:
        """Where this rank's checkpoint files go (``zerotrain.checkpoint.pipeline``): zerotrain's
        data-parallel layout; a pipeline engine declares DeepSpeed's per-stage one."""
        return FileNames()

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool = False,
    ) -> bool:
        """Save the full training state under ``save_dir/<tag>`` (every rank of the engine's
        data-parallel group must call this, every rank of every stage for a pipeline engine;
        ranks outside it take no part).

        ``tag`` defaults to ``global_step<N>``. ``client_state`` (a dict of numbers, strings,
        containers, tensors, numpy values, enums, namedtuples) comes back from
        ``load_checkpoint`` equal and of the same types; a value that would not raises
        ``TypeError`` naming its key path (docs/checkpoint.md). ``save_latest`` points
        ``save_dir/latest`` at this tag once every rank has written its files.
        ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.
        With ``async_save`` the state is copied to host memory and written by a background
        thread while training goes on; the next save or load (or ``wait_for_checkpoint()``)
        waits for it, and ``latest`` moves when it is complete. Returns True."""
        self.wait_for_checkpoint()
        # A pipeline engine names each stage's files by its stage (DeepSpeed's layout); model
        # (tensor-parallel) ranks would still write the same file names.
        pipeline = self.checkpoint_layout().pipeline
        if self.topology.size("model") > 1 or (self.topology.distinct_size > 1 and not pipeline):
            raise NotImplementedError(
                f"save_checkpoint on a {self.topology.describe()} topology is not supported "
                "yet; save each model rank's engine.module_state_dict() yourself"
            )
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        group = self._checkpoint_group()
        check_tag(tag, self._config.checkpoint.tag_validation, group)
        meta = prepare(self, save_dir, tag, exclude_frozen_parameters, group)
        try:
            snap = capture(self, client_state, exclude_frozen_parameters)
            if async_save:
                snap = snap.detached()
        except TypeError as refused:  # a value that would not load back as saved
            self._abandon_save(save_dir, tag, meta, group, refused)
        pending = PendingSave(self, save_dir, tag, snap, meta, save_latest, group)
        if not async_save:
            pending.write()
            pending.finish()
            return True
        self._checkpoint_pending = pending
        self._checkpoint_thread = threading.Thread(
            target=self._write_in_background, args=(pending,), name=f"zerotrain-checkpoint-{tag}", daemon=True
        )
        self._checkpoint_thread.start()
        return True

    def _abandon_save(self, save_dir, tag: str, meta, group, refused: TypeError):
        """This rank refuses its state: every rank hears it in the agreement that would have
        committed the save (each raises, the partial folder goes); this rank raises ``refused``
        (one line naming the key path), the others a ``CheckpointError`` quoting it."""
        pending = PendingSave(self, save_dir, tag, RankSnapshot(data_rank(self)), meta, False, group)
        pending.error = str(refused)
        try:
            pending.finish()
        except CheckpointError:
            pass
        raise refused from None

    def _write_in_background(self, pending: PendingSave) -> None:
        try:
            pending.write()
            pending.finish()
        except BaseException as error:  # noqa: BLE001 - re-raised by wait_for_checkpoint
            self._checkpoint_error = error

    def wait_for_checkpoint(self) -> float:
        """Wait until an asynchronous save has been written and committed (every rank);
        re-raises its error. Returns the seconds waited."""
        thread = self._checkpoint_thread
        if thread is None:
            return 0.0
        start = time.perf_counter()
        thread.join()
        self._checkpoint_thread = self._checkpoint_pending = None
        error, self._checkpoint_error = self._checkpoint_error, None
        if error is not None:
            raise error
        return time.perf_counter() - start

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """Restore the state saved by ``save_checkpoint`` (``tag``, else ``load_dir/latest``).

        Works on any world size and ZeRO stage, fp32 or 16-bit: parameters, fp32 masters and
        optimizer state are re-partitioned by parameter name. Returns ``(path, client_state)``.
        A missing or damaged ``latest``, a missing file or a checksum mismatch raises
        ``CheckpointError`` naming the file (never a silent fresh start). With
        ``load_module_strict=False`` the parameters that match are loaded and the rest listed
        in a warning. ``load_module_only`` loads weights (and their fp32 masters) only."""
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported: zerotrain checkpoints are "
                "loaded by parameter name; load the module yourself afterwards instead"
            )
        self.wait_for_checkpoint()
        folder, tag = resolve_tag(load_dir, tag)
        reader = CheckpointReader(folder)
        try:
            client_state = load_into(
                self,
                reader,
                strict=load_module_strict,
                load_optimizer=load_optimizer_states,
                load_scheduler=load_lr_scheduler_states,
                module_only=load_module_only,
                from_fp32=self._config.zero_optimization.load_from_fp32_weights,
            )
        finally:
            reader.close()
        self._zero.zero_grad()
        self._core.restart_log_window()
        return str(folder), client_state

    def _checkpoint_group(self):
        """A gloo group of its own over the ranks of this engine's data-parallel group, for the
        checkpoint's agreement (object collectives on the host, safe from a background thread
        while training uses the data group); None for a group of one rank. Created by the
        group's ranks alone (torch's ``use_local_synchronization``): an engine on part of the
        job never waits for ranks outside its group."""
        topology = self.topology
        if self.checkpoint_layout().pipeline:  # every stage's files go into one folder
            if not dist.is_initialized() or topology.world_size == 1:
                return None
            if not topology.is_world:
                raise NotImplementedError(
                    "save_checkpoint of a pipeline engine on part of the job's ranks "
                    "is not supported: build the PipelineModule over the whole world"
                )
            return topology.agreement_group(topology.members, dist.group.WORLD)
        if not dist.is_initialized() or topology.data_size == 1:
            return None
        return topology.agreement_group(topology.axis_ranks("data"), topology.data_group)


__all__ = ["EngineCheckpointing", "CheckpointError"]
