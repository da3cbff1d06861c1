"""The in-place pairs headloss.h allows give the same bits as separate buffers: RMSNorm's y = x,
residual_out = residual, dx = dy and dx = dresidual_out, and the loss's grad = logits (whole, and
in the split's finish), on the CPU backend and, with a GPU, across the CUDA kernels' paths (the
backend fixture skips those without one). The refused overlaps are tests/c's."""
import numpy as np
import pytest

import headloss
from headloss.loss import LossPlan
from test_loss import NP_DTYPES, be, build, run_lib  # noqa: F401  (be: the backend fixture)

EPS = 1e-5

# (rows, cols) for RMSNorm on CUDA: the register kernels (short rows with staged loads, 1024 with
# prefetch, 4096, 16K rows in clusters), rows past them (the forward's row-by-row kernel, the
# backward's tiles) and unaligned rows (element-wise). The CPU takes the small ones.
RMS_GPU = [(3000, 64), (700, 1024), (300, 4096), (64, 16384), (16, 40000), (4, 262144), (33, 1003)]
RMS_CPU = [(3000, 64), (33, 1003), (4, 16384)]


def bits(be, x):
    """x's values as float64 bit patterns (float64 holds every fp32, fp16 and bf16 value exactly,
    the sign of zero included)."""
    return be.to_np(x).view(np.uint64)


def same(be, a, b):
    return np.array_equal(bits(be, a), bits(be, b))


def shapes(be):
    return RMS_GPU if be.name == "cuda" else RMS_CPU


def draw(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NP_DTYPES[dtype])


@pytest.mark.parametrize("xdt", ["float32", "bfloat16"])
@pytest.mark.parametrize("cast", ["llama", "gemma"])
def test_rmsnorm_forward(be, rng, xdt, cast):
    for rows, cols in shapes(be):
        x, r = draw(rng, (rows, cols), xdt), draw(rng, (rows, cols), xdt)
        w = be.to_dev((1 + 0.5 * rng.standard_normal(cols)).astype(NP_DTYPES[xdt]))
        kw = dict(eps=EPS, cast=cast)
        what = f"{rows}x{cols} {xdt} {cast}"
        sep = headloss.rmsnorm_fwd(be.to_dev(x), w, **kw)
        xb = be.to_dev(x.copy())
        headloss.rmsnorm_fwd(xb, w, out=xb, **kw)
        assert same(be, xb, sep.y), what
        sep = headloss.rmsnorm_fwd(be.to_dev(x), w, residual=be.to_dev(r), return_rstd=True, **kw)
        xb, rb = be.to_dev(x.copy()), be.to_dev(r.copy())
        got = headloss.rmsnorm_fwd(be.to_dev(x), w, residual=rb, residual_out=rb, return_rstd=True, **kw)
        assert same(be, rb, sep.residual_out) and same(be, got.y, sep.y), what
        rb = be.to_dev(r.copy())
        got = headloss.rmsnorm_fwd(xb, w, residual=rb, out=xb, residual_out=rb, return_rstd=True, **kw)
        assert same(be, xb, sep.y) and same(be, rb, sep.residual_out), what
        assert same(be, got.rstd, sep.rstd), what


@pytest.mark.parametrize("xdt", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_rstd", [False, True])
def test_rmsnorm_backward(be, rng, xdt, with_rstd):
    for rows, cols in shapes(be):
        x, dy, dro = (draw(rng, (rows, cols), xdt) for _ in range(3))
        w = be.to_dev((1 + 0.5 * rng.standard_normal(cols)).astype(np.float32))
        rstd = headloss.rmsnorm_fwd(be.to_dev(x), eps=EPS, return_rstd=True).rstd if with_rstd else None
        xd = be.to_dev(x)
        what = f"{rows}x{cols} {xdt} rstd={with_rstd}"
        sep = headloss.rmsnorm_bwd(be.to_dev(dy), xd, w, rstd, eps=EPS)
        db = be.to_dev(dy.copy())
        got = headloss.rmsnorm_bwd(db, xd, w, rstd, eps=EPS, dx=db)
        assert same(be, db, sep.dx) and same(be, got.dw, sep.dw), what
        sep = headloss.rmsnorm_bwd(be.to_dev(dy), xd, w, rstd, eps=EPS, dresidual_out=be.to_dev(dro))
        rb = be.to_dev(dro.copy())
        got = headloss.rmsnorm_bwd(be.to_dev(dy), xd, w, rstd, eps=EPS, dresidual_out=rb, dx=rb)
        assert same(be, rb, sep.dx) and same(be, got.dw, sep.dw), what


# The loss's row kernel: raw logits, a soft-cap, a dense teacher, dense JSD's middle pass, a sparse
# teacher (its k logits gathered before any gradient is written) and GSPO (a statistics step, then
# a finish that reads the logits again). Rows of 1001 columns are not 16-byte aligned (no bulk
# copies); 32000 and 2^21 columns are (2^21 is too long to keep in shared memory).
LOSS_CASES = ["ce", "ce_smooth_weights_cap", "all", "jsd_ce", "sparse_rl", "gspo_all"]


@pytest.mark.parametrize("case", LOSS_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_grad_over_logits(be, rng, case, dtype):
    sizes = [(64, 1001), (64, 32000), (4, 1 << 21)] if be.name == "cuda" else [(24, 300)]
    for N, V in sizes:
        if V > 32000 and case != "ce":
            continue
        terms, opts, inp = build(rng, N, V, dtype, case)
        sep = run_lib(be, inp, terms, opts)
        got = run_lib(be, {k: v.copy() for k, v in inp.items()}, terms, opts, in_place=True)
        for k, (a, b) in enumerate(zip(sep, got)):
            a, b = (a, b) if k == 2 else (np.array(list(a.values())), np.array(list(b.values())))
            assert np.array_equal(a.view(np.uint64), b.view(np.uint64)), f"{case} {N}x{V} output {k}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_split_finish_over_logits(be, rng, dtype):
    """Two shards' finish writes each shard's gradient over its logits: the same bits as into a
    gradient buffer."""
    N, V = 37, 1000
    terms, opts, inp = build(rng, N, V, dtype, "all")
    shards = [(0, 389), (389, V - 389)]
    plans = [LossPlan(s[1], dtype, terms=terms, device=be.name, vocab_start=s[0], vocab_global=V, ranks=2,
                      **opts) for s in shards]
    dev = {k: be.to_dev(v) for k, v in inp.items() if k not in ("logits", "teacher_logits")}
    labels = dev.pop("labels")
    cols = lambda key, s: np.ascontiguousarray(inp[key][:, s[0]:s[0] + s[1]])  # noqa: E731
    blocks = [p.stats(be.to_dev(cols("logits", s)), labels, teacher_logits=be.to_dev(cols("teacher_logits", s)))
              for p, s in zip(plans, shards)]
    gathered = np.concatenate(blocks) if be.name == "cpu" else be.torch.cat(blocks)
    for p, s in zip(plans, shards):
        teacher = be.to_dev(cols("teacher_logits", s))
        sep = p.finish(gathered, be.to_dev(cols("logits", s)), labels, teacher_logits=teacher, **dev)
        logits = be.to_dev(cols("logits", s))
        got = p.finish(gathered, logits, labels, teacher_logits=teacher, in_place=True, **dev)
        assert same(be, logits, sep.grad) and same(be, got.scalars, sep.scalars), s
