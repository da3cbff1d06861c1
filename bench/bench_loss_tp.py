"""Benchmark of the vocabulary-sharded loss on two GPUs or more (one process each, --ranks), side by side in one run.

The loss: CE + z-loss + entropy (as a small bonus) with gradient, bf16 logits [N, V] split in --ranks
contiguous shards. Per rank, median CUDA-event times (ms) of:
  - headloss, the caller's collective: stats -> torch.distributed.all_gather_into_tensor -> finish
    (one collective), and each step alone;
  - headloss on a raw NCCL communicator (hl_loss_plan_execute_nccl: the same, one call);
  - headloss unsharded on one GPU (the whole [N, V]) for scale.
CE alone beside Megatron-core's vocab_parallel_cross_entropy and fused_vocab_parallel_cross_entropy
(PyPI megatron-core, when it imports: an all-reduce per statistic, the max, the label's logit and the
sum of exponentials (the last two in one when fused), then the gradient from the saved softmax) and
headloss's switch for them (headloss.integrations.megatron: per-token losses, the upstream per-token
gradient in backward), forward + backward of the masked token mean as its trainers take it, with
the peak memory above the inputs per rank.
Also dense JSD distillation (CE + JSD against teacher logits sharded the same way: a middle step and
a second all-gather) and the fused linear form (hidden [N, H], the weight sharded by vocabulary rows:
one all-gather for the loss, one all-reduce of grad_hidden), the latter against its floor on a rank:
the shard's three products through cuBLAS and the all-reduce of grad_hidden. Then Megatron's output
layer and loss on per-token losses: its product and fused_vocab_parallel_cross_entropy against
headloss's fused output layer (integrations.megatron's fused_output_layer; the
upstream per-token gradient being known in the backward only) with the shard's logits kept from the
forward to the backward (three products) or in a 256 MiB workspace (four), beside the floors of
three and four products and the all-reduce, time and peak memory.
Labels unchecked (no host synchronisation), as the peers do not check them.

Usage: python3 bench/bench_loss_tp.py [--out table.md] [--shape 8192x128256] [--linear 8192x4096x128256]
       [--ranks 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "python"), str(Path(__file__).parent)]

Z_W, ENT_W = 1e-4, -1e-2
TERMS = ("ce", "z", "entropy")


def shard(V: int, rank: int, ranks: int) -> tuple:
    """(first column, columns) of rank's contiguous shard: equal ones, the remainder on the last."""
    n = V // ranks
    return rank * n, (V - rank * n if rank == ranks - 1 else n)


def megatron_runs(x, y, group):
    """Forward + backward of the masked token mean as Megatron's trainers take it, on its layout
    ([s, b, V / tp] with b = 1): through Megatron-core's vocab_parallel_cross_entropy, its
    fused_vocab_parallel_cross_entropy, and the switch (headloss.integrations.megatron: per-token
    losses out, the upstream per-token gradient in). An ignored label lies in no shard, so its row
    is masked out. {} when megatron-core does not import."""
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except Exception as e:  # noqa: BLE001
        print(f"# megatron-core unavailable: {type(e).__name__}: {e}", flush=True)
        return {}
    from headloss.integrations.megatron import vocab_parallel_cross_entropy as switch
    mask = (y >= 0).float()
    losses = {  # name: (per-token losses of [s, b, V / tp] and [s, b], the collectives a step)
        "Megatron-core vocab_parallel_cross_entropy":
            (lambda z, t: vocab_parallel_cross_entropy(z, t, tp_group=group), "3 all-reduces"),
        "Megatron-core fused_vocab_parallel_cross_entropy":
            (lambda z, t: fused_vocab_parallel_cross_entropy(z, t, group), "2 all-reduces"),
        "headloss: the Megatron switch (per-token losses)":
            (lambda z, t: switch(z, t, tp_group=group, check=False), "1 all-gather")}

    def step(fn):
        def run():
            z = x.detach().view(x.shape[0], 1, -1).requires_grad_(True)
            loss = (fn(z, y.view(-1, 1)).view(-1) * mask).sum() / mask.sum()
            loss.backward()
            return loss
        return run
    return {k: (step(fn), colls) for k, (fn, colls) in losses.items()}


def peak_gib(fn) -> float:
    """GiB allocated at fn()'s peak above what was allocated before it (its inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def worker(rank: int, init: str, args) -> None:
    import torch.distributed as dist
    from common import header, median_ms, table
    from headloss.loss import LossPlan
    from nccl_comm import Comm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=args.ranks,
                            device_id=torch.device("cuda", rank))
    N, V = map(int, args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    full = (torch.randn(N, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    y[::17] = -100
    R = args.ranks
    lo, n = shard(V, rank, R)
    x = full[:, lo:lo + n].contiguous()  # what a rank holds
    opts = dict(z_weight=Z_W, entropy_weight=ENT_W, check=False)
    t = {}
    if rank == 0:
        whole = LossPlan(V, "bfloat16", terms=TERMS, device="cuda", **opts)
        gw = torch.empty_like(full)
        t["unsharded, 1 GPU"] = median_ms(lambda: whole(full, y, grad=gw))
        ref = whole(full, y, grad=gw).scalars[0].item()
        del gw
    del full
    torch.cuda.empty_cache()
    plan = LossPlan(n, "bfloat16", terms=TERMS, device="cuda", vocab_start=lo, vocab_global=V,
                    ranks=R, **opts)
    grad = torch.empty_like(x)
    block = plan.stats(x, y)
    gathered = torch.empty(R * block.numel(), dtype=block.dtype, device="cuda")

    def split():
        b = plan.stats(x, y)
        dist.all_gather_into_tensor(gathered, b)
        return plan.finish(gathered, x, y, grad=grad)

    t["headloss: stats + all-gather + finish"] = median_ms(split)
    t["  stats alone"] = median_ms(lambda: plan.stats(x, y))
    t["  all-gather alone"] = median_ms(lambda: dist.all_gather_into_tensor(gathered, block))
    t["  finish alone"] = median_ms(lambda: plan.finish(gathered, x, y, grad=grad))
    comm = Comm()
    t["headloss: hl_loss_plan_execute_nccl"] = median_ms(lambda: plan.nccl(comm.ptr, x, y, grad=grad))
    ours = split().scalars[0].item()
    ce, ce_ref = ce_times(V, lo, x, y, comm, dist)
    del grad, x
    torch.cuda.empty_cache()
    jt, jcolls = jsd_times(rank, N, V, y, comm)
    lt, lcolls, lpeaks = linear_times(rank, *map(int, args.linear.split("x")), comm, dist)
    comm.destroy()
    if rank == 0:
        assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)
        nbytes = f"{R * block.numel() * 8 / 1e3:.0f} KB gathered"
        rows = [[k, f"{v:.3f}", "1 all-gather" if "headloss:" in k else "", nbytes if "headloss:" in k else ""]
                for k, v in t.items()]
        more = lambda tt, cc: [[k, f"{v:.3f}", cc.get(k, "")] for k, v in tt.items()]  # noqa: E731
        lrows = [[k, f"{v:.3f}", lcolls.get(k, ""), lpeaks.get(k, "")] for k, v in lt.items()]
        text = "\n".join([
            f"{header()}; {R} GPUs, one process each, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
            f"CE with gradient, bf16 [{N}, {V}] in {R} shards of {V // R} columns, beside Megatron-core "
            f"(loss {ce_ref:.6f}):", "",
            table(ce, ["per rank", "ms", "collectives", "peak above inputs, GiB", "Megatron-core / this",
                       "Megatron-core fused / this"]), "",
            f"CE + z + entropy with gradient, the same bf16 [{N}, {V}] logits; loss {ref:.6f} (sharded {ours:.6f}):", "",
            table(rows, ["per rank", "ms", "collectives", "bytes"]), "",
            f"Dense JSD (CE + JSD, beta 0.5), bf16 student and teacher logits [{N}, {V}], the same shards:", "",
            table(more(jt, jcolls), ["per rank", "ms", "collectives"]), "",
            f"Fused linear form, CE, bf16 hidden [{args.linear.split('x')[0]}, {args.linear.split('x')[1]}], "
            f"the weight's {args.linear.split('x')[2]} rows in {R} shards:", "",
            table(lrows, ["per rank", "ms", "collectives", "peak above inputs, GiB"])])
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
    dist.destroy_process_group()


def ce_times(V, lo, x, y, comm, dist):
    """CE alone on this rank's shard x: headloss's split with the caller's all-gather and its NCCL
    call, beside Megatron-core's; table rows and the loss (checked against Megatron-core's)."""
    from common import median_ms
    from headloss.loss import LossPlan
    plan = LossPlan(x.shape[1], "bfloat16", terms=("ce",), device="cuda", vocab_start=lo, vocab_global=V,
                    ranks=dist.get_world_size(), check=False)
    grad = torch.empty_like(x)
    block = plan.stats(x, y)
    gathered = torch.empty(dist.get_world_size() * block.numel(), dtype=block.dtype, device="cuda")

    def split():
        dist.all_gather_into_tensor(gathered, plan.stats(x, y))
        return plan.finish(gathered, x, y, grad=grad)
    t = {"headloss: stats + all-gather + finish": median_ms(split),
         "headloss: hl_loss_plan_execute_nccl": median_ms(lambda: plan.nccl(comm.ptr, x, y, grad=grad))}
    ours = split().scalars[0].item()
    colls = {k: "1 all-gather" for k in t}
    peaks = {}
    for k, (run, colls[k]) in megatron_runs(x, y, dist.group.WORLD).items():
        theirs = run().item()
        assert abs(theirs - ours) <= 1e-3 * abs(ours), (k, theirs, ours)
        t[k] = median_ms(run, iters=20)
        peaks[k] = f"{peak_gib(run):.2f}"
    base = t.get("Megatron-core vocab_parallel_cross_entropy")
    fused = t.get("Megatron-core fused_vocab_parallel_cross_entropy")
    ratio = lambda b, v: f"{b / v:.2f}x" if b else "n/a"  # noqa: E731
    rows = [[k, f"{v:.3f}", colls[k], peaks.get(k, ""), ratio(base, v), ratio(fused, v)] for k, v in t.items()]
    return rows, ours


def jsd_times(rank, N, V, y, comm):
    """Dense JSD: unsharded on rank 0, then the sharded NCCL call (stats, all-gather, middle,
    all-gather, finish)."""
    from common import median_ms
    from headloss.loss import LossPlan
    g = torch.Generator(device="cuda").manual_seed(1)
    full = (torch.randn(N, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    tfull = (torch.randn(N, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    terms, opts = ("ce", "distill_jsd"), dict(jsd_beta=0.5, check=False)
    t = {}
    if rank == 0:
        whole = LossPlan(V, "bfloat16", terms=terms, device="cuda", **opts)
        gw = torch.empty_like(full)
        t["JSD unsharded, 1 GPU"] = median_ms(lambda: whole(full, y, teacher_logits=tfull, grad=gw), iters=20)
        del gw
    import torch.distributed as dist
    lo, n = shard(V, rank, dist.get_world_size())
    x, u = full[:, lo:lo + n].contiguous(), tfull[:, lo:lo + n].contiguous()
    del full, tfull
    torch.cuda.empty_cache()
    plan = LossPlan(n, "bfloat16", terms=terms, device="cuda", vocab_start=lo, vocab_global=V,
                    ranks=dist.get_world_size(), **opts)
    grad = torch.empty_like(x)
    t["JSD: hl_loss_plan_execute_nccl"] = median_ms(
        lambda: plan.nccl(comm.ptr, x, y, teacher_logits=u, grad=grad), iters=20)
    return t, {"JSD: hl_loss_plan_execute_nccl": f"{plan.exchanges} all-gathers"}


def linear_times(rank, N, H, V, comm, dist):
    """The fused linear form: unsharded on rank 0; the shard's NCCL call; the floor on a rank (the
    shard's three products and the all-reduce of grad_hidden), timed in turns with the NCCL call."""
    from common import interleaved_ms
    from headloss.loss import LinearLossPlan
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) * (2.5 / H ** 0.5)).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    t = {}
    if rank == 0:
        whole = LinearLossPlan(V, H, "bfloat16", terms=("ce",), device="cuda", check=False)
        gh, gw, ws = torch.empty_like(x), torch.empty_like(w), whole.workspace(x, N)
        t["linear unsharded, 1 GPU"] = interleaved_ms(
            {"u": lambda: whole(x, w, y, grad_hidden=gh, grad_weight=gw, workspace=ws)}, iters=5)["u"]
        del gh, gw, ws
    lo, n = shard(V, rank, dist.get_world_size())
    w = w[lo:lo + n].contiguous()
    torch.cuda.empty_cache()
    plan = LinearLossPlan(n, H, "bfloat16", terms=("ce",), device="cuda", vocab_start=lo, vocab_global=V,
                          ranks=dist.get_world_size(), check=False)
    gh, gw, ws = torch.empty_like(x), torch.empty_like(w), plan.workspace(x, N)
    z, dx, dw = torch.empty(N, n, device="cuda", dtype=x.dtype), torch.empty_like(x), torch.empty_like(w)

    def floor():
        torch.matmul(x, w.T, out=z)
        torch.matmul(z, w, out=dx)
        torch.matmul(z.T, x, out=dw)
        dist.all_reduce(dx)

    both = interleaved_ms({"floor": floor, "ours": lambda: plan.nccl(comm.ptr, x, w, y, grad_hidden=gh,
                                                                       grad_weight=gw, workspace=ws)}, iters=5)
    t["linear floor: the shard's 3 products + all-reduce"] = both["floor"]
    t["linear: hl_loss_plan_execute_nccl"] = both["ours"]
    t["  vs its floor"] = both["ours"] / both["floor"]
    colls = {"linear floor: the shard's 3 products + all-reduce": "1 all-reduce",
             "linear: hl_loss_plan_execute_nccl": "1 all-gather + 1 all-reduce"}
    del gh, gw, ws
    torch.cuda.empty_cache()
    out, peaks = output_layer_times(x, w, y, z, floor, dist)
    del z, dx, dw
    t.update(out)
    colls.update({"output layer floor: 3 products + all-reduce": "1 all-reduce",
                  "output layer floor: 4 products + all-reduce": "1 all-reduce",
                  KEPT: "1 all-gather + 1 all-reduce", CAPPED: "1 all-gather + 1 all-reduce",
                  "Megatron-core: product + fused_vocab_parallel_cross_entropy": "3 all-reduces"})
    return t, colls, peaks


KEPT = "headloss: fused output layer, logits kept (Megatron switch's default)"
CAPPED = "headloss: fused output layer, 256 MiB workspace"


def output_layer_times(x, w, y, z, floor, dist):
    """Megatron's output layer and loss on per-token losses (a masked mean, forward + backward, the
    all-reduce of grad_hidden): its product then fused_vocab_parallel_cross_entropy on the [s, b,
    V / tp] logits, against headloss's fused output layer (torch_token_loss.linear_token_loss) with
    the shard's logits kept from the forward to the backward (three products) and in a 256 MiB
    workspace (four), and the floors of three and four products + the all-reduce, timed in turns;
    peak GiB above the inputs."""
    from common import interleaved_ms
    from headloss.torch_token_loss import linear_token_loss
    mask = (y >= 0).float()

    def step(losses_of, reduce=False):
        def run():
            h, wt = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            loss = (losses_of(h, wt).view(-1) * mask).sum() / mask.sum()
            loss.backward()
            if reduce:  # Megatron's copy_to_tensor_model_parallel_region, in its backward
                dist.all_reduce(h.grad)
            return h.grad
        return run

    def floor4():
        floor()
        torch.matmul(x, w.T, out=z)

    def ours(cap):
        return lambda h, wt: linear_token_loss(h, wt, y, group=dist.group.WORLD, check=False, max_workspace_bytes=cap)

    runs = {"output layer floor: 3 products + all-reduce": floor,
            "output layer floor: 4 products + all-reduce": floor4,
            KEPT: step(ours(None)), CAPPED: step(ours(256 << 20))}
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        def megatron(h, wt):
            return fused_vocab_parallel_cross_entropy((h @ wt.T).view(h.shape[0], 1, -1), y.view(-1, 1),
                                                      dist.group.WORLD)
        runs["Megatron-core: product + fused_vocab_parallel_cross_entropy"] = step(megatron, reduce=True)
        with torch.no_grad():  # the same per-token losses
            theirs, mine = megatron(x, w), ours(None)(x, w)
        gap = (mine.view(-1) - theirs.view(-1).float()).abs()  # bf16 logits on both sides
        assert float(gap.max()) < 0.1 and float(gap.mean()) < 1e-3 * float(mine.mean()), float(gap.max())
    except Exception as e:  # noqa: BLE001
        print(f"# megatron-core unavailable: {type(e).__name__}: {e}", flush=True)
    t = interleaved_ms(runs, iters=5)
    t["  logits kept vs 3 products"] = t[KEPT] / t["output layer floor: 3 products + all-reduce"]
    t["  256 MiB vs 4 products"] = t[CAPPED] / t["output layer floor: 4 products + all-reduce"]
    peaks = {k: f"{peak_gib(f):.2f}" for k, f in runs.items() if "floor" not in k}
    return t, peaks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="8192x128256")
    ap.add_argument("--linear", default="8192x4096x128256", help="N x H x V of the fused linear rows")
    ap.add_argument("--ranks", type=int, default=2, help="GPUs, one process each (the vocabulary in as many shards)")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.ranks:
        print(f"# bench_loss_tp: needs {args.ranks} GPUs; skipped")
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(f"file://{tmp}/init", args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
