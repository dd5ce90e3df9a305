"""The planner, as it is now, against steps measured before: each row of a
``plan_calibration.py`` run re-estimated with that run's calibration file.

    python benchmarks/plan_replay.py benchmarks/calibration/h100.json benchmarks/calibration/h100-2026-11-27/*.log

Each log is ``plan_calibration.py``'s output (``benchmarks/run_pipeline_device.sh``:
one GPU at 8 x 2048 tokens, two stages at 16 x 2048); its table rows give the shape, the
plan and the measured median step, which this prints beside the planner's estimate.
Used when the cost model changes and no GPU is at hand to measure again.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fmoe  # noqa: E402
from fmoe.plan import Calibration, CostModel, simulate  # noqa: E402
from vs_peer import SHAPES  # noqa: E402

ROW = re.compile(r"\| ([\w.-]+) \| (1 GPU|pp(\d+))(?: \((\d+) virtual\))?, (\d+) mb, (\w+) \| ([\d.]+) \|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("calibration")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="rows of the global batch on one GPU (twice that at pp)")
    args = ap.parse_args()
    costs = CostModel(Calibration.read(args.calibration))
    print(f"calibration: {costs.calibration.source}")
    print("| log | shape | plan | measured ms | planner ms | planner / measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    for log in args.logs:
        for m in ROW.finditer(Path(log).read_text()):
            shape, pp, virtual, mb, schedule, measured = m[1], int(m[3] or 1), int(m[4] or 1), int(m[5]), m[6], \
                float(m[7])
            cfg = fmoe.ModelConfig(**{"aux_loss_coef": 0.0, "vocab": 32000, **SHAPES[shape]()})
            plan = fmoe.Plan(model=cfg, dtype="bfloat16", microbatches=mb, pp=pp, virtual_stages=virtual,
                             schedule=schedule)
            estimate = simulate(plan, args.rows * pp, args.seq, costs).step_seconds * 1e3
            print(f"| {Path(log).stem} | {shape} | {m[2]}{f' x{virtual} virtual' if virtual > 1 else ''}, {mb} mb, "
                  f"{schedule} | {measured:.1f} | {estimate:.1f} | {estimate / measured:.2f} |")


if __name__ == "__main__":
    main()
