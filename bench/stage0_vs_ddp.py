"""Side-by-side: zerotrain ZeRO stage 0 vs torch DDP, same GPT workload, 2 gloo ranks, one run.

    python bench/stage0_vs_ddp.py [--zerotrain-rev HEAD] [--repeats 5] [--interleave-steps 16]

The foundation issue's benchmark, kept as a shortcut for
`python bench/zero_vs_ddp.py --systems ddp,ddp_fused,zt0 --repeats 5 --interleave-steps 16`
(which see): step time from one launch holding DDP, DDP with AdamW(fused=True) and zerotrain
stage 0 side by side; peak RSS per rank and launch-to-first-step time from alternating own
launches (DDP with `torchrun`, zerotrain with `zerotrain launch`), with ratios to DDP. More
repeats than the full comparison because the start-up goal compares two noisy ~10 s numbers.
Any zero_vs_ddp.py flag passes through and overrides these defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero_vs_ddp import main  # noqa: E402

if __name__ == "__main__":
    main(["--systems", "ddp,ddp_fused,zt0", "--repeats", "5", "--interleave-steps", "16", *sys.argv[1:]])
