"""Issue 31: stage 0's activation memory under 1F1B measured against GPipe's (P=2, M=8).

What a stage keeps for its backward is what autograd saves during its forward. Around torch's
``PipelineStage.forward_one_chunk`` (an instance attribute, the class untouched) a
``torch.autograd.graph.saved_tensors_hooks`` pair wraps every saved tensor in a small holder that
counts its storage's bytes (once per storage) for the micro-batch being forwarded while it lives;
the holder dies when
autograd frees the graph (after the micro-batch's backward). Parameters (and views of them) are
left out: they are not activations. The peak number of micro-batches with saved activations,
and the peak bytes, over the second batch (the first includes torch's shape inference):

- 1F1B: stage 0 holds at most P = 2 micro-batches' activations (it runs P forwards before its
  first backward), the last stage 1; GPipe: every stage holds all M = 8.
- The bytes are exactly that count times one micro-batch's activations (the same on every
  micro-batch), and 1F1B trains to the same weights as GPipe (the meter changes nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

WIDTH, LAYERS, MICRO, M, P = 32, 4, 16, 8, 2


class ActivationMeter:
    """Live saved-tensor bytes per micro-batch on one stage, and their peaks."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, int] = {}  # micro-batch -> live saved bytes
        self._storages: dict[tuple[int, int], tuple[int, int]] = {}  # (mb, storage) -> (holders, bytes)
        self.per_micro: dict[int, int] = {}  # micro-batch -> bytes saved by its forward
        self.peak_micro_batches = 0
        self.peak_bytes = 0

    def reset(self) -> None:
        self.per_micro, self.peak_micro_batches, self.peak_bytes = {}, 0, 0

    def wrap(self, stage) -> None:
        forward = stage.forward_one_chunk

        def measured(fwd_chunk_id, *args, **kwargs):
            meter = self

            class Held:
                def __init__(self, tensor):
                    self.tensor, self.mb = tensor, fwd_chunk_id
                    self.storage = tensor.untyped_storage().data_ptr()
                    meter._hold(self.mb, self.storage, tensor.untyped_storage().nbytes(), +1)

                def __del__(self):
                    meter._hold(self.mb, self.storage, 0, -1)

            def pack(tensor):
                if tensor.untyped_storage().data_ptr() in self.params:
                    return tensor  # a parameter (or a view of one): not an activation
                return Held(tensor)

            def unpack(held):
                return held.tensor if isinstance(held, Held) else held

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return forward(fwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = measured

    def _hold(self, mb: int, storage: int, nbytes: int, step: int) -> None:
        """A storage's bytes count once however many saved tensors share it (a layer's output
        saved by itself and as the next layer's input)."""
        count, size = self._storages.get((mb, storage), (0, nbytes))
        count += step
        if count:
            self._storages[(mb, storage)] = (count, size)
        else:
            del self._storages[(mb, storage)]
        if step > 0 and count == 1:
            self._add(mb, size)
        elif count == 0:
            self._add(mb, -size)

    def _add(self, mb: int, nbytes: int) -> None:
        self.live[mb] = self.live.get(mb, 0) + nbytes
        if nbytes > 0:
            self.per_micro[mb] = self.per_micro.get(mb, 0) + nbytes
        if self.live[mb] == 0:
            del self.live[mb]
        self.peak_micro_batches = max(self.peak_micro_batches, len(self.live))
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))


def _run(schedule: str) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = PipelineModule(layers, num_stages=P, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "train_batch_size": MICRO * M,
        "steps_per_print": 100,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    meter = ActivationMeter(engine.module.parameters())
    meter.wrap(engine._runner.stage)
    g = torch.Generator().manual_seed(1)
    for _step in range(2):
        data = [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)) for _ in range(M)]
        meter.reset()  # the second batch counts (the first includes torch's shape inference)
        engine.train_batch(iter(data))
    out = {
        "stage": engine.stage_id,
        "peak_micro_batches": meter.peak_micro_batches,
        "peak_bytes": meter.peak_bytes,
        "per_micro": dict(meter.per_micro),
        "live_after": dict(meter.live),
        "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
    }
    engine.destroy()
    return out


def _ranks() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    return {schedule: _run(schedule) for schedule in ("1f1b", "gpipe")}


def test_activation_memory_1f1b_vs_gpipe():
    results = run_on_ranks(_ranks, world_size=P, timeout=600)
    lines = []
    for res in results:
        stage = res["1f1b"]["stage"]
        for schedule, expected in (("1f1b", min(M, P - stage)), ("gpipe", M)):
            r = res[schedule]
            assert sorted(r["per_micro"]) == list(range(M)), r["per_micro"]
            one = r["per_micro"][0]
            assert one > 0 and set(r["per_micro"].values()) == {one}  # the same on every micro-batch
            assert r["live_after"] == {}  # every micro-batch's activations freed by its backward
            assert r["peak_micro_batches"] == expected, (schedule, stage, r["peak_micro_batches"])
            assert r["peak_bytes"] == expected * one, (schedule, stage, r["peak_bytes"], one)
            lines.append(
                f"stage {stage} {schedule}: peak {r['peak_micro_batches']} micro-batches, "
                f"{r['peak_bytes']} bytes ({one} per micro-batch)"
            )
        for name, value in res["gpipe"]["weights"].items():
            torch.testing.assert_close(res["1f1b"]["weights"][name], value, rtol=1e-6, atol=1e-7)
    print("\n".join(lines))
