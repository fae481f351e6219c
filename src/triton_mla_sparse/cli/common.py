"""What the CLI prints about the machine, and plain-text tables."""

from __future__ import annotations

import csv
import datetime
import platform

import torch


def gpu_device() -> torch.device | None:
    return torch.device("cuda") if torch.cuda.is_available() else None


def environment() -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = p.name
        env["capability"] = f"{p.major}.{p.minor}"
        env["sms"] = p.multi_processor_count
        env["cuda"] = torch.version.cuda or torch.version.hip
    return env


def environment_line(env: dict) -> str:
    if env["gpu"] is None:
        dev = "no GPU (Triton interpreter on CPU)"
    else:
        dev = f"{env['gpu']} (sm{env['capability'].replace('.', '')}, {env['sms']} SMs)"
    return f"{dev} | torch {env['torch']} | triton {env['triton']} | {env['date']}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(
        str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths))
    )  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def write_csv(path: str, dicts: list[dict]) -> None:
    """Rows of results (dataclasses.asdict of each) as CSV, the first row's keys as header."""
    if not dicts:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)
