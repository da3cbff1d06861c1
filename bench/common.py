"""Timing helpers shared by the benchmarks: median CUDA-event timings, the measured copy
bandwidth, and a results table written as Markdown."""
from __future__ import annotations

import datetime
import os
import subprocess

import torch
import torch._dynamo


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def timed_ms(fn) -> float:
    """One call of fn timed with CUDA events (ms). The GPU is kept busy while the host queues the
    call, so the time is the GPU's alone and not the host's (Python) overhead;
    bench/rmsnorm_latency.c measures the launch path."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def median_ms(fn, *, warmup: int = 10, iters: int = 50, rotate=None) -> float:
    """Median GPU time of fn() in ms, timed with CUDA events one call at a time. `rotate`, when given,
    is called before each timed call (outside the timed region) to move to fresh inputs, so
    inputs smaller than the L2 cache are not timed from it."""
    for _ in range(warmup):
        if rotate:
            rotate()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if rotate:
            rotate()
        times.append(timed_ms(fn))
    return median(times)


def interleaved_runs(fns: dict, *, warmup: int = 2, iters: int = 10) -> dict:
    """Each fn's GPU times (ms), one a round: every round times every fn once, in turn, so all see
    the same clocks. For calls that run long enough to heat the GPU (tens of ms of matrix products),
    where one timed after another drifts by a few percent."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            times[k].append(timed_ms(fn))
    return times


def interleaved_ms(fns: dict, *, warmup: int = 2, iters: int = 10) -> dict:
    """Median GPU time (ms) of each fn, timed in turns (interleaved_runs)."""
    return {k: median(v) for k, v in interleaved_runs(fns, warmup=warmup, iters=iters).items()}


def paired_ratio(runs: dict, a, b) -> float:
    """The median over rounds of a's time over b's in the same round (interleaved_runs): the H100's
    clocks move by up to ~9% over seconds under tens of ms of matrix products (bench/notes/linear.md), which
    a ratio of two medians keeps and a ratio within a round mostly cancels."""
    return median([x / y for x, y in zip(runs[a], runs[b])])


def compile_per_shape(fn):
    """torch.compile specialised to each shape (dynamic=False), as a training run compiles it: one
    compiled function over every shape went dynamic after the second (H100: the RMSNorm forward at
    ~1700 instead of ~2970 GB/s at 8192 x 16384)."""
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(fn, dynamic=False)


def copy_ms(moved: int, sets: int = 1, iters: int = 50) -> float:
    """Median time of a device-to-device copy that moves `moved` bytes (half read, half written),
    timed as median_ms times a kernel, through `sets` source and destination pairs in turn (so that
    a copy smaller than L2 is not timed from it). At a kernel's own byte count it is the ceiling a
    plain copy reaches at that size: ramp, tail and the previous call's dirty lines included."""
    n = moved // 2
    pairs = [(torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255),
              torch.empty(n, dtype=torch.uint8, device="cuda")) for _ in range(sets)]
    i = 0

    def rotate():
        nonlocal i
        i = (i + 1) % sets

    return median_ms(lambda: pairs[i][1].copy_(pairs[i][0]), warmup=3, iters=iters, rotate=rotate)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of nbytes, counting bytes read plus bytes written."""
    return 2 * nbytes / copy_ms(2 * nbytes, iters=20) / 1e6


def header() -> str:
    # HL_COMMIT first: the device machine gets the working tree without its .git (a stale one
    # may be there), so the caller names the commit it sent.
    commit = os.environ.get("HL_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    return (f"device: {torch.cuda.get_device_name()}, date: {datetime.date.today()}, "
            f"commit: {commit}, torch {torch.__version__}")


def table(rows: list[list], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
