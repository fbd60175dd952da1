"""Balance of a challenge run shared by torchrun's processes: the slowest process's time testing pairs
against the mean (target: within about 1.2x), on data with both robust and vulnerable foregrounds, and the
wall time against one process.

    python bench/bench_sharding.py --processes 2 --per-class 10

Each process uses one thread (OMP_NUM_THREADS=1), so two processes on a 2-core machine do not compete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.data import synthetic  # noqa: E402


def run(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - start, proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--per-class", type=int, default=10)
    parser.add_argument("--trunk-width", type=int, default=16, help="conv trunk of the colour model (its cost)")
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    from tests.conftest import save_torchscript  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = synthetic.generate(tmp / "bg", per_class=args.per_class, seed=0).root
        model = tmp / "color.ts"
        torch.manual_seed(0)
        save_torchscript(synthetic.ColorEvidenceModel(9, trunk_width=args.trunk_width), model)
        common = [str(REPO / "challenge_eval.py"), "--data-path", str(data), "--checkpoint", str(model), "--device",
                  "cpu", "--no-cache", "--no-progress", "--batch-size", "16", "--log-level", "INFO"]
        one_time, _ = run([sys.executable, *common, "--output-dir", str(tmp / "one"), "--results-file",
                           str(tmp / "one.json")])
        many_time, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={args.processes}", *common, "--output-dir", str(tmp / "many"),
                              "--results-file", str(tmp / "many.json")])
        cost = ("wall_time_s", "composites_per_s", "composites_evaluated")
        result, shared = (json.loads((tmp / name).read_text()) for name in ("one.json", "many.json"))
        same = {k: v for k, v in result.items() if k not in cost} == {k: v for k, v in shared.items() if k not in cost}
        balance = re.search(r"time testing pairs per process: (.*) s \(slowest / mean = ([\d.]+)\)", err)
        print(f"data: {result['total']} foregrounds x {result['background_predictions']} backgrounds, "
              f"{result['vulnerable']} vulnerable; {result['composites_evaluated']:,} composites")
        print(f"one process: {one_time:.1f} s end to end, search {result['wall_time_s']:.1f} s; {args.processes} "
              f"processes: {many_time:.1f} s end to end, search {shared['wall_time_s']:.1f} s (search speed-up "
              f"{result['wall_time_s'] / shared['wall_time_s']:.2f}x); results equal: {same}")
        print(f"time testing pairs per process: {balance.group(1)} s; slowest / mean = {balance.group(2)}")


if __name__ == "__main__":
    main()
