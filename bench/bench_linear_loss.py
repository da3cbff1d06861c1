"""Benchmark of the fused linear + loss plan (logits never in memory) against its peers on one GPU,
side by side in one run, with the floor measured in the same run: the three cuBLAS products of the
same shapes (logits = X W^T, dX = G W, dW = G^T X; torch.matmul into preallocated outputs).

Rows: N x H x V, bf16 hidden and weight, forward + backward (the loss, grad_hidden, grad_weight).
Columns: the floor; headloss CE (bf16 grads, the workspace at fast_bytes) and its ratio to the
floor; headloss with every term and metric (CE + z + entropy + GRPO + KL-ref, token outputs) and
its ratio to CE alone, and the same without the entropy bonus (the terms the shifted path takes;
the entropy term's gradient needs the row pass); headloss CE with an fp32 grad_weight; PyTorch eager (matmul + CE), Liger's
fused linear CE and Cut Cross-Entropy (each when importable); peak device memory above the inputs
(gradients included, as autograd allocates them for the peers). Inputs: "random" (logits of std 1,
a near-uniform softmax) and "peaked" (std 4: most of each row's mass on a few tokens), since
CCE's gradient filtering runs faster on peaked rows. --sweep also times headloss at chunks of
512..4096 rows (the workspace passed).

Usage: python3 bench/bench_linear_loss.py [--out table.md] [--shapes 8192x4096x128256,...]
       [--inputs random,peaked] [--sweep] [--iters 5]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import headloss  # noqa: E402
from headloss import torch_ops  # noqa: E402
from common import header, interleaved_ms, interleaved_runs, median, median_ms, paired_ratio  # noqa: E402
from headloss import loss as hloss  # noqa: E402

SHAPES = "8192x4096x128256,32768x4096x128256,16384x8192x151936,4096x2048x262144"
MEM_WORKSPACE = 256 << 20  # the workspace cap of the memory column
ALL_TERMS = ("ce", "z", "entropy", "grpo", "kl_ref")
ALL_OPTS = dict(z_weight=1e-4, entropy_weight=-1e-2, kl_ref_beta=0.04)
# The same without the entropy bonus: the terms whose gradient the shifted path forms (kernels/loss/shifted.h).
RL_TERMS = ("ce", "z", "grpo", "kl_ref")
RL_OPTS = dict(z_weight=1e-4, kl_ref_beta=0.04)


class Direct:
    """One linear plan with its arguments and outputs built once: the timed call is the C call."""

    def __init__(self, x, w, labels, terms, *, extra=None, chunk=None, nbytes=None, gw_dtype=None, tokens=False,
                 **opts):
        N, H = x.shape
        V = w.shape[0]
        self.plan = hloss.LinearLossPlan(V, H, "bfloat16", terms=terms, device="cuda", check=False,
                                         grad_weight_dtype=gw_dtype, **opts)
        self.gh = torch.empty_like(x)
        self.gw = torch.empty(V, H, device="cuda", dtype=gw_dtype or torch.bfloat16)
        self.scalars = torch.empty(len(hloss.SCALARS), device="cuda")
        a = hloss._Args(ctypes.sizeof(hloss._Args), N)
        a.hidden, a.hidden_stride, a.weight, a.weight_stride = x.data_ptr(), H, w.data_ptr(), H
        a.labels = labels.data_ptr()
        for k, t in (extra or {}).items():
            setattr(a, k, t.data_ptr())
        a.grad_hidden, a.grad_hidden_stride = self.gh.data_ptr(), H
        a.grad_weight, a.grad_weight_stride = self.gw.data_ptr(), H
        a.scalars = self.scalars.data_ptr()
        self.toks = [torch.empty(N, device="cuda") for _ in range(4)] if tokens else []
        if tokens:
            a.token_loss, a.token_logp, a.token_entropy, a.token_lse = (t.data_ptr() for t in self.toks)
        self.args = a
        lo, hi = self.plan.workspace_sizes(N)
        row = (V * 2 + 15) // 16 * 16
        self.nbytes = nbytes or (hi if chunk is None else lo + (min(chunk, N) - 1) * row)  # lo holds one row
        self.ws = torch.empty(self.nbytes // 4 + 4, device="cuda")

    def __call__(self):  # on the current stream (a graph capture's, when capturing)
        hloss._check(hloss._execute(self.plan._handle, ctypes.byref(self.args), self.ws.data_ptr(),
                                    self.nbytes, torch.cuda.current_stream().cuda_stream))


def peak_extra_gib(fn, *clear) -> float:
    """Peak device memory of one fn() above what was allocated before it (GiB); the tensors in
    `clear` drop their .grad first (a previous call's gradients are not the baseline's)."""
    for t in clear:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def peers():
    import os
    os.environ.setdefault("CCE_AUTOTUNE", "1")  # CCE's own tuning (off by default): its best configs
    out = {}
    out["torch eager"] = lambda x, w, y: torch.nn.functional.cross_entropy((x @ w.T).float(), y)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        out["Liger FLCE"] = lambda x, w, y: liger(w, x, y)
    except Exception as e:  # noqa: BLE001
        print(f"# Liger unavailable: {type(e).__name__}: {e}", flush=True)
    try:
        from cut_cross_entropy import linear_cross_entropy
        out["CCE"] = lambda x, w, y: linear_cross_entropy(x, w, y)
    except Exception as e:  # noqa: BLE001
        print(f"# CCE unavailable: {type(e).__name__}: {e}", flush=True)
    return out


def profile(label, fn, reps: int = 3) -> list[str]:
    """The CUDA kernels of `reps` calls of fn (after one warm-up): name, calls, total ms."""
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 1e3 / reps, e.count // reps, e.key))
    rows.sort(reverse=True)
    out = [f"{label}: {sum(r[0] for r in rows):.2f} ms a call in kernels"]
    out += [f"  {t:8.3f} ms  x{n:<3d} {k[:110]}" for t, n, k in rows[:12]]
    return out


def graphed(fn):
    """fn captured into a CUDA graph (after a warm-up call); returns its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def floor_products(x, w):
    """The floor: the three products of a fused linear loss's shapes (logits = X W^T, dX = G W,
    dW = G^T X; bf16 in and out, fp32 accumulation, into preallocated outputs, G random), and the same
    with a copy of the logits between them (the limit of a design that runs the loss as its own pass
    over stored logits). Both share their buffers, freed with the two functions."""
    N, V = x.shape[0], w.shape[0]
    z = torch.empty(N, V, device=x.device, dtype=x.dtype)
    g = torch.randn(N, V, device=x.device).to(x.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)

    def products():
        torch.matmul(x, w.T, out=z)
        torch.matmul(g, w, out=dx)
        torch.matmul(g.T, x, out=dw)

    def products_copy():
        torch.matmul(x, w.T, out=z)
        g.copy_(z)
        torch.matmul(g, w, out=dx)
        torch.matmul(g.T, x, out=dw)
    return products, products_copy


def fwd_bwd(fn, x, w, y):
    def run():
        x.grad = w.grad = None
        fn(x, w, y).backward()
    return run


def peak_memory(N, H, V, y, x, w, peer_fns) -> tuple:
    """(bound, [peak of headloss, then of each peer]) in GiB: forward + backward through each
    library's PyTorch front end, headloss's torch_ops.linear_loss with the workspace capped at
    MEM_WORKSPACE; bound = grad_hidden + grad_weight + that workspace."""
    plan = hloss.LinearLossPlan(V, H, "bfloat16", terms=("ce",), device="cuda", check=False)
    ws = max(plan.workspace_sizes(N)[0], min(plan.workspace_bytes(N), MEM_WORKSPACE))
    bound = ((x.numel() + w.numel()) * 2 + ws) / 2**30
    ours = lambda x, w, y: torch_ops.linear_loss(x, w, y, check=False, max_workspace_bytes=MEM_WORKSPACE)[0]  # noqa: E731
    mem = []
    for fn in [ours] + list(peer_fns.values()):
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        try:
            run = fwd_bwd(fn, xr, wr, y)
            run()  # warm-up: plans made, kernels compiled
            mem.append(peak_extra_gib(run, xr, wr))
        except torch.OutOfMemoryError:
            mem.append(None)
        del xr, wr
        torch.cuda.empty_cache()
    return bound, mem


def matched_memory(N, H, V, y, x, w, peer_name, peer_fn, iters) -> str:
    """A table row: the largest workspace that keeps headloss's peak at or below the peer's, and
    the times (forward + backward) of headloss there, at MEM_WORKSPACE and at fast_bytes, of the
    peer and of the three products, all in one run. headloss's peak is its gradients plus the
    workspace (the bound above), so the workspace that matches is the peer's peak less those."""
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    run = fwd_bwd(peer_fn, xr, wr, y)
    run()
    peer_peak = peak_extra_gib(run, xr, wr)
    peer_ms = median_ms(run, warmup=1, iters=iters)
    del xr, wr, run
    torch.cuda.empty_cache()
    plan = hloss.LinearLossPlan(V, H, "bfloat16", terms=("ce",), device="cuda", check=False)
    lo, hi = plan.workspace_sizes(N)
    grads = (x.numel() + w.numel()) * 2
    fit = int(peer_peak * 2**30) - grads
    ours = {}
    if fit >= lo:
        cap = min(fit, MEM_WORKSPACE) // 256 * 256
        capped = lambda x, w, y: torch_ops.linear_loss(x, w, y, check=False, max_workspace_bytes=cap)[0]  # noqa: E731
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        run = fwd_bwd(capped, xr, wr, y)
        run()
        ours["peak"] = peak_extra_gib(run, xr, wr)
        del xr, wr, run
        torch.cuda.empty_cache()
        ours["matched"] = Direct(x, w, y, ("ce",), nbytes=cap)
    ours["cap"] = Direct(x, w, y, ("ce",), nbytes=min(hi, max(lo, MEM_WORKSPACE)))
    ours["fast"] = Direct(x, w, y, ("ce",))
    fns = {k: v for k, v in ours.items() if k in ("matched", "cap", "fast")}
    t = interleaved_ms({"floor": floor_products(x, w)[0], **fns}, warmup=1, iters=iters)
    del fns
    ours.pop("matched", None), ours.pop("cap"), ours.pop("fast")
    torch.cuda.empty_cache()
    f = lambda k: f"{t[k]:.2f} ({t[k] / t['floor']:.2f}x)" if k in t else "n/a"  # noqa: E731
    matched = f"{cap / 2**20:.1f} MiB: {ours['peak']:.3f} GiB, {f('matched')}" if "peak" in ours else \
        f"below min_bytes ({lo / 2**20:.1f} MiB)"
    return (f"| {N} x {H} x {V} | {peer_peak:.3f} GiB, {peer_ms:.2f} ms ({peer_ms / t['floor']:.2f}x) | {matched} | "
            f"{f('cap')} | {f('fast')} | {t['floor']:.2f} |")


def memory_table(args):
    peer_fns = {} if args.no_peers else peers()
    lines = [header() + f"; headloss {headloss.version()}; bf16 hidden and weight; peak device memory above the "
             "inputs during one forward + backward through each library's PyTorch front end (GiB)", "",
             "| N x H x V | headloss (torch_ops.linear_loss, 256 MiB workspace) | " + " | ".join(peer_fns) +
             " | headloss's bound: grad_hidden + grad_weight + workspace |", "|" + "---|" * (3 + len(peer_fns))]
    matched = []
    for shape in args.shapes.split(","):
        N, H, V = map(int, shape.split("x"))
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        w = (torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device="cuda")
        y[::17] = -100
        bound, mem = peak_memory(N, H, V, y, x, w, peer_fns)
        lines.append(f"| {N} x {H} x {V} | " + " | ".join("n/a" if m is None else f"{m:.3f}" for m in mem) +
                     f" | {bound:.3f} |")
        print(lines[-1], flush=True)
        if args.matched in peer_fns:
            matched.append(matched_memory(N, H, V, y, x, w, args.matched, peer_fns[args.matched], args.iters))
            print(matched[-1], flush=True)
        del x, w, y
        torch.cuda.empty_cache()
    if matched:
        lines += ["", f"At {args.matched}'s memory: the largest workspace (at most 256 MiB) under which headloss's "
                  f"peak stays at or below {args.matched}'s, and the forward + backward times (ms; x the three "
                  "products) of both, of headloss at the 256 MiB workspace and at fast_bytes, and of the products, "
                  "in one run (headloss's times of the C call with that workspace; the peer's through its module):",
                  "", f"| N x H x V | {args.matched}: peak, time | headloss at that memory: workspace, peak, time | "
                  "headloss, 256 MiB workspace | headloss, fast_bytes | 3 products (ms) |",
                  "|---|---|---|---|---|---|"] + matched
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--inputs", default="random,peaked")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel times of the floor and headloss (first shape)")
    ap.add_argument("--graphs", action="store_true", help="also time the floor and headloss CE from CUDA graphs")
    ap.add_argument("--memory-only", action="store_true", help="the peak-memory comparison alone (no timing)")
    ap.add_argument("--matched", default=None, metavar="PEER",
                    help="with --memory-only: also headloss at PEER's memory (e.g. 'Liger FLCE'), both timed")
    args = ap.parse_args()
    if args.memory_only:
        return memory_table(args)
    torch.manual_seed(0)
    it = dict(warmup=2, iters=args.iters)
    peer_it = dict(warmup=2, iters=max(3, args.iters // 2))
    peer_fns = {} if args.no_peers else peers()
    head = (["N x H x V", "inputs", "3 products (floor)", "+ a copy of the logits", "headloss CE", "vs floor",
             "vs floor + copy", "all terms + metrics",
             "vs CE", "all but entropy, + metrics", "vs CE", "CE, fp32 grad_weight"] + [f"{k}" for k in peer_fns] +
            ["peak memory: headloss / " + " / ".join(peer_fns) + " (GiB)", "headloss: gradients + workspace (GiB)"])
    lines = [header() + f"; headloss {headloss.version()}; bf16 hidden and weight; forward + backward; "
             "median of CUDA-event timings (ms)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    sweep_lines, profile_lines, graph_lines = [], [], []
    for shape in args.shapes.split(","):
        N, H, V = map(int, shape.split("x"))
        for kind in args.inputs.split(","):
            std = 1.0 if kind == "random" else 4.0
            x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
            w = (torch.randn(V, H, device="cuda") * (std / H ** 0.5)).to(torch.bfloat16)
            y = torch.randint(0, V, (N,), device="cuda")
            y[::17] = -100
            products, products_copy = floor_products(x, w)
            ce = Direct(x, w, y, ("ce",))
            adv = torch.randn(N, device="cuda")
            old = -torch.rand(N, device="cuda") * 8 - 4
            ref = -torch.rand(N, device="cuda") * 8 - 4
            full = Direct(x, w, y, ALL_TERMS, extra={"advantages": adv, "old_logprobs": old, "ref_logprobs": ref},
                          tokens=True, **ALL_OPTS)
            rl = Direct(x, w, y, RL_TERMS, extra={"advantages": adv, "old_logprobs": old, "ref_logprobs": ref},
                        tokens=True, **RL_OPTS)
            f32 = Direct(x, w, y, ("ce",), gw_dtype=torch.float32)
            # The floor and our variants in turns (the same clocks for all: see interleaved_runs).
            fns = {"floor": products, "copy": products_copy, "ce": ce, "full": full, "rl": rl, "f32": f32}
            if args.graphs:  # the same calls replayed from CUDA graphs: no host time in them
                fns.update({k + " graph": graphed(fns[k]) for k in ("floor", "ce")})
            runs = interleaved_runs(fns, **it)
            t = {k: median(v) for k, v in runs.items()}
            r = lambda a, b: paired_ratio(runs, a, b)  # noqa: E731
            t_floor, t_copy, t_ce, t_full, t_rl, t_f32 = (t[k] for k in ("floor", "copy", "ce", "full", "rl", "f32"))
            if args.graphs:
                graph_lines.append(f"| {N} x {H} x {V} | {kind} | {t['floor graph']:.2f} | {t['ce graph']:.2f} | "
                                   f"{r('ce graph', 'floor graph'):.3f}x |")
            if args.profile and not profile_lines:
                profile_lines = profile("3 products", products) + profile("headloss CE", ce)
                print("\n".join(profile_lines), flush=True)
            del products, products_copy, fns, ce, full, rl, f32
            torch.cuda.empty_cache()
            bound_gib, mem = peak_memory(N, H, V, y, x, w, peer_fns)  # memory as users meet it
            t_peers = []
            for name, fn in peer_fns.items():
                xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
                try:
                    t_peers.append(median_ms(fwd_bwd(fn, xr, wr, y), **peer_it))
                except torch.OutOfMemoryError:
                    t_peers.append(None)
                del xr, wr
                torch.cuda.empty_cache()
            f = lambda t: "n/a" if t is None else f"{t:.2f}"  # noqa: E731
            row = [f"{N} x {H} x {V}", kind, f"{t_floor:.2f}", f"{t_copy:.2f}", f"{t_ce:.2f}",
                   f"{r('ce', 'floor'):.3f}x", f"{r('ce', 'copy'):.3f}x", f"{t_full:.2f}", f"{r('full', 'ce'):.3f}x",
                   f"{t_rl:.2f}", f"{r('rl', 'ce'):.3f}x",
                   f"{t_f32:.2f}"] + [f(t) for t in t_peers]
            row.append(" / ".join("n/a" if m is None else f"{m:.2f}" for m in mem))
            row.append(f"{bound_gib:.2f}")
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
            if args.sweep and kind == args.inputs.split(",")[0]:
                runs = {(c, gw): Direct(x, w, y, ("ce",), chunk=c, gw_dtype=gw)
                        for c in (512, 1024, 2048, 4096, N) if c <= N for gw in (None, torch.float32)}
                times = interleaved_ms(runs, **it)
                for (c, gw), d in runs.items():
                    sweep_lines.append(f"| {N} x {H} x {V} | {c} | {'fp32' if gw else 'bf16'} | "
                                       f"{d.nbytes / 2**20:.0f} | {times[(c, gw)]:.2f} | "
                                       f"{times[(c, gw)] / t_floor:.3f}x |")
                    print(sweep_lines[-1], flush=True)
                del runs, d
                torch.cuda.empty_cache()
            del x, w, y
            torch.cuda.empty_cache()
    lines += ["", "The floor and headloss's columns are timed in turns (each iteration runs each once: the same "
              "clocks); the peers one after another. Times: medians over the rounds; ratios: the median over the rounds "
              "of the two times of the same round (the clocks move by up to ~9% over seconds). vs floor: headloss CE "
              "over the three products' time. vs CE: every term and metric over CE alone. Peak memory: above the inputs during one forward + backward "
              "through each library's PyTorch front end (headloss: torch_ops.linear_loss with max_workspace_bytes = 256 MiB), "
              "the gradients included; the last column is what headloss's bound allows: grad_hidden + grad_weight + the "
              "workspace. CCE runs with its default gradient filter "
              "(filter_eps='high') and its autotuning on (CCE_AUTOTUNE=1). '+ a copy of the logits': the three "
              "products with a copy of the logits between them, the limit of any design that runs the loss as "
              "its own pass over stored logits (headloss does). Labels unchecked (HL_LOSS_UNCHECKED), as the "
              "peers do."]
    if sweep_lines:
        lines += ["", "Chunk sweep (headloss CE; rows a chunk set by the workspace passed):", "",
                  "| N x H x V | rows a chunk | grad_weight | workspace (MiB) | ms | vs floor |",
                  "|---|---|---|---|---|---|"] + sweep_lines
    if graph_lines:
        lines += ["", "From CUDA graphs (no host time between the kernels):", "",
                  "| N x H x V | inputs | 3 products | headloss CE | vs floor |", "|---|---|---|---|---|"] + graph_lines
    if profile_lines:
        lines += ["", "Kernels (torch.profiler, first shape):", "", "```"] + profile_lines + ["```"]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
