"""ZeRO-3 `from_pretrained` of a local folder partitions the weights while loading.

`zerotrain.hf.HfZeroConfig(ds_config)` created before `from_pretrained` (transformers imported
first, no switch, no deepspeed package) on 2 gloo ranks, loading a ~26M-parameter GPT-2
(98 MiB fp32) written by `save_pretrained` from a random-init model:

- every parameter is a partitioned placeholder after loading (0 local elements), and gathered
  they equal the saved file exactly;
- the engine takes the partitioned model over and its first loss is the saved model's (rel 1e-5);
- memory: the rise of the process's anonymous resident memory (RssAnon, sampled every ms)
  during `from_pretrained` stays below 0.75x the model size on every rank. Each rank keeps its
  half (0.5x) plus about one module gathered at a time; measured 0.63x. Holding the whole model
  on a rank, or keeping each gathered module's freed memory in the heap (measured 1.04x before
  GatheredParameters handed it back), exceeds the bound. (RssAnon, not RSS: the checkpoint is
  memory-mapped on rank 0, file-backed pages that are not the model's.)

transformers' own `HfDeepSpeedConfig` under the switch is tested in tests/hf/test_trainer.py's group.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.hf.pretrained_workloads import load_on_ranks, reference_loss, save_random_model  # noqa: E402
from zerotrain.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_hfzeroconfig_from_pretrained_partitions_while_loading(tmp_path):
    size = save_random_model(str(tmp_path / "model"))
    ranks = run_on_ranks(load_on_ranks, world_size=2, args=(str(tmp_path / "model"), "hfzero"), timeout=400)
    assert ranks[0]["kept"] == "HfZeroConfig"
    assert ranks[0]["checked"] > 0 and ranks[0]["mismatched"] == []
    want = reference_loss()
    for rank, result in enumerate(ranks):
        assert result["local_numel"] == 0, rank
        assert result["rise"] < 0.75 * size, f"rank {rank}: RssAnon rose {result['rise'] / size:.2f}x the model"
        assert result["loss"] == pytest.approx(want, rel=1e-5)
