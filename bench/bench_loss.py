"""Benchmark of the fused loss plan against its peers on one GPU, side by side in one run.

Rows: N x V bf16 logits. Columns: the time of a device-to-device copy of the logits (the floor:
one read + one write), headloss CE with gradient (and % of the copy bandwidth), headloss CE + z,
headloss CE + z + entropy + GRPO + KL-ref with every metric and per-token output (and its ratio
to CE alone), every policy-gradient option on top (GRPO's dual clip, CISPO, the k2 KL estimator;
its ratio to CE alone: issue #31's one-pass bar is <= 1.02x), then a sequence-level rollout
correction on top (MIS over each sequence's geometric-mean ratio: a sequence kernel from the inputs,
still one pass), then GSPO on top of that (the sequence ratio needs every row's log-prob before any
gradient: statistics and finish, two passes over the logits; its floor is 1.5 copies), Liger CE + z
(if importable), torch.compile and eager PyTorch CE + z + entropy (forward + backward), and
torch.compile of the RL plans' terms: CE + z + entropy + clipped GRPO + k3 KL with their metrics
(ratio mean, clip fraction, KL mean), and the same with GSPO's sequence ratio (verl's GSPO-token),
and Liger's Triton GRPO loss on logits (GRPO + k3 KL, token and sequence importance sampling).
Sequences: 512 rows each. Times are medians of CUDA-event timings after warm-up. Fast-LLM's
GRPO / GSPO: not on PyPI (a source checkout with its own build), so not a column.

Usage: python3 bench/bench_loss.py [--out table.md] [--shapes 8192x32000,...] [--no-compile]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import headloss  # noqa: E402
from common import compile_per_shape, median_ms  # noqa: E402
from headloss import loss as hloss  # noqa: E402

SHAPES = "8192x32000,8192x128256,4096x262144,65536x32000"


class Direct:
    """One plan with its arguments built once, so the timed call is the C call alone."""

    def __init__(self, logits, labels, terms, extra=None, token_outputs=False, **opts):
        N, V = logits.shape
        self.plan = hloss.LossPlan(V, "bfloat16", terms=terms, device="cuda", check=False, **opts)
        self.grad = torch.empty_like(logits)
        self.scalars = torch.empty(len(hloss.SCALARS), device="cuda")
        a = hloss._Args(ctypes.sizeof(hloss._Args), N, logits.data_ptr(), V)
        a.labels = labels.data_ptr()
        for k, t in (extra or {}).items():
            setattr(a, k, t.data_ptr())
            if k == "cu_seqlens":
                a.num_seqs = t.numel() - 1
        a.grad, a.grad_stride, a.scalars = self.grad.data_ptr(), V, self.scalars.data_ptr()
        self.toks = []
        if token_outputs:
            self.toks = [torch.empty(N, device="cuda") for _ in range(4)]
            a.token_loss, a.token_logp, a.token_entropy, a.token_lse = (t.data_ptr() for t in self.toks)
        self.args = a
        self.nbytes = self.plan.workspace_bytes(N)
        self.ws = torch.empty(self.nbytes // 4 + 4, device="cuda")
        self.stream = torch.cuda.current_stream().cuda_stream

    def __call__(self):
        hloss._check(hloss._execute(self.plan._handle, ctypes.byref(self.args), self.ws.data_ptr(),
                                   self.nbytes, self.stream))


def torch_ce_z_ent(logits, labels):
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    ce = torch.nn.functional.cross_entropy(x, labels, ignore_index=-100)
    p = torch.softmax(x, -1)
    ent = (lse - (p * x).sum(-1)).mean()
    return ce + 1e-4 * (lse ** 2).mean() - 1e-2 * ent


def torch_rl(logits, labels, adv, old, ref, seg=None, nseq=0):
    """The all-terms plan in PyTorch: CE + z + entropy + clipped GRPO + k3 KL-to-reference, the loss
    and three metrics; seg (the sequence of each row): GSPO's ratio, exp(mean log-ratio over the
    sequence) with each token's own gradient."""
    x = logits.float()
    valid = labels >= 0
    lse = torch.logsumexp(x, -1)
    logp = x.gather(-1, labels.clamp(min=0)[:, None])[:, 0] - lse
    p = torch.softmax(x, -1)
    ent = lse - (p * x).sum(-1)
    lr = logp - old
    if seg is not None:
        v = valid.float()
        seq = torch.zeros(nseq, device=x.device).index_add(0, seg, lr.detach() * v)
        n = torch.zeros(nseq, device=x.device).index_add(0, seg, v).clamp(min=1)
        lr = logp - logp.detach() + (seq / n)[seg]
    r = torch.exp(lr)
    pg = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    d = ref - logp
    kl = torch.exp(d) - d - 1
    tok = -logp + 1e-4 * lse * lse - 1e-2 * ent + pg + 0.04 * kl
    w = valid.float()
    cnt = w.sum()
    metrics = torch.stack([(r.detach() * w).sum(), (((r < 0.8) | (r > 1.2)).float() * w).sum(),
                           (kl.detach() * w).sum()]) / cnt
    return (tok * w).sum() / cnt, metrics


def fwd_bwd(fn, logits, labels):
    def run():
        logits.grad = None
        fn(logits, labels).backward()
    return run


def liger_ce_z():
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception as e:  # noqa: BLE001
        print(f"# Liger unavailable: {type(e).__name__}: {e}", flush=True)
        return None
    return LigerCrossEntropyLoss(lse_square_scale=1e-4, return_z_loss=False)


def liger_grpo():
    """Liger's Triton GRPO loss on logits (liger_kernel.transformers.grpo_loss): GRPO + k3 KL, DAPO
    token mean, its kl_mean and clip_ratio metrics; importance_sampling_level "sequence" is GSPO."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as e:  # noqa: BLE001
        print(f"# Liger GRPO unavailable: {type(e).__name__}: {e}", flush=True)
        return None
    return triton_grpo_loss


def time_liger_grpo(grpo, N, V, L=512):
    """Liger GRPO forward + backward on N rows (N / L sequences of L tokens; its logits are
    [B, L + 1, V], the last position dropped) at token and sequence level: two times in ms."""
    B = N // L
    x = (torch.randn(B, L + 1, V, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, V, (B, L), device="cuda")
    old, ref = (-torch.rand(B, L, device="cuda") * 8 - 4 for _ in range(2))
    adv, mask = torch.randn(B, device="cuda"), torch.ones(B, L, device="cuda", dtype=torch.bool)
    times = []
    for level in ("token", "sequence"):
        def run(level=level):
            x.grad = None
            loss, _ = grpo(x, old, ref, ids, adv, mask, temperature=1.0, beta=0.04, eps_low=0.2, eps_high=0.2,
                           loss_type="dapo", importance_sampling_level=level, reduce=True)
            loss.backward()
        times.append(median_ms(run, iters=20))
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--peer-max-elems", type=float, default=1.1e9, help="skip eager/compile above this N*V")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    liger, grpo = liger_ce_z(), liger_grpo()
    compiled = None if args.no_compile else compile_per_shape(torch_ce_z_ent)
    compiled_rl = None if args.no_compile else compile_per_shape(torch_rl)
    head = ("| N x V | copy floor | CE+grad | % of copy BW | CE+z | CE+z+H+GRPO+KL+metrics | ratio to CE | "
            "+ dual clip, CISPO, k2 | ratio to CE | + MIS (seq) | ratio to CE | + GSPO (2 passes) | ratio to CE | "
            "Liger CE+z | CE vs Liger | torch.compile CE+z+H | eager CE+z+H | torch.compile RL | vs ours | "
            "torch.compile GSPO | vs ours | Liger GRPO+KL | vs ours | Liger GSPO+KL | vs ours |")
    lines = [f"Device: {dev}; bf16 logits, bf16 gradient to its own buffer; headloss library "
             f"{headloss.version()}; median of CUDA-event timings (ms).", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    print("\n".join(lines), flush=True)
    for shape in args.shapes.split(","):
        N, V = map(int, shape.split("x"))
        logits = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
        labels = torch.randint(0, V, (N,), device="cuda")
        labels[::17] = -100
        adv = torch.randn(N, device="cuda")
        old = -torch.rand(N, device="cuda") * 8 - 4
        ref = -torch.rand(N, device="cuda") * 8 - 4
        copy_dst = torch.empty_like(logits)
        t_copy = median_ms(lambda: copy_dst.copy_(logits))
        del copy_dst
        ce = Direct(logits, labels, ("ce",))
        t_ce = median_ms(ce)
        del ce
        cez = Direct(logits, labels, ("ce", "z"), z_weight=1e-4)
        t_cez = median_ms(cez)
        del cez
        rows = {"advantages": adv, "old_logprobs": old, "ref_logprobs": ref}
        full = Direct(logits, labels, ("ce", "z", "entropy", "grpo", "kl_ref"), rows,
                      token_outputs=True, z_weight=1e-4, entropy_weight=-1e-2, kl_ref_beta=0.04)
        t_full = median_ms(full)
        del full
        rl = Direct(logits, labels, ("ce", "z", "entropy", "grpo", "cispo", "kl_ref"), rows,
                    token_outputs=True, z_weight=1e-4, entropy_weight=-1e-2, kl_ref_beta=0.04,
                    dual_clip=3.0, cispo_weight=0.5, cispo_eps_high=4.0, kl_estimator="k2")
        t_rl = median_ms(rl)
        del rl
        seq_rows = dict(rows, rollout_logprobs=old + 0.1 * torch.randn(N, device="cuda"),
                        cu_seqlens=torch.arange(0, N + 512, 512, device="cuda", dtype=torch.int32).clamp_(max=N))
        t_seq = {}
        for name, level in (("mis", "token"), ("gspo", "seq_mean")):
            p = Direct(logits, labels, ("ce", "z", "entropy", "grpo", "cispo", "kl_ref"), seq_rows,
                       token_outputs=True, z_weight=1e-4, entropy_weight=-1e-2, kl_ref_beta=0.04,
                       dual_clip=3.0, cispo_weight=0.5, cispo_eps_high=4.0, kl_estimator="k2",
                       rollout_correction="mis", rollout_level="seq_mean", ratio_level=level)
            t_seq[name] = median_ms(p)
            del p
        torch.cuda.empty_cache()
        t_liger = t_comp = t_eager = t_crl = t_cgspo = None
        if liger is not None:
            x = logits.detach().requires_grad_(True)
            t_liger = median_ms(fwd_bwd(lambda a, b: liger(a, b), x, labels))
            del x
        t_lgrpo, t_lgspo = time_liger_grpo(grpo, N, V) if grpo is not None and N % 512 == 0 else (None, None)
        torch.cuda.empty_cache()
        small = N * V <= args.peer_max_elems
        if small:
            x = logits.detach().requires_grad_(True)
            if compiled is not None:
                t0 = time.time()
                fwd_bwd(compiled, x, labels)()
                print(f"# torch.compile warm-up {time.time() - t0:.1f} s", flush=True)
                t_comp = median_ms(fwd_bwd(compiled, x, labels), iters=10)
            t_eager = median_ms(fwd_bwd(torch_ce_z_ent, x, labels), iters=5, warmup=1)
            if compiled_rl is not None:
                cu = seq_rows["cu_seqlens"].long()
                seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device="cuda"), cu.diff())
                rl_args = (adv, old, ref)
                for name, extra in (("rl", ()), ("gspo", (seg, cu.numel() - 1))):
                    fn = lambda a, b, extra=extra: compiled_rl(a, b, *rl_args, *extra)[0]  # noqa: E731
                    fwd_bwd(fn, x, labels)()
                    t = median_ms(fwd_bwd(fn, x, labels), iters=10)
                    t_crl, t_cgspo = (t, t_cgspo) if name == "rl" else (t_crl, t)
            del x
        torch.cuda.empty_cache()
        f = lambda t: "n/a" if t is None else f"{t:.3f}"  # noqa: E731
        r = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
        line = (f"| {N} x {V} | {t_copy:.3f} | {t_ce:.3f} | {100 * t_copy / t_ce:.0f}% | {t_cez:.3f} | "
                f"{t_full:.3f} | {t_full / t_ce:.3f} | {t_rl:.3f} | {t_rl / t_ce:.3f} | {t_seq['mis']:.3f} | "
                f"{t_seq['mis'] / t_ce:.3f} | {t_seq['gspo']:.3f} | {t_seq['gspo'] / t_ce:.3f} | "
                f"{f(t_liger)} | {r(t_liger, t_ce)} | "
                f"{f(t_comp)} | {f(t_eager)} | {f(t_crl)} | {r(t_crl, t_rl)} | {f(t_cgspo)} | "
                f"{r(t_cgspo, t_seq['gspo'])} | {f(t_lgrpo)} | {r(t_lgrpo, t_full)} | {f(t_lgspo)} | "
                f"{r(t_lgspo, t_seq['gspo'])} |")
        lines.append(line)
        print(line, flush=True)
        del logits
        torch.cuda.empty_cache()
    lines += ["", "copy floor: torch copy_ of the logits (1 read + 1 write). CE vs Liger: Liger's time over "
              "ours (>1: we are faster). Labels unchecked (HL_LOSS_UNCHECKED) as the peers do. Liger GRPO+KL / GSPO+KL: "
              "Liger's Triton GRPO loss (token / sequence importance sampling, k3 KL, DAPO mean, its two metrics; "
              "sequences of 512 tokens) against our CE+z+H+GRPO+KL+metrics plan / our GSPO plan, which compute more "
              "terms."]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
