"""``offload_states``, ``reload_states`` and ``empty_partition_cache`` (DeepSpeed's names): RL
frameworks move the training state out of device memory while they generate, then back.
The moving itself is zerotrain.zero.offload_states; this mixin is the engine's side of it."""

from __future__ import annotations

import gc
import weakref

from zerotrain.zero.offload_states import OffloadDeviceEnum, StateOffloader

# DeepSpeed's ZeRO optimizer has these too, and RL frameworks call them there (OpenRLHF:
# ``engine.optimizer.offload_states(...)``); the engine puts them on its optimizer.
OPTIMIZER_METHODS = ("offload_states", "reload_states")

class EngineStateOffload:
    """The engine's ``offload_states`` / ``reload_states`` / ``empty_partition_cache``."""

    _state_offloader: StateOffloader | None = None

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the training state named by ``include`` (``OffloadStateTypeEnum`` members;
        None: all of optimizer states, fp32 masters, 16-bit parameters, gradients, staging
        buffers) off the device to host memory until ``reload_states()``; at stage 3 the
        gathered parameters are released first. No communication. A forward while parameters
        are offloaded, and a backward or step while anything is, raise."""
        if self._state_offloader is None:
            self._state_offloader = StateOffloader(self.accelerator, self.device)
        self._plain_backward.settle()
        self._zero.empty_partition_cache()  # gathered buffers are a cache: not kept, not moved
        tensors = self._zero.state_tensors(self.module, self.optimizer)
        self._state_offloader.offload(tensors, include, device, pin_memory, non_blocking)
        gc.collect()
        self.accelerator.empty_cache()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back everything ``offload_states`` moved, byte for byte."""
        if self._state_offloader is not None:
            self._state_offloader.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        """Release the parameters stage 3 keeps gathered beyond their use (the unit kept from
        forward into backward, prefetched units, the gather buffer pool) and return the memory
        to the device (or, on the CPU, to the OS). A no-op below stage 3."""
        self._zero.empty_partition_cache()
        gc.collect()
        self.accelerator.empty_cache()

    def _expose_on_optimizer(self) -> None:
        """``engine.optimizer.offload_states`` / ``reload_states``: the engine's, held weakly
        (the optimizer outlives no engine through them), and ``step``; removed by ``destroy()``."""
        if self.optimizer is None:
            return
        engine = weakref.ref(self)
        for name in OPTIMIZER_METHODS:
            def call(*args, _name=name, **kwargs):
                return getattr(engine(), _name)(*args, **kwargs)
            call.__name__ = name
            call.__doc__ = getattr(type(self), name).__doc__
            vars(self.optimizer)[name] = call

        # optimizer.step() called by anyone but the engine (Lightning Fabric's DeepSpeed plugin
        # steps the optimizer initialize returns) is engine.step(): at stages 1-3 the
        # optimizer's parameters are the engine's shards, whose gradients only engine.step()
        # sets, so the optimizer's own step would change nothing.
        own_step = self.optimizer.step
        self._optimizer_step_before = vars(self.optimizer).get("step")  # an LR scheduler's wrapper

        def step(closure=None):
            current = engine()
            if current is None or current._stepping_optimizer:
                return own_step() if closure is None else own_step(closure)
            if closure is not None:
                raise ValueError("optimizer.step(closure) on an engine's optimizer: the engine computes the "
                                 "gradients; call engine.backward(loss) and then engine.step()")
            current.step()
            return None

        vars(self.optimizer)["step"] = step

    _stepping_optimizer = False  # the engine's own optimizer.step() is running

    _optimizer_step_before = None

    def _remove_from_optimizer(self) -> None:
        if self.optimizer is not None:
            for name in OPTIMIZER_METHODS + ("step",):
                vars(self.optimizer).pop(name, None)
            if self._optimizer_step_before is not None:
                vars(self.optimizer)["step"] = self._optimizer_step_before

    def _require_states(self, action: str, forward: bool = False) -> None:
        """Refuse ``action`` while state it reads is offloaded: a forward, the parameters'
        storage (with the masters where stage 3 derives the 16-bit shards from them, and the
        shards in fp32, which are the parameters' buffers); anything else, any state."""
        offloader = self._state_offloader
        if offloader is None or not offloader.offloaded:
            return
        if forward:
            params = self._zero.state_tensors(self.module, self.optimizer)["lp_params"]
            if not offloader.holds_any(params):
                return
        raise RuntimeError(f"{action} while {', '.join(sorted(offloader.offloaded))} are offloaded: "
                           "call engine.reload_states() first")

    def _offloaded_nbytes(self) -> int:
        """Bytes of offloaded training state held in host buffers."""
        return 0 if self._state_offloader is None else self._state_offloader.host_nbytes
