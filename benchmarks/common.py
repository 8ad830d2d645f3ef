"""What every benchmark shares: the machine and versions it ran on, and how results are written."""

import datetime
import json
import os
import platform
import shlex
import sys

import torch


def environment() -> dict:
    """GPU (or CPU), library versions, date and the exact command, for a result file."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(part) for part in [os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    for package in ("triton", "transformers", "liger_kernel"):
        try:
            info[package] = __import__(package).__version__
        except (ImportError, AttributeError):
            info[package] = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = properties.name
        info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
    else:
        info["gpu"] = None
    return info


def write_result(path: str, results, **extra) -> dict:
    """Write ``{"environment": ..., "results": ...}`` as JSON (to a temporary name, then renamed)."""
    document = {"environment": environment(), **extra, "results": results}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(document, handle, indent=2)
    os.replace(temporary, path)
    return document


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the ceiling the bandwidth floors are computed with."""
    import triton.testing

    source = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * source.numel() * 2 / ms / 1e6


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)
