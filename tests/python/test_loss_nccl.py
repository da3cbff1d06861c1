"""The sharded loss on two GPUs, one process each: the caller's collective
(stats -> torch.distributed.all_gather_into_tensor -> finish) and hl_loss_plan_execute_nccl on a
raw NCCL communicator, both against the unsharded plan on the whole vocabulary (scalars within
1e-6, 5e-6 with distillation; fp32 gradient within 1e-5) and bit-identical to each other. Also a
sparse teacher (global top-k ids) and dense JSD (the middle step and a second all-gather, which
hl_loss_plan_execute_nccl does itself). The fused linear form too: the weight sharded by
vocabulary rows, hl_loss_plan_execute_nccl all-reducing grad_hidden (written, and accumulated onto
what the buffer held), with and without the logits kept in the workspace. Skips without two GPUs."""
import numpy as np
import pytest

import headloss
from spawn_ranks import run_ranks

N, V, SPLIT = 1000, 50257, 20011  # an odd vocabulary, uneven shards
TERMS = ("ce", "z", "entropy", "grpo", "kl_ref")
OPTS = dict(z_weight=1e-3, entropy_weight=-0.1, kl_ref_beta=0.05, label_smoothing=0.1, softcap=30.0,
            grad_dtype="float32")  # an fp32 gradient: the bound is on the merge, not on bf16 rounding
# (terms, options, scalar tolerance) by case
CASES = {"rl": (TERMS, OPTS, 1e-6),
         "sparse": (("ce", "z", "distill_rev"), dict(OPTS, teacher_topk=64, student_temperature=1.5), 5e-6),
         "jsd": (("ce", "entropy", "distill_jsd"), dict(OPTS, jsd_beta=0.3, teacher_temperature=2.0), 5e-6)}


def _inputs(torch, case):
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    f = lambda: torch.randn(N, generator=g) * 0.3  # noqa: E731
    teacher = {}
    u = (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16)
    if case == "jsd":
        teacher["teacher_logits"] = u
    if case == "sparse":  # the teacher's top 64 (global ids, both shards), row 3 half padding
        lp, ids = torch.log_softmax(u.float(), 1).topk(64, 1)
        ids[3, 32:] = -1
        teacher = dict(teacher_topk_ids=ids, teacher_topk_logprobs=lp)
    return x, y, dict(advantages=f(), old_logprobs=f() - 10, ref_logprobs=f() - 10), teacher


# The fused linear form: rows, hidden size, a teacher's hidden size (a fused JSD teacher)
LN, LH, LHT = 301, 192, 96
LINEAR = {"linear_rl": (TERMS, {k: v for k, v in OPTS.items() if k != "grad_dtype"}),
          "linear_jsd": (("ce", "entropy", "distill_jsd"),
                         dict(label_smoothing=0.1, entropy_weight=-0.1, jsd_beta=0.3, teacher_temperature=2.0))}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _linear_worker(rank: int, case: str, torch, dist, Comm) -> None:
    """The linear form on two GPUs against the unsharded plan on this GPU (which rounds the same
    logits to bf16 between the products: the bounds are the test_linear_loss ones)."""
    from headloss.loss import LinearLossPlan
    terms, opts = LINEAR[case]
    Ht = LHT if case == "linear_jsd" else 0
    g = torch.Generator(device="cpu").manual_seed(4321)
    x = torch.randn(LN, LH, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(V, LH, generator=g) * 2.5 / LH ** 0.5).to(torch.bfloat16).cuda()
    y = torch.randint(0, V, (LN,), generator=g).cuda()
    y[::7] = -100
    kw = {}
    if Ht:
        kw["teacher_hidden"] = torch.randn(LN, Ht, generator=g).to(torch.bfloat16).cuda()
        kw["teacher_weight"] = (torch.randn(V, Ht, generator=g) * 2.5 / Ht ** 0.5).to(torch.bfloat16).cuda()
    if "grpo" in terms:
        f = lambda: (torch.randn(LN, generator=g) * 0.3).cuda()  # noqa: E731
        kw.update(advantages=f(), old_logprobs=f() - 10, ref_logprobs=f() - 10)
    f32 = dict(grad_hidden_dtype="float32", grad_weight_dtype="float32")
    whole = LinearLossPlan(V, LH, "bfloat16", terms=terms, device="cuda", teacher_hidden=Ht, **f32, **opts)
    full = whole(x, w, y, **kw)
    lo, n = (0, SPLIT) if rank == 0 else (SPLIT, V - SPLIT)
    shard = {k: (v[lo:lo + n].contiguous() if k == "teacher_weight" else v) for k, v in kw.items()}
    ws = w[lo:lo + n].contiguous()
    teach = {k: v for k, v in shard.items() if k.startswith("teacher")}  # what stats / middle take
    mk = lambda mode: LinearLossPlan(n, LH, "bfloat16", terms=terms, device="cuda", vocab_start=lo,  # noqa: E731
                                     vocab_global=V, ranks=2, teacher_hidden=Ht, grad_hidden=mode, **f32, **opts)
    plan = mk("write")
    small, fast = plan.workspace_sizes(LN)
    comm = Comm()
    outs = []
    for nbytes in (fast, small):  # fast: the logits kept for finish; small: formed again
        # 1. the caller's collectives: stats, all-gather(s), finish, the all-reduce of grad_hidden
        wsp = plan.workspace(x, LN, nbytes)
        block = plan.stats(x, ws, y, workspace=wsp, **teach)
        gathered = torch.empty(2 * block.numel(), dtype=block.dtype, device="cuda")
        dist.all_gather_into_tensor(gathered, block)
        mid = {}
        if plan.exchanges == 2:
            m = plan.middle(gathered, x, ws, y, workspace=wsp, **teach)
            mid["gathered_middle"] = torch.empty(2 * m.numel(), dtype=m.dtype, device="cuda")
            dist.all_gather_into_tensor(mid["gathered_middle"], m)
        out = plan.finish(gathered, x, ws, y, workspace=wsp, **shard, **mid)
        dist.all_reduce(out.grad_hidden)
        # 2. the library's NCCL path (outputs poisoned: an unwritten element fails)
        gh = torch.full((LN, LH), float("nan"), device="cuda")
        gw = torch.full((n, LH), float("nan"), device="cuda")
        out2 = plan.nccl(comm.ptr, x, ws, y, grad_hidden=gh, grad_weight=gw,
                         workspace=plan.workspace(x, LN, nbytes), **shard)
        torch.cuda.synchronize()
        for k in ("scalars", "grad_hidden", "grad_weight"):
            assert torch.equal(getattr(out, k), getattr(out2, k)), f"rank {rank}: {k}: NCCL path != caller's"
        ref, got = full.scalars.double().cpu().numpy(), out2.scalars.double().cpu().numpy()
        bad = np.abs(got - ref) > 1e-4 * (1 + np.abs(ref))
        assert not bad.any(), f"rank {rank}: scalars {np.flatnonzero(bad)}: {got[bad]} vs {ref[bad]}"
        assert _rel(out2.grad_hidden, full.grad_hidden) < 5e-3, f"rank {rank}: grad_hidden"
        assert _rel(out2.grad_weight, full.grad_weight[lo:lo + n]) < 5e-3, f"rank {rank}: grad_weight"
        outs.append(out2)
    # ACCUMULATE: the sum of the parts added once to what the buffer held, on every rank.
    start = torch.randn(LN, LH, generator=g).cuda()
    acc = mk("accumulate").nccl(comm.ptr, x, ws, y, grad_hidden=start.clone(), **shard)
    assert _rel(acc.grad_hidden, start + outs[0].grad_hidden) < 1e-6, f"rank {rank}: accumulated grad_hidden"
    both = torch.empty(2, LN * LH, device="cuda")
    dist.all_gather_into_tensor(both, acc.grad_hidden.view(-1))
    assert torch.equal(both[0], both[1]), "the ranks' grad_hidden differ"
    comm.destroy()


def _worker(rank: int, ranks: int, case: str) -> None:
    import torch
    import torch.distributed as dist
    from headloss.loss import LossPlan
    from nccl_comm import Comm

    if case in LINEAR:
        _linear_worker(rank, case, torch, dist, Comm)
        return
    terms, opts, tol = CASES[case]
    x, y, rows, teacher = _inputs(torch, case)
    x, y = x.cuda(), y.cuda()
    rows = {k: v.cuda() for k, v in rows.items()}
    teacher = {k: v.cuda() for k, v in teacher.items()}
    full = LossPlan(V, "bfloat16", terms=terms, device="cuda", **opts)(x, y, **rows, **teacher)
    lo, n = (0, SPLIT) if rank == 0 else (SPLIT, V - SPLIT)
    plan = LossPlan(n, "bfloat16", terms=terms, device="cuda", vocab_start=lo, vocab_global=V,
                    ranks=2, **opts)
    xs = x[:, lo:lo + n]  # a strided view: the shard's columns of the whole logits
    ts = {k: v[:, lo:lo + n] if k == "teacher_logits" else v for k, v in teacher.items()}
    # 1. the caller's collective(s)
    block = plan.stats(xs, y, **ts)
    gathered = torch.empty(2 * block.numel(), dtype=block.dtype, device="cuda")
    dist.all_gather_into_tensor(gathered, block)
    mid = {}
    if plan.exchanges == 2:
        m = plan.middle(gathered, xs, y, **ts)
        mid["gathered_middle"] = torch.empty(2 * m.numel(), dtype=m.dtype, device="cuda")
        dist.all_gather_into_tensor(mid["gathered_middle"], m)
    out = plan.finish(gathered, xs, y, **rows, **ts, **mid)
    # 2. the library's NCCL path
    comm = Comm()
    out2 = plan.nccl(comm.ptr, xs, y, **rows, **ts)
    torch.cuda.synchronize()
    ref, got = full.scalars.double().cpu().numpy(), out.scalars.double().cpu().numpy()
    bad = np.abs(got - ref) > tol * np.maximum(np.abs(ref), 1e-3)
    assert not bad.any(), f"rank {rank}: scalars {np.flatnonzero(bad)}: {got[bad]} vs {ref[bad]}"
    g_ref = full.grad[:, lo:lo + n].double()
    err = (out.grad.double() - g_ref).norm() / g_ref.norm()
    assert err <= 1e-5, f"rank {rank}: gradient differs by {err:.2e}"
    assert torch.equal(out.scalars, out2.scalars) and torch.equal(out.grad, out2.grad)
    # Every rank has the same scalars.
    both = torch.empty(2, out.scalars.numel(), device="cuda")
    dist.all_gather_into_tensor(both, out.scalars)
    assert torch.equal(both[0], both[1])
    # A plan for three ranks on this two-rank communicator is refused.
    three = LossPlan(n, "bfloat16", terms=terms, device="cuda", vocab_start=lo, vocab_global=V,
                     ranks=3, **opts)
    try:
        three.nccl(comm.ptr, xs, y, **rows, **ts)
        raise AssertionError("a 3-rank plan ran on a 2-rank communicator")
    except headloss.HeadlossError as e:
        assert "communicator has 2 ranks" in str(e), str(e)
    comm.destroy()


@pytest.mark.parametrize("case", list(CASES) + list(LINEAR))
def test_two_gpus_match_the_unsharded_loss(case):
    torch = pytest.importorskip("torch")
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("PyTorch has no NCCL")
    run_ranks(_worker, 2, case, backend="nccl", timeout=180)
