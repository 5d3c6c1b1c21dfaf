"""Until expert parallelism lands, a parameter carrying DeepSpeed's expert markers
(``allreduce = False`` and/or ``group_name``, as ``deepspeed.moe`` sets them) is refused at
initialize, at every stage, with a one-line error naming it (issue 30 item 7)."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

STAGES = (0, 1, 2, 3)
MARKINGS = {"both": {"allreduce": False, "group_name": "ep_size_1"},
            "allreduce": {"allreduce": False}, "group_name": {"group_name": "ep_size_1"}}


def _model(marking: dict | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for key, value in (marking or {}).items():
        setattr(model[2].weight, key, value)
    return model


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _try_stages():
    """Per stage and marking: the error's type and text, or (unmarked) the first step's weights
    against plain SGD."""
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for stage in STAGES:
        for label, marking in MARKINGS.items():
            try:
                zerotrain.initialize(model=_model(marking), config=_config(stage))
            except Exception as error:  # noqa: BLE001 - the test reads which one
                out[(stage, label)] = (type(error).__name__, str(error))
            else:
                out[(stage, label)] = None
        # Unmarked (and allreduce=True, DeepSpeed's dense marking): trains, as plain SGD does.
        model = _model({"allreduce": True})
        engine, _, _, _ = zerotrain.initialize(model=model, config=_config(stage))
        x = torch.arange(8.0).reshape(2, 4) / 8
        engine.backward(engine(x).square().sum())
        engine.step()
        reference = _model(None)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        reference(x).square().sum().backward()
        opt.step()
        state = engine.module_state_dict()
        out[(stage, "unmarked")] = all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
        engine.destroy()
    return out


def test_expert_markers_are_refused_naming_the_parameter():
    (out,) = run_on_ranks(_try_stages, 1)
    for stage in STAGES:
        for label, marking in MARKINGS.items():
            kind, message = out[(stage, label)]
            assert kind == "NotImplementedError", (stage, label, kind, message)
            assert "\n" not in message
            assert message.startswith("parameter '2.weight' carries DeepSpeed's expert markers (")
            for key, value in marking.items():
                assert f"{key}={value!r}" in message, (stage, label, message)
            assert "expert parallelism is not supported yet" in message
        assert out[(stage, "unmarked")] is True, stage
