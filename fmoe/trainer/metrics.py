"""What the main job records: one JSON line per logged step (every ``--log-every``
steps), TensorBoard scalars when the ``tensorboard`` package is installed, and
throughput / MFU over the steps between logged ones (``Window``), read to the host
in one transfer (``to_host``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..checkpoint.files import replace_file

# The project quotes MFU against the bf16 dense-GEMM throughput measured on its GPUs
# (shared/device/ceilings.md: 789 TFLOP/s on H100 / H200), not the datasheet number.
MEASURED_PEAK_TFLOPS = {"H100": 789.0, "H200": 789.0}


def peak_tflops(device: str, dtype: str, override: float = 0.0) -> float | None:
    """The peak to quote MFU against: ``override`` if given, else the measured bf16 peak
    of a known GPU; None when unknown (CPUs, fp32 compute, other GPUs)."""
    if override:
        return override
    if torch.device(device).type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in MEASURED_PEAK_TFLOPS.items() if k in name), None)


def expert_load(counts_LE: torch.Tensor) -> torch.Tensor:
    """Per layer, the busiest expert's tokens over the mean (1.0 is perfectly even): a
    ``[layers]`` device tensor, read to the host with the step's other metrics."""
    counts = counts_LE.float()
    return counts.max(-1).values / counts.mean(-1).clamp_min(1e-9)


def _records_through(path: Path, step: int) -> list[str]:
    """The lines of ``path`` for steps up to ``step`` (a line cut short by a crash is dropped)."""
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


class MetricsLog:
    """``metrics.jsonl`` and, if available, TensorBoard events, on the main rank only;
    other ranks get a log that writes nothing.

    ``resumed_at``: the checkpoint's step when resuming, else None. The file is then
    continued after that step's record: records of steps the checkpoint does not hold
    (written after it, before the run stopped) are dropped, so every step appears once.
    """

    def __init__(self, out_dir: Path, enabled: bool, resumed_at: int | None, tensorboard: bool):
        path = out_dir / "metrics.jsonl"
        if enabled and resumed_at is not None and path.exists():
            replace_file(path, "".join(_records_through(path, resumed_at)))
        self.file = open(path, "a" if resumed_at is not None else "w") if enabled else None
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                pass
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record["step"]
            for key, value in record.items():
                if key == "step":
                    continue
                if isinstance(value, list):  # per layer
                    for i, v in enumerate(value):
                        self.writer.add_scalar(f"{key}/layer{i}", v, step)
                elif isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def to_host(values: dict) -> dict:
    """``values``' tensors read to the host in one transfer (one sync): 0-dim ones as
    floats, 1-D ones as lists of floats (fp32 and int64 values come back exactly)."""
    flat = torch.cat([v.detach().reshape(-1).double() for v in values.values()]).tolist()
    out, at = {}, 0
    for key, v in values.items():
        out[key] = flat[at] if v.dim() == 0 else flat[at:at + v.numel()]
        at += v.numel()
    return out


class Window:
    """Wall time and steps since the last logged step: tokens/s and MFU on a logged step
    are averages over them. The host read of a logged step waits for the device, so the
    time from one such read to the next is the device's time for the steps between;
    what the loop does after a read (evaluation, log, checkpoint) is left out by
    ``restart`` after it."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.trained = time.perf_counter(), 0, 0

    def seconds_per_step(self) -> float:
        """The wall time per step since ``restart``; call it right after a host read."""
        return (time.perf_counter() - self.start) / max(self.steps, 1)
