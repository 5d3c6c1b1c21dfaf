"""``DummyOptim`` / ``DummyScheduler``: stand-ins that let the config build the real ones.

accelerate's convention (its ``DummyOptim``/``DummyScheduler``), for
``zerotrain.initialize`` without accelerate: the script keeps its shape, the config's
``optimizer``/``scheduler`` sections say what to build, and the values given to the stand-ins
fill that section's ``"auto"`` values::

    optimizer = zerotrain.DummyOptim(param_groups, lr=3e-4, weight_decay=0.01)
    scheduler = zerotrain.DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    engine, optimizer, _, scheduler = zerotrain.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config="ds_config.json")
    # optimizer / scheduler are now the real ones, built from the config's sections.

:func:`resolve_placeholders` (called by ``initialize``) does the filling; the rules are in its
docstring and docs/hf.md.
"""

from __future__ import annotations

import inspect
from typing import Any

from zerotrain.config.errors import ConfigError


class DummyOptim:
    """Stands for the optimizer of the config's ``optimizer`` section.

    ``params`` (tensors, ``(name, tensor)`` pairs or param-group dicts) become the optimizer's
    parameters. ``lr``, ``weight_decay`` and any other keyword (``betas=...``, ``eps=...``) fill
    ``optimizer.params.<key>`` where the config says ``"auto"``; see :func:`resolve_placeholders`.
    Defaults as in accelerate: ``lr=0.001``, ``weight_decay=0``.
    """

    def __init__(self, params, lr: float | None = None, weight_decay: float | None = None, **kwargs):
        self.params = list(params)  # a generator (model.parameters()) can be read only once
        # What the caller wrote, as opposed to a default: only these can contradict the config.
        self.explicit = set(kwargs) | {
            name for name, value in (("lr", lr), ("weight_decay", weight_decay)) if value is not None
        }
        self.lr = 0.001 if lr is None else lr
        self.weight_decay = 0.0 if weight_decay is None else weight_decay
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"DummyOptim(lr={self.lr}, weight_decay={self.weight_decay}, {self.kwargs})"


class DummyScheduler:
    """Stands for the scheduler of the config's ``scheduler`` section.

    ``total_num_steps`` and ``warmup_num_steps`` (counted in optimizer steps) and any other
    keyword fill ``scheduler.params.<key>`` where the config says ``"auto"``; so do
    ``warmup_min_lr = 0`` and ``warmup_max_lr =`` the optimizer's lr. ``lr_scheduler_callable``
    (``fn(optimizer) -> scheduler``) builds the scheduler instead when the config has no
    ``scheduler`` section.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int | None = None,
        warmup_num_steps: int | None = None,
        lr_scheduler_callable=None,
        **kwargs,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps  # None: not given (fills "auto" with 1)
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return (
            f"DummyScheduler(total_num_steps={self.total_num_steps}, "
            f"warmup_num_steps={self.warmup_num_steps}, {self.kwargs})"
        )


def is_placeholder(obj) -> bool:
    """True for a zerotrain ``DummyOptim`` or ``DummyScheduler``."""
    return isinstance(obj, (DummyOptim, DummyScheduler))


def resolve_placeholders(config: dict[str, Any], optimizer, lr_scheduler, model_parameters):
    """Fill ``config`` from the stand-ins; return ``(config, optimizer, lr_scheduler, params)``.

    The returned ``optimizer``/``lr_scheduler`` are what ``initialize`` should build from: None
    where the config's section is to be used, else the user's object (a real optimizer, or a
    ``DummyScheduler``'s ``lr_scheduler_callable``). ``params`` replaces ``model_parameters``.

    Rules (one ``ConfigError`` lists every problem):

    - ``DummyOptim`` needs an ``optimizer`` section; ``DummyScheduler`` a ``scheduler`` section
      or an ``lr_scheduler_callable`` (not both).
    - A value fills ``<section>.params.<key>`` when that is ``"auto"``. A value the caller gave
      explicitly and the config sets to something else is a mismatch naming both. A given value
      whose key the section lacks is added when the built class takes that parameter (so
      ``DummyOptim(params, lr=3e-4)`` with ``"params": {}`` trains at 3e-4); scheduler values
      the configured schedule has no parameter for are not used when they are
      ``total_num_steps``/``warmup_num_steps`` (``WarmupLR`` has no end; a torch schedule no
      warmup) and an error for any other keyword.
    - ``warmup_num_steps`` is at least 1 (DeepSpeed >= 0.19.6 rejects 0; accelerate and
      transformers clamp the same way); ``warmup_min_lr`` fills with 0 and ``warmup_max_lr`` with
      the optimizer's lr (after filling). Unlike accelerate, ``total_num_steps`` is not divided
      by the number of processes: the engine steps the schedule once per optimizer step.
    """
    from zerotrain.optim.factory import _scheduler_class

    problems: list[str] = []
    params = model_parameters
    optimizer_out, scheduler_out = optimizer, lr_scheduler

    if isinstance(optimizer, DummyOptim):
        optimizer_out = None
        if model_parameters is not None:
            problems.append(
                "pass the parameters once: to DummyOptim(params, ...) or as initialize(model_parameters=...), not both"
            )
        params = optimizer.params
        section = config.get("optimizer")
        if not isinstance(section, dict):
            problems.append(
                "optimizer=DummyOptim(...) needs an 'optimizer' section in the config "
                "(its type and params are what gets built); add one, or pass a real "
                "torch optimizer"
            )
        else:
            values = {"lr": optimizer.lr, "weight_decay": optimizer.weight_decay, **optimizer.kwargs}
            problems += _fill_section(
                section, "optimizer", values, optimizer.explicit, accepts=None, source="DummyOptim"
            )

    if isinstance(lr_scheduler, DummyScheduler):
        scheduler_out = None
        section = config.get("scheduler")
        callable_ = lr_scheduler.lr_scheduler_callable
        if lr_scheduler.optimizer is not optimizer:
            problems.append(
                "DummyScheduler(optimizer, ...) must be given the optimizer passed to initialize(optimizer=...)"
            )
        if callable_ is not None and section is not None:
            problems.append(
                "DummyScheduler(lr_scheduler_callable=...) and a 'scheduler' config section "
                "both say how to build the scheduler; remove one"
            )
        elif callable_ is not None:
            scheduler_out = callable_
        elif not isinstance(section, dict):
            problems.append(
                "lr_scheduler=DummyScheduler(...) needs a 'scheduler' section in the config "
                "or DummyScheduler(lr_scheduler_callable=fn); add one"
            )
        else:
            try:
                cls = _scheduler_class(section.get("type"))
                accepts = set(list(inspect.signature(cls.__init__).parameters)[2:])
            except ValueError as error:  # unknown type: building it reports that
                problems.append(str(error))
                accepts = set()
            given = dict(lr_scheduler.kwargs)
            problems += [
                f"DummyScheduler({key}=...): scheduler {section.get('type')} has no parameter {key!r}"
                for key in given
                if accepts and key not in accepts
            ]
            for key in ("total_num_steps", "warmup_num_steps"):
                if getattr(lr_scheduler, key) is not None:
                    given[key] = getattr(lr_scheduler, key)
            if "warmup_num_steps" in given:
                given["warmup_num_steps"] = max(1, int(given["warmup_num_steps"]))
            lr = _optimizer_lr(config, optimizer)
            defaults = {"warmup_num_steps": 1, "warmup_min_lr": 0, **({} if lr is None else {"warmup_max_lr": lr})}
            explicit = set(given)
            if isinstance(optimizer, DummyOptim) and "lr" in optimizer.explicit:
                explicit.add("warmup_max_lr")  # the peak lr was given (transformers checks it too)
            problems += _fill_section(
                section,
                "scheduler",
                {**defaults, **given},
                explicit,
                accepts=accepts,
                source="DummyScheduler",
                labels={"warmup_max_lr": "DummyOptim(lr={value})"},
            )
    if problems:
        raise ConfigError(
            "DummyOptim/DummyScheduler and the config disagree:\n" + "\n".join(f"- {p}" for p in problems), problems
        )
    return config, optimizer_out, scheduler_out, params


def _fill_section(
    section: dict, name: str, values: dict, explicit: set, accepts, source: str, labels: dict | None = None
) -> list[str]:
    """Fill ``section['params']`` from ``values`` (``explicit``: the keys the caller gave, which
    are also added when absent and ``accepts`` allows); return mismatch lines."""
    from zerotrain.config.auto import AUTO, _same, _show

    params = section.setdefault("params", {})
    if not isinstance(params, dict):
        return [f"{name}.params must be a dict, got {type(params).__name__}"]
    problems = []
    for key, value in values.items():
        if key not in params:
            if key in explicit and (accepts is None or key in accepts):
                params[key] = value
            continue
        current = params[key]
        if current == AUTO:
            params[key] = value
        elif key in explicit and not _same(current, value):
            given = (labels or {}).get(key, f"{source}({key}={{value}})").format(value=_show(value))
            problems.append(
                f"config {name}.params.{key}={_show(current)} vs {given}; "
                f'set the config value to "auto" to take it from {source}, or make both agree'
            )
    return problems


def _optimizer_lr(config: dict, optimizer) -> float | None:
    """The lr the built optimizer will start from: the filled config's, else the object's."""
    if isinstance(optimizer, DummyOptim) and "lr" in optimizer.explicit:
        return optimizer.lr
    section = config.get("optimizer")
    if isinstance(section, dict) and isinstance(section.get("params"), dict):
        lr = section["params"].get("lr")
        if lr is not None and lr != "auto":
            return lr
    if isinstance(optimizer, DummyOptim):
        return optimizer.lr
    defaults = getattr(optimizer, "defaults", None)
    return defaults.get("lr") if isinstance(defaults, dict) else None
