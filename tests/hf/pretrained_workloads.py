"""ZeRO-3 ``from_pretrained`` workloads for tests/hf/test_pretrained.py (module level for run_on_ranks).

A GPT-2 of ~26M parameters (103 MB in fp32, 8 layers of 12.6 MB) from config, random init,
written by ``save_pretrained``; on each rank it is loaded with the config created before
``from_pretrained`` and the process's anonymous resident memory (RssAnon, sampled every
millisecond by a thread) is recorded while it loads.
"""

from __future__ import annotations

import threading
import time

import torch

BIG = dict(vocab_size=1024, n_positions=64, n_embd=512, n_layer=8, n_head=8)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3},
}


def make_model(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**BIG))


def save_random_model(path: str) -> int:
    """Write a random-init model with ``save_pretrained``; return its size in bytes."""
    model = make_model()
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakRss:
    """Highest RssAnon above the value at entry, sampled every millisecond while active."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        self.rise = self.peak - self.base
        return False


def load_on_ranks(path: str, route: str) -> dict:
    """On each rank: ``from_pretrained`` with the ZeRO-3 config registered first, by ``route``:

    - "switch": ``use_zerotrain_as_deepspeed()`` then transformers' own ``HfDeepSpeedConfig``;
    - "hfzero": transformers imported first, no switch, ``zerotrain.hf.HfZeroConfig``;
    - "plain": no config (the whole model on every rank), for comparison.

    Returns the load's RssAnon rise, the loaded parameters' local sizes, the keys whose gathered
    values differ from the saved file (rank 0), and the first training step's loss.
    """
    import safetensors.torch
    import torch.distributed as dist

    import zerotrain
    import zerotrain.hf

    if route == "switch":
        zerotrain.hf.use_zerotrain_as_deepspeed()
    from transformers import GPT2LMHeadModel

    zerotrain.init_distributed()
    if route == "switch":
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(DS_CONFIG)
    elif route == "hfzero":
        keep = zerotrain.hf.HfZeroConfig(DS_CONFIG)
    else:
        keep = None
    with PeakRss() as memory:
        model = GPT2LMHeadModel.from_pretrained(path)
    result = {
        "rise": memory.rise,
        "local_numel": sum(p.numel() for p in model.parameters()),
        "route": route,
        "kept": type(keep).__name__,
    }
    saved = safetensors.torch.load_file(f"{path}/model.safetensors")
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        if dist.get_rank() == 0:
            state = model.state_dict()
            result["mismatched"] = [k for k, v in saved.items() if not torch.equal(state[k], v)]
            result["checked"] = len(saved)
    # The engine takes the partitioned model over; its first loss is the saved model's.
    ids = torch.arange(16).reshape(1, 16) % BIG["vocab_size"]
    if route != "plain":
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        result["loss"] = loss.item()
    return result


def reference_loss() -> float:
    model = make_model().eval()  # from_pretrained returns the model in eval mode (no dropout)
    ids = torch.arange(16).reshape(1, 16) % BIG["vocab_size"]
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()
