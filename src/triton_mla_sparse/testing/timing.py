"""GPU timing and the ceilings a time is judged against, shared by ``bench`` and the GPU tools.

Decode-sized calls are timed from CUDA-graph replays (as a server runs them: launch overhead
amortised), longer calls with device events around each call. Every function here needs a
CUDA/ROCm device; none is called under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

__all__ = ["Ceilings", "capture_graph", "measure_ceilings", "time_events", "time_graph"]


@dataclasses.dataclass
class Ceilings:
    copy_gbps: float  # read + write, GB/s
    matmul_tflops: float  # bf16, random data


# 512 MiB copied (1 GiB read and written): far past any GPU's L2, so the copy streams from memory
CEILING_COPY_BYTES = 1 << 29
# an 8192^3 bf16 matmul: milliseconds a call, long enough for the card's sustained rate
CEILING_MATMUL_N = 8192


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth and bf16 matmul rate measured now on ``device`` (the floor's inputs)."""
    n = CEILING_COPY_BYTES
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    t_copy = time_events(lambda: b.copy_(a), reps=20)
    m = CEILING_MATMUL_N
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = time_events(lambda: x @ y, reps=10)
    return Ceilings(2 * n / t_copy / 1e3, 2 * m**3 / t_mm / 1e6)


def time_events(
    fn: Callable[[], object], reps: int = 20, warmup: int = 3, warmup_ms: float = 200.0
) -> float:
    """Median µs of ``fn`` with device events around each call, after at least ``warmup`` calls
    and ``warmup_ms`` of calling it (the card idles at a few hundred MHz and needs time to clock
    up; a handful of millisecond-long calls is not enough)."""
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    done = 0
    while True:
        fn()
        done += 1
        if done >= warmup:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= warmup_ms:
                break
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], calls: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` warmed on a side stream (as capture requires), then ``calls`` calls captured back to
    back; returns the graph and what the last captured call returned (its output tensors)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    result = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            result = fn()
    return graph, result


def time_graph(fn: Callable[[], object], reps: int = 30, calls_per_graph: int = 20) -> float:
    """Median µs per call from CUDA-graph replays (``calls_per_graph`` calls captured back to back)."""
    fn()  # compile and warm outside capture
    torch.cuda.synchronize()
    graph, _ = capture_graph(fn, calls_per_graph)
    graph.replay()
    torch.cuda.synchronize()
    return time_events(graph.replay, reps=reps, warmup=2) / calls_per_graph
