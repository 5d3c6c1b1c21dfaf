"""Side-by-side: zerotrain ZeRO stage 0 vs torch DDP, same GPT workload, 2 gloo ranks, one run.

    python bench/stage0_vs_ddp.py [--repeats 3] [--steps 10] [--preset gpt17m]

The foundation issue's benchmark, kept as a shortcut for
`python bench/zero_vs_ddp.py --systems ddp,zt0` (which see: DDP launched with `torchrun`,
zerotrain with `zerotrain launch`, alternating; median step time, peak RSS per rank,
launch-to-first-step time, with zerotrain/DDP ratios). Any other zero_vs_ddp.py flag passes
through.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero_vs_ddp import main  # noqa: E402

if __name__ == "__main__":
    main(["--systems", "ddp,zt0", *sys.argv[1:]])
