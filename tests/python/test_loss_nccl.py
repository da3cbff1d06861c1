"""The sharded loss on two GPUs, one process each: the caller's collective
(stats -> torch.distributed.all_gather_into_tensor -> finish) and hl_loss_plan_execute_nccl on a
raw NCCL communicator, both against the unsharded plan on the whole vocabulary (scalars within
1e-6, fp32 gradient within 1e-5) and bit-identical to each other. Skips without two GPUs."""
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import headloss

N, V, SPLIT = 1000, 50257, 20011  # an odd vocabulary, uneven shards
TERMS = ("ce", "z", "entropy", "grpo", "kl_ref")
OPTS = dict(z_weight=1e-3, entropy_weight=-0.1, kl_ref_beta=0.05, label_smoothing=0.1, softcap=30.0,
            grad_dtype="float32")  # an fp32 gradient: the bound is on the merge, not on bf16 rounding


def _inputs(torch):
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    f = lambda: torch.randn(N, generator=g) * 0.3  # noqa: E731
    return x, y, dict(advantages=f(), old_logprobs=f() - 10, ref_logprobs=f() - 10)


def _worker(rank: int, init: str, errors: str) -> None:
    try:
        import torch
        import torch.distributed as dist
        from headloss.loss import LossPlan
        from nccl_comm import Comm

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2,
                                device_id=torch.device("cuda", rank))
        x, y, rows = _inputs(torch)
        x, y = x.cuda(), y.cuda()
        rows = {k: v.cuda() for k, v in rows.items()}
        full = LossPlan(V, "bfloat16", terms=TERMS, device="cuda", **OPTS)(x, y, **rows)
        lo, n = (0, SPLIT) if rank == 0 else (SPLIT, V - SPLIT)
        plan = LossPlan(n, "bfloat16", terms=TERMS, device="cuda", vocab_start=lo, vocab_global=V,
                        ranks=2, **OPTS)
        xs = x[:, lo:lo + n]  # a strided view: the shard's columns of the whole logits
        # 1. the caller's collective
        block = plan.stats(xs, y)
        gathered = torch.empty(2 * block.numel(), dtype=block.dtype, device="cuda")
        dist.all_gather_into_tensor(gathered, block)
        out = plan.finish(gathered, xs, y, **rows)
        # 2. the library's NCCL path
        comm = Comm()
        out2 = plan.nccl(comm.ptr, xs, y, **rows)
        torch.cuda.synchronize()
        ref, got = full.scalars.double().cpu().numpy(), out.scalars.double().cpu().numpy()
        bad = np.abs(got - ref) > 1e-6 * np.maximum(np.abs(ref), 1e-3)
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
        three = LossPlan(n, "bfloat16", terms=TERMS, device="cuda", vocab_start=lo, vocab_global=V,
                         ranks=3, **OPTS)
        try:
            three.nccl(comm.ptr, xs, y, **rows)
            raise AssertionError("a 3-rank plan ran on a 2-rank communicator")
        except headloss.HeadlossError as e:
            assert "communicator has 2 ranks" in str(e), str(e)
        comm.destroy()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        Path(errors, f"rank{rank}").write_text(f"{type(e).__name__}: {e}")
        raise


def test_two_gpus_match_the_unsharded_loss():
    torch = pytest.importorskip("torch")
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("PyTorch has no NCCL")
    import torch.multiprocessing as mp
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, f"file://{tmp}/init", tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        for p in procs:  # a rank stuck in a collective whose peer died
            if p.is_alive():
                p.kill()
        msgs = [f.read_text() for f in sorted(Path(tmp).glob("rank*"))]
        assert not msgs, "; ".join(msgs)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

