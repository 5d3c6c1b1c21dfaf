"""The README's sbatch example, run as written inside a stand-in Slurm allocation: ``scontrol``
lists two "nodes" of this machine and ``srun`` starts its tasks here with the variables Slurm
gives them (SLURM_NODEID, SLURM_STEP_NUM_NODES, SLURMD_NODENAME, SLURM_PROCID). What is checked
is everything zerotrain does: the srun command, each node's agent, the ranks' environment and
arguments. Slurm's own scheduling is not (no slurmctld here)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from tests.launcher.test_launcher_run import free_port

README = Path(__file__).resolve().parents[2] / "README.md"

FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames NODELIST
printf '127.0.0.1\\n127.0.0.2\\n'
"""

# srun --nodes N --ntasks N --ntasks-per-node 1 [--nodelist H] --kill-on-bad-exit=1 COMMAND...
FAKE_SRUN = f"""#!{sys.executable}
import json, os, subprocess, sys
args = sys.argv[1:]
with open("srun_argv.json", "w") as f:
    json.dump(args, f)
nodes = int(args[args.index("--nodes") + 1])
command = args[args.index("--kill-on-bad-exit=1") + 1:]
hosts = ["127.0.0.1", "127.0.0.2"]
tasks = [subprocess.Popen(command, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                         "SLURM_STEP_NUM_NODES": str(nodes), "SLURMD_NODENAME": hosts[i]}})
         for i in range(nodes)]
codes = [task.wait() for task in tasks]
sys.exit(next((code for code in codes if code), 0))
"""

RECORD_SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "MASTER_ADDR"]
record = {k: os.environ.get(k) for k in keys}
record["argv"] = sys.argv[1:]
with open(f"rank{record['RANK']}.json", "w") as f:
    json.dump(record, f)
"""


def _readme_sbatch_script() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    [script] = [block for block in blocks if "#SBATCH" in block]
    return script


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_readme_sbatch_example_runs_in_a_stand_in_allocation(tmp_path):
    script = _readme_sbatch_script()
    assert "zerotrain launch --launcher slurm --num_gpus 4 train.py" in script
    # The one change: a free port instead of 29500, which other jobs on this machine may hold.
    script = script.replace("zerotrain launch ", f"zerotrain launch --master_port {free_port()} ", 1)
    (tmp_path / "job.sh").write_text(script)
    (tmp_path / "train.py").write_text(RECORD_SCRIPT)
    (tmp_path / "ds_config.json").write_text("{}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    _executable(bin_dir / "srun", FAKE_SRUN)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "PATH": os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]),
    }
    result = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr

    srun = json.loads((tmp_path / "srun_argv.json").read_text())
    assert srun[:7] == ["--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    agent = srun[7:]
    # The agent runs under the launcher's own interpreter: the `zerotrain` script's shebang, which in a
    # venv may be bin/python3 where pytest runs as bin/python (the same interpreter, two names).
    assert os.path.dirname(agent[0]) == os.path.dirname(sys.executable), (agent[0], sys.executable)
    assert os.path.samefile(agent[0], sys.executable), (agent[0], sys.executable)
    assert agent[1:4] == ["-u", "-m", "zerotrain.launcher.cli"]
    assert agent[agent.index("--node_rank") + 1] == "slurm" and agent[agent.index("--nproc") + 1] == "4"
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8)}
    for rank, record in records.items():
        node, local = divmod(rank, 4)
        assert (record["WORLD_SIZE"], record["CROSS_SIZE"], record["LOCAL_SIZE"]) == ("8", "2", "4")
        assert (record["CROSS_RANK"], record["LOCAL_RANK"], record["MASTER_ADDR"]) == (
            str(node),
            str(local),
            "127.0.0.1",
        )
        assert record["argv"] == ["--deepspeed", "--deepspeed_config", "ds_config.json", f"--local_rank={local}"]
