"""What frameworks reach on the optimizer ``initialize`` returns, as on DeepSpeed's ZeRO optimizer.

``engine.optimizer`` is the user's (or the config's) torch optimizer, not a wrapper. Frameworks
written for DeepSpeed call members of its ZeRO optimizer on it, so the engine puts these on the
optimizer object (instance attributes) and ``destroy()`` takes them off again:

- ``offload_states`` / ``reload_states``: the engine's (OpenRLHF calls them on the optimizer);
- ``step()``: ``engine.step()`` when a client calls it (Lightning Fabric's DeepSpeed plugin steps
  the optimizer): at stages 1-3 its parameters are the engine's shards, whose gradients only
  ``engine.step()`` sets, so its own step would change nothing. The engine's own call, inside
  ``engine.step()``, is the optimizer's step;
- ``overflow``: whether the last step was skipped (accelerate's ``step_was_skipped``).

The engine is held weakly: the optimizer keeps no engine alive through these.
"""

from __future__ import annotations

import weakref

from zerotrain.engine.step_core import TrainingState

DELEGATED = ("offload_states", "reload_states")


class OptimizerSurface:
    """The members one engine puts on its optimizer, and what they need to work."""

    def __init__(self, engine, optimizer):
        self._optimizer = optimizer
        self._step_before = None  # an instance-level step found there (an LR scheduler's wrapper)
        if optimizer is None:
            return
        engine_ref = weakref.ref(engine)
        for name in DELEGATED:

            def call(*args, _name=name, **kwargs):
                return getattr(engine_ref(), _name)(*args, **kwargs)

            call.__name__, call.__doc__ = name, getattr(type(engine), name).__doc__
            vars(optimizer)[name] = call
        own_step = optimizer.step
        self._step_before = vars(optimizer).get("step")

        def step(closure=None):
            current = engine_ref()
            if current is None or current.training_state is TrainingState.STEPPING:
                return own_step() if closure is None else own_step(closure)
            if closure is not None:
                raise ValueError(
                    "optimizer.step(closure) on an engine's optimizer: the engine computes the "
                    "gradients; call engine.backward(loss) and then engine.step()"
                )
            current.step()
            return None

        vars(optimizer)["step"] = step
        self.set_overflow(False)

    def set_overflow(self, overflow: bool) -> None:
        if self._optimizer is not None:
            vars(self._optimizer)["overflow"] = overflow

    def remove(self) -> None:
        """Take every member off the optimizer; give back the ``step`` found there."""
        if self._optimizer is None:
            return
        for name in DELEGATED + ("step", "overflow"):
            vars(self._optimizer).pop(name, None)
        if self._step_before is not None:
            vars(self._optimizer)["step"] = self._step_before
