"""Where a loss execution's time goes between its kernels: each kernel's start and end (PyTorch's
profiler, CUPTI timestamps) from the end of the sleep kernel before the call, medians over calls, on the
default (legacy) stream and on a created one, next to the CUDA-event time the benchmark takes.
Usage: python3 bench/experiments/loss_timeline.py [NxV ...]   (default 8192x32000 8192x128256)"""
import re
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loss import Direct  # noqa: E402
from common import median_ms  # noqa: E402

CALLS = 20


def short(name):
    m = re.search(r"\w*_kernel", name)
    return m.group(0) if m else name[:40]


def timeline(run, stream):
    with torch.cuda.stream(stream):
        run.stream = stream.cuda_stream
        ev_ms = median_ms(run)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                torch.cuda._sleep(2_000_000)
                run()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "elementwise" not in e.name), key=lambda e: e.time_range.start)
    # A call: the sleep (spin) kernel, then ours; times from the sleep's end (where the
    # benchmark's first event is recorded).
    rows, t0 = {}, None
    for k in kernels:
        if "spin" in k.name or "sleep" in k.name:
            t0, i = k.time_range.end, 0
            continue
        if t0 is None:
            continue
        rows.setdefault(i, (short(k.name), []))[1].append(
            (k.time_range.start - t0, k.time_range.end - t0))
        i += 1
    print(f"  CUDA-event time {ev_ms * 1e3:.1f} us; kernels (us from the sleep kernel's end, medians):")
    for i, (name, se) in rows.items():
        s = statistics.median(a for a, _ in se)
        e = statistics.median(b for _, b in se)
        print(f"    {name:40s} start {s:8.1f}  end {e:8.1f}  dur {e - s:8.1f}")


def main():
    shapes = sys.argv[1:] or ["8192x32000", "8192x128256"]
    for shape in shapes:
        N, V = map(int, shape.split("x"))
        logits = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
        labels = torch.randint(0, V, (N,), device="cuda")
        run = Direct(logits, labels, ("ce",))
        for sname, s in (("default stream", torch.cuda.default_stream()), ("own stream", torch.cuda.Stream())):
            print(f"{shape} CE+grad, {sname}")
            timeline(run, s)


if __name__ == "__main__":
    main()
