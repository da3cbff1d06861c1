"""gdn_bwd_dqkwg (headloss CUDA) against flash-linear-attention's Triton chunk_bwd_dqkwg, side by side.

bf16 inputs, h/dh in bf16 (fla's default) unless a row says fp32 states, log2-unit gate (fla 0.6),
w/dv on (dw produced). Shapes: four dense ones (B, T, H, K = V), a varlen batch, GVA (value heads 2x the q/k heads as
Qwen3-Next, 8x at K = 128, 4x at K = 256), fp32 states, fla's state_v_first layout, K = V = 100,
K = 100 with V = 128, V = 100 with K = 128 and K = V = 99 (not multiples of 8: the Hopper kernel maps
q, k, do, v, dv folded, [tokens][H K], and copies the states TMA cannot map by hand), and 15 heads of
K = V = 100 (H K not a multiple of 8 either: q, k, do, v, dv copied by hand), of 99 (2-byte copies), and
fp32 states in rows of 98 and 99 floats (two and one a load).
fla refuses to run on Hopper with Triton 3.4-3.7.0 (a miscompile); for timing only, this script
bypasses that guard by patching the module flag, and reports how far fla's output is from ours (fla's
dg is off at the last token of a partial chunk, hence on varlen: bench/notes/gdn.md, "GDN v6").
HBM floor: q, k, v, do, h, dh, dv read once, dq, dk, dw, dg written once (w is not read by either
kernel), over the device-to-device copy bandwidth measured in the same run.
Usage: python bench/bench_gdn.py [--out table.md] [--only SUBSTRING ...]
fla autotunes its kernel for every row's shape: all rows take ~14 minutes on the H100, over
tools/device.sh's 300 s a benchmark (in 400 s the first ten rows ran), so run them in parts with --only.
"""
from __future__ import annotations

import argparse
import sys

import torch

import headloss
from headloss import gdn_bwd_dqkwg
from common import copy_bandwidth_gbs, header, median_ms

SHAPES = [(16, 1024, 8, 256), (16, 4096, 8, 256), (8, 4096, 16, 128), (4, 8192, 32, 128)]
VARLEN = (32768, 16, 128)  # total tokens, heads, K = V; random sequence lengths
GVA = [  # B, T, q/k heads, value heads, K = V
    ("Qwen3-Next GVA 2x", (4, 8192, 16, 32, 128)),  # Qwen3-Next's linear attention
    ("GVA 8x", (4, 8192, 4, 32, 128)),
    ("GVA 4x", (4, 4096, 4, 16, 256)),
]
STATES = [  # B, T, H, K (= V unless given) with fp32 states / fla's state_v_first layout / K, V not multiples of 8
    ("fp32 states", (8, 4096, 16, 128), dict(h_dtype=torch.float32)),
    ("state_v_first", (8, 4096, 16, 128), dict(vf=True)),
    ("Qwen3-Next GVA 2x, state_v_first", (4, 8192, 16, 128), dict(vf=True, HV=32)),
    ("odd K = V (Hopper kernel: folded maps, states by hand)", (8, 4096, 16, 100), {}),
    ("odd K, V = 128 (Hopper kernel: folded q, k)", (8, 4096, 16, 100), dict(V=128)),
    ("odd V, K = 128 (Hopper kernel: folded do, v, dv, states by hand)", (8, 4096, 16, 128), dict(V=100)),
    ("odd K = V = 99 (Hopper kernel: states element by element)", (8, 4096, 16, 99), {}),
    ("odd K = V, 15 heads (Hopper kernel: q, k, do, v, dv copied by hand)", (8, 4096, 15, 100), {}),
    ("odd V, 15 heads (Hopper kernel: do, v, dv copied by hand)", (8, 4096, 15, 128), dict(V=100)),
    ("odd K = V = 99, 15 heads (Hopper kernel: 2-byte copies by hand)", (8, 4096, 15, 99), {}),
    ("fp32 states, V = 98 (two floats a load)", (8, 4096, 16, 128), dict(h_dtype=torch.float32, V=98)),
    ("fp32 states, V = 99, 15 heads (one float a load; do, v, dv by hand)", (8, 4096, 15, 128),
     dict(h_dtype=torch.float32, V=99)),
]


def inputs(B, T, H, K, cu=None, HV=None, V=None, h_dtype=torch.bfloat16, vf=False, dev="cuda"):
    HV, V, bf = HV or H, V or K, torch.bfloat16
    nt = (T + 63) // 64 if cu is None else int(((cu[1:] - cu[:-1] + 63) // 64).sum())
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    v, do, dv = (torch.randn(B, T, HV, V, device=dev, dtype=bf) for _ in range(3))
    state = (B, nt, HV, V, K) if vf else (B, nt, HV, K, V)
    h = torch.randn(*state, device=dev, dtype=h_dtype)
    dh = torch.randn(*state, device=dev, dtype=h_dtype) * 0.1
    w = torch.randn(B, T, HV, K, device=dev, dtype=bf)
    ls = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev) + 2) / 0.6931471805599453
    g = torch.empty_like(ls)  # chunk-local cumsum: restarts every 64 tokens of every sequence
    bounds = [(0, T)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for lo, hi in bounds:
        for t0 in range(lo, hi, 64):
            g[:, t0:min(t0 + 64, hi)] = ls[:, t0:min(t0 + 64, hi)].cumsum(1)
    return dict(q=q, k=k, v=v, do=do, dv=dv, h=h, dh=dh, w=w, g=g, vf=vf)


def floor_bytes(x):
    n = sum(x[k].numel() * x[k].element_size() for k in ("q", "k", "v", "do", "h", "dh", "dv"))
    n += 2 * x["q"].numel() * 2 + x["w"].numel() * 2 + x["g"].numel() * 4  # dq, dk, dw, dg
    return n


def fla_fn(x, scale, cu=None):
    try:
        import fla.ops.common.chunk_o as co
        from fla.ops.utils import prepare_chunk_indices
    except Exception as e:  # noqa: BLE001
        print(f"fla unavailable: {e}", file=sys.stderr)
        return None
    co.TRITON_ABOVE_3_4_0 = False  # bypass the Hopper guard, for timing only
    ci = None if cu is None else prepare_chunk_indices(cu, 64)
    return lambda: co.chunk_bwd_dqkwg(q=x["q"], k=x["k"], v=x["v"], do=x["do"], h=x["h"], dh=x["dh"], w=x["w"],
                                      g=x["g"], dv=x["dv"], scale=scale, cu_seqlens=cu, chunk_indices=ci,
                                      state_v_first=x["vf"])


def ours_fn(x, cu=None):
    # Unchecked, as fla (whose chunk_indices are prepared outside the timing): the varlen call's
    # chunk table is built on the device, without the checked call's stream synchronisation.
    K = x["q"].shape[-1]
    return lambda: gdn_bwd_dqkwg(x["q"], x["k"], x["v"], x["do"], x["h"], x["dh"], scale=K ** -0.5, g=x["g"],
                                 gate_log2=True, dv=x["dv"], cu_seqlens=cu, check=False, state_v_first=x["vf"])


def varlen_cu(T):
    """cu_seqlens of the varlen batch: 64 sequences of random lengths, T tokens in all (fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    cuts = torch.sort(torch.randperm(T - 1, generator=gen)[:63] + 1).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to("cuda", torch.long)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench_one(label, x, bw, cu=None):
    K = x["q"].shape[-1]
    scale = K ** -0.5
    ours = ours_fn(x, cu)
    t_ours = median_ms(ours, iters=30, warmup=5)
    floor_ms = floor_bytes(x) / bw / 1e6
    f = fla_fn(x, scale, cu)
    t_fla, err = float("nan"), "n/a"
    if f is not None:
        try:
            t_fla = median_ms(f, iters=30, warmup=5)
            a, b = ours(), f()
            err = " ".join(f"{n}={rel(p, r):.1e}" for n, p, r in zip(("dq", "dk", "dw", "dg"), a, b))
        except Exception as e:  # noqa: BLE001
            err = f"fla failed: {type(e).__name__}: {str(e)[:80]}"
    row = (f"| {label} | {floor_bytes(x) / 1e9:.2f} GB | {floor_ms:.3f} | {t_fla:.3f} | {t_ours:.3f} | "
           f"{t_fla / t_ours:.2f}x | {100 * floor_ms / t_ours:.0f}% | {err} |")
    print(row, flush=True)
    return row


def cases():
    """(label, inputs thunk, cu_seqlens) of every row, in table order."""
    for B, T, H, K in SHAPES:
        yield f"{B}, {T}, {H}, {K}", lambda B=B, T=T, H=H, K=K: inputs(B, T, H, K), None
    T, H, K = VARLEN
    cu = varlen_cu(T)
    yield f"varlen 64 seqs, {T}, {H}, {K}", lambda: inputs(1, T, H, K, cu), cu
    for name, (B, T, H, HV, K) in GVA:
        yield (f"{name}: {B}, {T}, {H} q/k heads, {HV} value heads, {K}",
               lambda B=B, T=T, H=H, HV=HV, K=K: inputs(B, T, H, K, HV=HV), None)
    for name, (B, T, H, K), kw in STATES:
        yield f"{name}: {B}, {T}, {H}, {K}", lambda B=B, T=T, H=H, K=K, kw=kw: inputs(B, T, H, K, **kw), None


def shape_cases(specs):
    """(label, inputs thunk, None) of shapes written BxTxHxKxV (--shapes, and the GDN experiments)."""
    for spec in specs:
        B, T, H, K, V = (int(v) for v in spec.split("x"))
        yield f"{B}, {T}, {H}, K = {K}, V = {V}", lambda B=B, T=T, H=H, K=K, V=V: inputs(B, T, H, K, V=V), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*", help="rows whose label contains one of these")
    ap.add_argument("--shapes", nargs="*", default=[], help="BxTxHxKxV shapes to run (alone, unless with --only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth_gbs()
    lines = [f"# gdn_bwd_dqkwg vs fla chunk_bwd_dqkwg ({torch.cuda.get_device_name()}, bf16, h bf16 unless "
             f"fp32 states, log2 gate, dw on; copy bandwidth {bw:.0f} GB/s; fla guard bypassed for timing)", "",
             header(), "",
             "| B, T, H, K=V | bytes | HBM floor ms | fla ms | headloss ms | speed-up | % of floor | ours vs fla |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows = [c for c in cases() if (args.only is None and not args.shapes) or any(o in c[0] for o in args.only or [])]
    for label, make, cu in rows + list(shape_cases(args.shapes)):
        lines.append(bench_one(label, make(), bw, cu))
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
