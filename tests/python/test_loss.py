"""The fused loss plan against the fp64 NumPy reference (ref_loss.py): every term alone and in
combinations, masks, weights, smoothing, soft-cap, every dtype, gradient modes; CPU backend always,
CUDA when a GPU and PyTorch are present. Outputs are NaN-poisoned before each run."""
import math
import zlib

import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS, LossPlan
from ref_loss import reference, total_loss

ml_dtypes = pytest.importorskip("ml_dtypes")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
GRAD_TOL = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}


class CpuBackend:
    name = "cpu"

    def to_dev(self, x):
        return x

    def full(self, shape, dtype, value=np.nan):
        return np.full(shape, value, dtype=NP_DTYPES.get(dtype, dtype))

    def to_np(self, x):
        return np.asarray(x).astype(np.float64)


class TorchBackend:
    name = "cuda"

    def __init__(self):
        import torch
        self.torch = torch

    def to_dev(self, x):
        t = self.torch
        if x.dtype == ml_dtypes.bfloat16:
            return t.from_numpy(x.view(np.uint16).astype(np.int16)).view(t.bfloat16).cuda()
        return t.from_numpy(np.ascontiguousarray(x)).cuda()

    def full(self, shape, dtype, value=np.nan):
        return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device="cuda")

    def to_np(self, x):
        return x.detach().float().cpu().numpy().astype(np.float64)


def _cuda_backend():
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("the CUDA tests need PyTorch")
    if not headloss.cuda_available():
        pytest.skip("no GPU visible (or the library was built without CUDA)")
    return TorchBackend()


@pytest.fixture(params=["cpu", "cuda"])
def be(request):
    return CpuBackend() if request.param == "cpu" else _cuda_backend()


def make_inputs(rng, N, V, dtype, *, labels="int64", weights=False, teacher=False, grpo=False,
                ref=False, rollout=False, seqs=None, scale=2.0, topk=0):
    z = (rng.standard_normal((N, V)) * scale).astype(NP_DTYPES[dtype])
    inp = {"logits": z}
    if labels:
        y = rng.integers(0, V, N)
        y[::5] = -100
        y[1] = 7  # ignored when a test sets ignore_index=7
        inp["labels"] = y.astype(labels)
    if weights:
        inp["weights"] = rng.uniform(0.25, 2.0, N).astype(np.float32)
    if teacher:
        inp["teacher_logits"] = (rng.standard_normal((N, V)) * scale).astype(NP_DTYPES[dtype])
    if grpo:
        inp["advantages"] = rng.standard_normal(N).astype(np.float32)
        inp["old_logprobs"] = old_logprobs(rng, z, inp.get("labels"), grpo)
    if ref:
        inp["ref_logprobs"] = (-rng.uniform(5, 9, N)).astype(np.float32)
    if topk:
        ids_dtype = "int32" if dtype == "float16" else "int64"
        inp["teacher_topk_ids"], inp["teacher_topk_logprobs"] = topk_teacher(
            rng, N, V, topk, inp.get("labels"), ids_dtype, scale)
    seq_inputs(rng, inp, N, rollout=rollout, seqs=seqs)
    return inp


def seq_inputs(rng, inp, N, *, rollout=False, seqs=None):
    """rollout_logprobs: old_logprobs + N(0, 1), so that rho = exp(old - rollout) falls on both
    sides of the corrections' bounds; seqs (a dtype): ragged cu_seqlens over the N rows, with a
    sequence of one row and an empty one."""
    if rollout:
        inp["rollout_logprobs"] = (inp["old_logprobs"] + rng.normal(0, 1.0, N)).astype(np.float32)
    if seqs:
        cuts = np.sort(rng.choice(np.arange(3, N), max(1, N // 6), replace=False)).tolist()
        inp["cu_seqlens"] = np.array([0, 1, 1, *cuts, N], seqs)


def topk_teacher(rng, N, V, k, labels=None, ids_dtype="int64", scale=2.0):
    """A sparse teacher: each row's k most likely ids under random teacher logits, in a shuffled
    order, and their log-probs (of the whole softmax, so the ids hold less than all the mass).
    Rows 1 and 2 hold their label among the ids; row 3 pads its second half and row 4 all of it
    (ids -1, log-probs NaN: ignored)."""
    t = rng.standard_normal((N, V)) * scale
    logq = t - t.max(1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(1, keepdims=True))
    ids = rng.permuted(np.argsort(-t, 1)[:, :k], axis=1)
    for r in (1, 2):
        if labels is not None and r < N and 0 <= labels[r] and labels[r] not in ids[r]:
            ids[r, -1] = labels[r]
    lp = logq[np.arange(N)[:, None], ids]
    if N > 4:
        ids[3, k // 2:] = -1
        ids[4] = -1
    lp[ids < 0] = np.nan
    return ids.astype(ids_dtype), lp.astype(np.float32)


def old_logprobs(rng, logits, labels, grpo):
    """GRPO's old log-probs: far from the new ones (grpo=True), or with grpo="near" the label's
    log-prob plus N(0, 1), so that r = exp(logp - old) lies on both sides of the clips."""
    N = logits.shape[0]
    if grpo != "near":
        return (-rng.uniform(1, 8, N)).astype(np.float32)
    z = np.asarray(logits, np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    y = np.zeros(N, np.int64) if labels is None else np.maximum(labels, 0)
    return (z[np.arange(N), y] - lse + rng.standard_normal(N)).astype(np.float32)


def ref_inputs(inp, terms, opts):
    """The reference's keywords for a case's inputs and plan options (as the plan sees them:
    fp32 values, 0 for a default)."""
    f64 = lambda k: None if k not in inp else inp[k].astype(np.float64)  # noqa: E731
    exact = ("ignore_index", "kl_estimator", "ratio_level", "rollout_correction", "rollout_level",
             "cu_seqlens_dtype")  # passed as they are: not fp32 values
    ropts = {k: (v if k in exact else float(np.float32(v))) for k, v in opts.items() if k != "teacher_topk"}
    for k, d in (("logit_scale", 1.0), ("teacher_temperature", 1.0), ("student_temperature", 1.0)):
        if ropts.get(k, 0.0) == 0.0:
            ropts[k] = d
    return dict(terms=terms, weights=f64("weights"), teacher=f64("teacher_logits"),
                adv=f64("advantages"), old=f64("old_logprobs"), ref=f64("ref_logprobs"),
                rollout=f64("rollout_logprobs"), cu_seqlens=inp.get("cu_seqlens"),
                topk_ids=inp.get("teacher_topk_ids"), topk_logprobs=f64("teacher_topk_logprobs"), **ropts)


def run_ref(inp, terms, opts, divisor=0.0, grad_scale=1.0):
    labels = inp["labels"] if "labels" in inp else None
    return reference(inp["logits"].astype(np.float64), labels, divisor=divisor,
                     grad_scale=grad_scale, **ref_inputs(inp, terms, opts))


def run_lib(be, inp, terms, opts, *, grad="write", grad_dtype=None, divisor=None, grad_scale=None,
            init_grad=None, in_place=False):
    dtype = str(inp["logits"].dtype)
    N, V = inp["logits"].shape
    labels_dtype = str(inp["labels"].dtype) if "labels" in inp else None
    if "teacher_topk_ids" in inp:
        opts = dict(opts, topk_ids_dtype=str(inp["teacher_topk_ids"].dtype))
    plan = LossPlan(V, dtype, terms=terms, device=be.name, labels_dtype=labels_dtype, grad=grad,
                    grad_dtype=grad_dtype, **opts)
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    gdt = grad_dtype or dtype
    g = None
    if grad == "write" and not in_place:
        g = be.full((N, V), gdt)
    elif grad == "accumulate":
        g = be.to_dev(init_grad.astype(NP_DTYPES[gdt]))
    scalars = be.full((len(SCALARS),), "float32")
    tokens = [be.full((N,), "float32") for _ in range(4)]
    logits = dev.pop("logits")
    labels = dev.pop("labels", None)
    out = plan(logits, labels, divisor=divisor, grad_scale=grad_scale, grad=g, scalars=scalars,
               tokens=tokens, in_place=in_place, **dev)
    sc = dict(zip(SCALARS, be.to_np(out.scalars)))
    toks = dict(zip(("loss", "logp", "entropy", "lse"), (be.to_np(t) for t in tokens)))
    return sc, toks, (None if out.grad is None else be.to_np(out.grad))


def rel(a, b):
    n = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (n if n > 0 else 1.0)


def check(be, got, want, dtype, grad_dtype=None, init_grad=None, scalar_rtol=None):
    sc, toks, grad = got
    rsc, rtoks, rgrad = want
    gpu = be.name == "cuda"
    rtol = scalar_rtol or (2e-4 if gpu else 2e-6)
    for k in SCALARS:
        want_v = rsc.get(k, 0.0)
        assert math.isfinite(sc[k]), f"scalar {k} is {sc[k]}"
        assert abs(sc[k] - want_v) <= rtol * (1 + abs(want_v)), f"scalar {k}: {sc[k]} vs {want_v}"
    for k in rtoks:
        assert rel(toks[k], rtoks[k]) < (1e-4 if gpu else 1e-6), f"token {k}: {rel(toks[k], rtoks[k])}"
    if rgrad is not None and grad is not None:
        if init_grad is not None:
            rgrad = rgrad + init_grad.astype(np.float64)
        tol = GRAD_TOL[grad_dtype or dtype] * (5 if gpu and (grad_dtype or dtype) == "float32" else 1)
        assert np.all(np.isfinite(grad)), "gradient has non-finite entries"
        assert rel(grad, rgrad) < tol, f"gradient: {rel(grad, rgrad)}"


# (terms, options, which optional inputs)
CASES = {
    "ce": (("ce",), {}, {}),
    "ce_smooth_weights_cap": (("ce",), {"label_smoothing": 0.125, "softcap": 7.5, "logit_scale": 1.25},
                              {"weights": True}),
    "z": (("z",), {"z_weight": 0.5}, {"labels": None}),
    "entropy": (("entropy",), {"entropy_weight": -0.25}, {"labels": None}),
    "distill_fwd": (("distill_fwd",), {"teacher_temperature": 2.0, "student_temperature": 1.5},
                    {"teacher": True, "labels": None}),
    "distill_rev": (("distill_rev",), {"teacher_temperature": 0.5, "student_temperature": 2.0},
                    {"teacher": True, "labels": None}),
    "grpo": (("grpo",), {"eps_low": 0.125, "eps_high": 0.25}, {"grpo": True}),
    "grpo_kl": (("grpo", "kl_ref"), {"kl_ref_beta": 0.0625}, {"grpo": True, "ref": True}),
    "all": (("ce", "z", "entropy", "distill_rev", "grpo", "kl_ref"),
            {"ce_weight": 0.75, "z_weight": 1e-3, "entropy_weight": -0.125, "distill_weight": 0.5,
             "kl_ref_beta": 0.25, "label_smoothing": 0.0625, "softcap": 15.0, "ignore_index": 7},
            {"weights": True, "teacher": True, "grpo": True, "ref": True}),
    "grpo_dual_clip": (("grpo",), {"dual_clip": 2.0, "eps_high": 0.25}, {"grpo": "near"}),
    "cispo": (("cispo",), {"cispo_weight": 0.5}, {"grpo": "near"}),  # clipped at 1 + eps_high
    "kl_k1": (("kl_ref",), {"kl_estimator": "k1", "kl_ref_beta": 0.5}, {"ref": True}),
    "kl_k2": (("grpo", "kl_ref"), {"kl_estimator": "k2", "kl_ref_beta": 0.25},
              {"grpo": True, "ref": True}),
    # ref_logprobs without the term: kl_ref_mean only (kl_ref_beta unused)
    "kl_metric_only": (("ce",), {"kl_estimator": "k2", "kl_ref_beta": 3.0}, {"ref": True}),
    "rl": (("ce", "entropy", "grpo", "kl_ref"),
           {"ce_weight": 0.25, "entropy_weight": -0.125, "dual_clip": 2.0, "kl_estimator": "k2",
            "kl_ref_beta": 0.125, "softcap": 15.0, "ignore_index": 7},
           {"weights": True, "grpo": "near", "ref": True}),
    "rl_cispo": (("ce", "grpo", "cispo", "kl_ref"),
                 {"ce_weight": 0.25, "dual_clip": 1.5, "cispo_weight": 0.75, "cispo_eps_high": 1.5,
                  "kl_estimator": "k1", "kl_ref_beta": 0.0625, "logit_scale": 1.25},
                 {"weights": True, "grpo": "near", "ref": True}),
    # Sequence-level ratio (GSPO) and the rollout corrections (cu_seqlens: ragged, see seq_inputs)
    "gspo": (("grpo",), {"ratio_level": "seq_mean", "eps_low": 0.125, "eps_high": 0.25},
             {"grpo": "near", "seqs": "int32"}),
    "gspo_all": (("ce", "grpo", "cispo", "kl_ref"),
                 {"ratio_level": "seq_mean", "ce_weight": 0.25, "dual_clip": 2.5, "cispo_weight": 0.5, "eps_low": 0.5, "eps_high": 1.0,
                  "kl_ref_beta": 0.125, "rollout_correction": "tis", "ignore_index": 7,
                  "cu_seqlens_dtype": "int64"},
                 {"weights": True, "grpo": "near", "ref": True, "rollout": True, "seqs": "int64"}),
    "tis": (("grpo",), {"rollout_correction": "tis", "rollout_cap": 1.5}, {"grpo": "near", "rollout": True}),
    "mis_seq_mean": (("grpo", "cispo"), {"rollout_correction": "mis", "rollout_level": "seq_mean",
                                         "rollout_cap": 1.5, "rollout_floor": 0.75},
                     {"grpo": "near", "rollout": True, "seqs": "int32"}),
    "reject_seq_product": (("ce", "grpo"), {"rollout_correction": "reject", "rollout_level": "seq_product",
                                            "rollout_cap": 5.0, "cu_seqlens_dtype": "int64",
                                            "ignore_index": 7},
                           {"weights": True, "grpo": "near", "rollout": True, "seqs": "int64"}),
    # rollout_logprobs without a correction: the mismatch metrics alone
    "rollout_metrics": (("ce",), {}, {"grpo": "near", "rollout": True}),
    # generalised JSD from a dense teacher, alone and with CE, the z-loss and GRPO
    "jsd": (("distill_jsd",), {"jsd_beta": 0.375, "teacher_temperature": 1.5, "student_temperature": 1.25},
            {"teacher": True, "labels": None}),
    "jsd_ce": (("ce", "z", "distill_jsd", "grpo"), {"jsd_beta": 0.75, "distill_weight": 0.5, "z_weight": 1e-3,
                                                    "softcap": 15.0, "logit_scale": 1.25},
               {"teacher": True, "weights": True, "grpo": "near"}),
    # a sparse (top-k) teacher: each divergence alone, k = 1 and k = 256, and with CE + GRPO
    "sparse_fwd": (("distill_fwd",), {"teacher_topk": 16, "student_temperature": 1.5},
                   {"topk": 16, "labels": None}),
    "sparse_rev": (("distill_rev",), {"teacher_topk": 16, "student_temperature": 0.75},
                   {"topk": 16, "labels": None}),
    "sparse_jsd": (("distill_jsd",), {"teacher_topk": 16, "jsd_beta": 0.25}, {"topk": 16}),
    "sparse_k1": (("distill_fwd",), {"teacher_topk": 1}, {"topk": 1, "labels": None}),
    "sparse_k256": (("distill_jsd",), {"teacher_topk": 256, "jsd_beta": 0.625, "student_temperature": 2.0},
                    {"topk": 256, "labels": None}),
    "sparse_rl": (("ce", "distill_rev", "grpo"),
                  {"teacher_topk": 32, "softcap": 15.0, "student_temperature": 2.0, "distill_weight": 0.5,
                   "label_smoothing": 0.0625, "ignore_index": 7},
                  {"topk": 32, "weights": True, "grpo": "near"}),
    "sparse_jsd_ce": (("ce", "distill_jsd"), {"teacher_topk": 8, "jsd_beta": 0.5, "logit_scale": 1.25},
                      {"topk": 8, "weights": True}),
}


def build(rng, N, V, dtype, case, labels="int64"):
    terms, opts, flags = CASES[case]
    flags = dict(flags)
    lab = flags.pop("labels", labels)
    return terms, opts, make_inputs(rng, N, V, dtype, labels=lab, **flags)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_terms(be, case, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{case}-{dtype}".encode()))
    terms, opts, inp = build(rng, 24, 300, dtype, case, labels="int32" if dtype == "float16" else "int64")
    got, want = run_lib(be, inp, terms, opts), run_ref(inp, terms, opts)
    check(be, got, want, dtype)
    if "teacher_topk_ids" in inp:  # the k ids' own columns alone (a few of the row's)
        at = _topk_columns(inp)
        assert rel(got[2][at], want[2][at]) < GRAD_TOL[dtype], rel(got[2][at], want[2][at])


def _topk_columns(inp):
    """Index arrays of the gradient elements at the sparse teacher's ids (padding left out)."""
    ids = np.asarray(inp["teacher_topk_ids"], np.int64)
    r, k = np.nonzero(ids >= 0)
    return r, ids[r, k]


@pytest.mark.parametrize("case", ["all", "sparse_rl", "jsd_ce"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["f32_grad", "accumulate", "in_place", "eval", "divisor"])
def test_grad_modes(be, mode, dtype, case):
    """Each gradient mode; with a sparse teacher the ids' elements are rewritten after the row's
    gradient pass (CUDA), from the saved old values when accumulating, and from the gathered
    logits when the gradient overwrites them."""
    rng = np.random.default_rng(7)
    terms, opts, inp = build(rng, 20, 257, dtype, case)
    init = None
    kw = {}
    if mode == "f32_grad":
        kw = {"grad_dtype": "float32"}
    elif mode == "accumulate":
        init = (rng.standard_normal((20, 257)) * 1e-3).astype(np.float32)
        kw = {"grad": "accumulate", "grad_dtype": "float32", "init_grad": init}
    elif mode == "in_place":
        kw = {"in_place": True}
    elif mode == "eval":
        kw = {"grad": None}
    want = run_ref(inp, terms, opts, divisor=(50.0 if mode == "divisor" else 0.0),
                   grad_scale=(0.5 if mode == "divisor" else 1.0))
    got = run_lib(be, inp, terms, opts, divisor=(50.0 if mode == "divisor" else None),
                  grad_scale=(0.5 if mode == "divisor" else None), **kw)
    if mode == "eval":
        assert got[2] is None
    check(be, got, want, dtype, grad_dtype=kw.get("grad_dtype"), init_grad=init)


@pytest.mark.parametrize("V", [8, 4099, 70001])
def test_sizes(be, V):
    """Vocabularies around the kernels' vector and cluster boundaries; one row of all-equal
    logits (ties: the first maximal column is the argmax)."""
    rng = np.random.default_rng(V)
    N = 9 if be.name == "cpu" and V > 10000 else 33
    terms, opts, inp = build(rng, N, V, "bfloat16", "all")
    inp["logits"][3] = 0
    check(be, run_lib(be, inp, terms, opts), run_ref(inp, terms, opts), "bfloat16")


# The bulk kernels' pass 2 picks a gradient form per row (row_grad.cuh, GradForm): each case
# below takes a different one.
BULK_CASES = {
    "ce_z": (("ce", "z"), {"z_weight": 1e-3, "logit_scale": 1.25}, {"weights": True}),  # kPure
    "ce_smooth": (("ce",), {"label_smoothing": 0.1}, {}),  # kSigned with cc != 0
    # kPure or kSigned by the sign of each row's coefficient (advantages of both signs)
    "grpo_kl": (("grpo", "kl_ref"), {"kl_ref_beta": 0.0625}, {"grpo": True, "ref": True}),
    "entropy": (("ce", "z", "entropy"), {"z_weight": 1e-3, "entropy_weight": -0.125,
                                         "label_smoothing": 0.1, "logit_scale": 1.25},
                {"weights": True}),  # kGeneric
}


def _bulk_inputs(rng, V, dtype, case):
    terms, opts, flags = BULK_CASES[case]
    N = 1600 if V < 100000 else 400
    return terms, opts, make_inputs(rng, N, V, dtype, **flags)


@pytest.mark.parametrize("grad", ["write", None])
@pytest.mark.parametrize("V", [32000, 128256])
@pytest.mark.parametrize("case", list(BULK_CASES))
def test_bulk_many_rows(be, case, V, grad):
    """More rows than resident CTAs, so each CTA streams several rows through its chunk ring, at
    bf16 vocabularies that take the bulk-copy kernels: a CTA a row (32000) and clusters of 4 that
    swap records through mailboxes (128256). The gradient pass frees the chunks, or pass 1 does
    without a gradient."""
    if be.name == "cpu":
        pytest.skip("the bulk-copy kernels are CUDA's (the CPU backend runs large rows in test_sizes)")
    terms, opts, inp = _bulk_inputs(np.random.default_rng(V), V, "bfloat16", case)
    check(be, run_lib(be, inp, terms, opts, grad=grad), run_ref(inp, terms, opts), "bfloat16")


@pytest.mark.parametrize("dtype,grad_dtype", [("float16", None), ("float32", None),
                                              ("bfloat16", "float32")])
def test_bulk_dtypes(be, dtype, grad_dtype):
    """The bulk kernels for the other logits dtypes and an fp32 gradient of bf16 logits. fp16
    gradients are loss-scaled, as fp16 training does: unscaled, p_j / D (~2e-8 here) underflows."""
    if be.name == "cpu":
        pytest.skip("the bulk-copy kernels are CUDA's")
    terms, opts, inp = _bulk_inputs(np.random.default_rng(3), 32000, dtype, "ce_z")
    gs = 2.0 ** 16 if (grad_dtype or dtype) == "float16" else 1.0
    check(be, run_lib(be, inp, terms, opts, grad_dtype=grad_dtype, grad_scale=gs),
          run_ref(inp, terms, opts, grad_scale=gs), dtype, grad_dtype=grad_dtype)


@pytest.mark.parametrize("rows", [40000, 140001])
def test_many_rows_scalars(be, rows):
    """Enough rows that CUDA's prep and reduce kernels split them over a cluster of CTAs and the
    row kernel's clusters take hundreds of rows each, in whatever order they free up: the
    divisor, every scalar (sums and the ratio / advantage min / max) and the first bad label must
    come out as with one CTA."""
    rng = np.random.default_rng(rows)
    terms, opts, inp = build(rng, rows, 24, "float32", "all")
    check(be, run_lib(be, inp, terms, opts), run_ref(inp, terms, opts), "float32")
    inp["labels"][[21001, rows - 1]] = 24  # bad rows in two CTAs' ranges: the first is reported
    with pytest.raises(headloss.HeadlossError, match=r"labels\[21001\] is 24"):
        run_lib(be, inp, terms, opts)


@pytest.mark.parametrize("V", [32000, 128256])
def test_gpu_deterministic(be, V):
    """Two runs give the same bits: rows go to clusters in whatever order they free up, but the
    reduce kernel sums the rows' records in an order fixed by the row count."""
    if be.name == "cpu":
        pytest.skip("rows handed out in whatever order clusters free up: CUDA's")
    terms, opts, inp = _bulk_inputs(np.random.default_rng(11), V, "bfloat16", "grpo_kl")
    (s1, t1, g1), (s2, t2, g2) = (run_lib(be, inp, terms, opts) for _ in range(2))
    assert np.array_equal(np.array(list(s1.values())), np.array(list(s2.values())))
    for k in t1:
        assert np.array_equal(t1[k], t2[k]), k
    assert np.array_equal(g1, g2)


@pytest.mark.parametrize("V", [8, 4099, 70001])
@pytest.mark.parametrize("case", ["sparse_rl", "sparse_jsd_ce", "jsd_ce"])
def test_distill_sizes(be, case, V):
    """The new distillation terms across the kernels' vector and cluster boundaries (a row split
    over CTAs: the ids fall in every CTA's slice); k = min(case's k, V) ids."""
    rng = np.random.default_rng(V + 1)
    N = 9 if be.name == "cpu" and V > 10000 else 33
    terms, opts, flags = CASES[case]
    flags = dict(flags)
    if "topk" in flags:
        flags["topk"] = min(flags["topk"], V)
        opts = dict(opts, teacher_topk=flags["topk"])
    inp = make_inputs(rng, N, V, "bfloat16", **flags)
    check(be, run_lib(be, inp, terms, opts), run_ref(inp, terms, opts), "bfloat16")


@pytest.mark.parametrize("case", ["all", "rl", "cispo_clipped", "sparse_fwd", "sparse_rev", "sparse_jsd",
                                  "jsd"])
def test_finite_differences(case):
    """The reference's combined gradient against central differences of its own loss, and the
    library's gradient against the reference: together the library's gradient is the loss's.
    CISPO's weight min(r, 1 + eps) is a constant by definition (stop-gradient), so its case puts
    every row's r far above the clip, where the loss's own gradient is CISPO's."""
    rng = np.random.default_rng(3)
    if case.startswith("sparse"):  # combined with CE, GRPO and a soft-cap; k = 4 of 9, the label among them
        terms, opts, flags = CASES[case]
        terms = terms + ("ce", "grpo")
        opts = dict(opts, teacher_topk=4, softcap=7.5, ce_weight=0.5)
        inp = make_inputs(rng, 4, 9, "float32", **dict(flags, topk=4, labels="int64", grpo="near"))
    else:
        terms, opts, inp = build(rng, 4, 9, "float32", "rl_cispo" if case == "cispo_clipped" else case)
    if case == "cispo_clipped":
        inp["old_logprobs"] -= 20.0
    opts = dict(opts, z_weight=0.125)
    if "labels" not in inp:
        inp["labels"] = np.array([3, -100, 8, 1])
    points = [(0, 0), (0, 3), (2, 8), (3, 1)]
    if "teacher_topk_ids" in inp:
        points += list(zip(*_topk_columns(inp)))
    check_finite_differences(inp, terms, opts, points)


def check_finite_differences(inp, terms, opts, points):
    """The reference's gradient at `points` and every valid row's label column against central
    differences of its loss; then the library's gradient against the reference."""
    _, _, g = run_ref(inp, terms, opts)
    z = inp["logits"].astype(np.float64)
    args = ref_inputs(inp, terms, opts)
    h = 1e-6
    labels = inp["labels"]
    for i, j in points + [(r, int(labels[r])) for r in range(len(labels)) if labels[r] >= 0]:
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        fd = (total_loss(zp, labels, **args) - total_loss(zm, labels, **args)) / (2 * h)
        assert abs(fd - g[i, j]) < 1e-6 + 1e-5 * abs(fd), (i, j, fd, g[i, j])
    check(CpuBackend(), run_lib(CpuBackend(), inp, terms, opts), run_ref(inp, terms, opts), "float32")


def test_rl_cases_reach_their_branches():
    """The policy-gradient CASES' data take both sides of every new branch (at test_terms' size):
    the dual clip binds on some rows and not others, CISPO's weight is clipped on some rows."""
    for case, dtype in (("grpo_dual_clip", "float32"), ("rl", "bfloat16"), ("rl_cispo", "float16")):
        rng = np.random.default_rng(zlib.crc32(f"{case}-{dtype}".encode()))
        terms, opts, inp = build(rng, 24, 300, dtype, case)
        sc, toks, _ = run_ref(inp, terms, opts)
        assert 0 < sc["dual_clip"] < 1, (case, sc["dual_clip"])
        r = np.exp(toks["logp"] - inp["old_logprobs"])[inp["labels"] >= 0]
        if "cispo" in terms:
            assert (r > 1 + opts["cispo_eps_high"]).any() and (r < 1 + opts["cispo_eps_high"]).any()


@pytest.mark.parametrize("estimator", ["k3", "k1", "k2"])
def test_kl_ref_metric_only(be, estimator):
    """ref_logprobs without GRPO_KL_REF: kl_ref_mean by the plan's estimator; the loss, gradient
    and every other scalar as without ref_logprobs (kl_ref_beta is not used)."""
    rng = np.random.default_rng(5)
    terms, opts, inp = build(rng, 24, 300, "float32", "rl")
    terms = tuple(t for t in terms if t != "kl_ref")
    opts = dict(opts, kl_estimator=estimator, kl_ref_beta=7.0)
    with_ref = run_lib(be, inp, terms, opts)
    check(be, with_ref, run_ref(inp, terms, opts), "float32")
    sc, toks, grad = with_ref
    inp.pop("ref_logprobs")
    sc0, toks0, grad0 = run_lib(be, inp, terms, opts)
    assert sc["kl_ref"] == 0 and sc["kl_ref_mean"] != 0
    assert {k: v for k, v in sc.items() if k != "kl_ref_mean"} == {k: v for k, v in sc0.items()
                                                                   if k != "kl_ref_mean"}
    assert np.array_equal(grad, grad0) and np.array_equal(toks["loss"], toks0["loss"])


BAD_OPTIONS = [
    ({"dual_clip": 1.0}, "dual_clip is 1; must be finite and > 1 \\(or 0: off\\)"),
    ({"dual_clip": 0.5}, "dual_clip is 0.5"),
    ({"dual_clip": -2.0}, "dual_clip is -2"),
    ({"dual_clip": float("inf")}, "dual_clip is inf"),
    ({"kl_estimator": 3}, "kl_estimator is 3; use HL_LOSS_KL_K3 \\(0\\)"),
    ({"kl_estimator": -1}, "kl_estimator is -1"),
    ({"cispo_eps_high": -0.25}, "cispo_eps_high is -0.25"),
    ({"cispo_weight": float("nan")}, "cispo_weight is not finite"),
]


@pytest.mark.parametrize("bad,msg", BAD_OPTIONS)
def test_bad_rl_options(be, bad, msg):
    with pytest.raises(headloss.HeadlossError, match=msg):
        LossPlan(50, "float32", terms=("grpo", "cispo"), device=be.name, **bad)


def test_kl_estimator_names():
    with pytest.raises(headloss.HeadlossValueError, match="kl_estimator is 'k4'; expected one of 'k3'"):
        LossPlan(50, "float32", kl_estimator="k4")


@pytest.mark.parametrize("missing", ["advantages", "old_logprobs"])
def test_cispo_needs_its_inputs(be, missing):
    """CISPO without advantages or old log-probs fails, naming the input, and writes nothing."""
    rng = np.random.default_rng(2)
    terms, opts, inp = build(rng, 6, 50, "float32", "cispo")
    inp.pop(missing)
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    scalars, grad = be.full((len(SCALARS),), "float32", 7.0), be.full((6, 50), "float32", 7.0)
    plan = LossPlan(50, "float32", terms=terms, device=be.name, **opts)
    with pytest.raises(headloss.HeadlossError, match=f"{missing} is NULL; CISPO needs it"):
        plan(dev.pop("logits"), dev.pop("labels"), scalars=scalars, grad=grad, **dev)
    assert np.all(be.to_np(scalars) == 7.0) and np.all(be.to_np(grad) == 7.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_loss_one_call(be, dtype):
    """headloss.fused_loss (the cached plan) on every term against the reference, twice (the second
    call reuses the plan and must give the same bits)."""
    rng = np.random.default_rng(11)
    terms, opts, inp = build(rng, 37, 301, dtype, "all")
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    logits, labels = dev.pop("logits"), dev.pop("labels")
    outs = [headloss.fused_loss(logits, labels, terms=terms, token_outputs=True, **dev, **opts)
            for _ in range(2)]
    got = [(dict(zip(SCALARS, be.to_np(o.scalars))),
            dict(zip(("loss", "logp", "entropy", "lse"),
                     (be.to_np(t) for t in (o.token_loss, o.token_logp, o.token_entropy, o.token_lse)))),
            be.to_np(o.grad)) for o in outs]
    check(be, got[0], run_ref(inp, terms, opts), dtype)
    assert np.array_equal(got[0][2], got[1][2]) and got[0][0] == got[1][0]


def test_bad_label_writes_nothing(be):
    rng = np.random.default_rng(1)
    terms, opts, inp = build(rng, 6, 50, "float32", "ce")
    inp["labels"][4] = 50
    with pytest.raises(headloss.HeadlossError, match=r"labels\[4\] is 50"):
        run_lib(be, inp, terms, opts)


@pytest.mark.parametrize("case", ["grpo_kl", "gspo_all", "mis_seq_mean", "sparse_rl", "jsd_ce"])
def test_torch_module(be, case):
    """The autograd front end: loss, metrics and .grad against the reference (rollout_logprobs,
    cu_seqlens and a sparse teacher too: the plan takes cu_seqlens' dtype)."""
    torch = pytest.importorskip("torch")
    from headloss.torch_loss import FusedLMHeadLoss
    rng = np.random.default_rng(11)
    terms, opts, inp = build(rng, 16, 1000, "float32", case)
    opts = {k: v for k, v in opts.items() if k != "cu_seqlens_dtype"}
    want_sc, _, want_grad = run_ref(inp, terms, opts, grad_scale=2.0)
    dev = "cuda" if be.name == "cuda" else "cpu"
    x = torch.tensor(inp["logits"], device=dev, requires_grad=True)
    t = {k: torch.tensor(v, device=dev) for k, v in inp.items() if k != "logits"}
    loss, metrics = FusedLMHeadLoss(terms, **opts)(x, t.pop("labels"), **t)
    (2.0 * loss).backward()
    assert abs(loss.item() - want_sc["loss"]) < 1e-4 * (1 + abs(want_sc["loss"]))
    for k in ("ratio_mean", "clip_any", "rollout_kl_k3", "rollout_corrected"):
        assert abs(metrics[k].item() - want_sc.get(k, 0.0)) < 1e-4, k
    assert rel(x.grad.cpu().numpy().astype(np.float64), want_grad) < 1e-4


# ---- RL aggregation modes (headloss.aggregation: the plan's weights and divisor) ----------------

def _aggregation_case(seed=0):
    """Ragged sequences (one empty, one with every token ignored), labels with -100 and 7."""
    rng = np.random.default_rng(seed)
    lens = np.array([5, 0, 1, 9, 4, 3])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    N = int(cu[-1])
    y = rng.integers(0, 40, N).astype(np.int64)
    y[rng.random(N) < 0.3] = -100
    y[cu[4]:cu[5]] = -100  # sequence 4: nothing valid
    y[2] = 7
    return y, cu


@pytest.mark.parametrize("ignore", [None, 7])
def test_aggregation_weights(ignore):
    y, cu = _aggregation_case()
    valid = (y >= 0) & (y != (ignore if ignore is not None else -1))
    w, D = headloss.aggregation(y, cu, "seq_mean_token_mean", ignore_index=ignore)
    assert w.dtype == np.float32 and w.shape == y.shape and D == len(cu) - 1
    for s in range(len(cu) - 1):
        n = valid[cu[s]:cu[s + 1]].sum()
        assert np.all(w[cu[s]:cu[s + 1]] == np.float32(1 / n if n else 0.0)), s
    assert headloss.aggregation(y, cu, "token_mean") == (None, None)
    assert headloss.aggregation(y, cu, "seq_mean_token_sum") == (None, 6.0)
    assert headloss.aggregation(y, cu, "token_sum_norm", constant=96) == (None, 96.0)


def test_aggregation_losses(be):
    """Each mode's loss (CE + GRPO) equals its definition from the reference's per-token losses,
    and the metrics are the same weighted means."""
    y, cu = _aggregation_case(1)
    rng = np.random.default_rng(2)
    terms, opts = ("ce", "grpo"), {}
    inp = make_inputs(rng, len(y), 40, "float32", grpo=True)
    inp["labels"] = y
    _, toks, _ = run_ref(inp, terms, opts)
    valid = y >= 0
    seqs = [slice(cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
    tok = toks["loss"]
    want = {
        "token_mean": tok[valid].sum() / valid.sum(),
        "seq_mean_token_mean": np.mean([tok[s][valid[s]].mean() if valid[s].any() else 0.0 for s in seqs]),
        "seq_mean_token_sum": np.mean([tok[s][valid[s]].sum() for s in seqs]),
        "token_sum_norm": tok[valid].sum() / 120.0,
    }
    for mode, loss in want.items():
        w, D = headloss.aggregation(y, cu, mode, constant=120.0)
        case = dict(inp, **({} if w is None else {"weights": w}))
        sc = run_lib(be, case, terms, opts, divisor=D)[0]
        assert abs(sc["loss"] - loss) <= 1e-5 * (1 + abs(loss)), mode
        if mode == "seq_mean_token_mean":  # metrics: means of the sequences' token means
            lse = np.mean([toks["lse"][s][valid[s]].mean() for s in seqs if valid[s].any()])
            assert abs(sc["lse_mean"] - lse) <= 1e-5 * abs(lse)


def test_aggregation_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    y, cu = _aggregation_case(3)
    want, D = headloss.aggregation(y, cu, "seq_mean_token_mean", ignore_index=7)
    got, Dt = headloss.aggregation(torch.from_numpy(y), torch.from_numpy(cu), "seq_mean_token_mean", ignore_index=7)
    assert got.dtype == torch.float32 and D == Dt and np.array_equal(got.numpy(), want)


def test_aggregation_bad_input():
    y, cu = _aggregation_case()
    with pytest.raises(headloss.HeadlossValueError, match="mode is 'mean'; expected one of token_mean"):
        headloss.aggregation(y, cu, "mean")
    with pytest.raises(headloss.HeadlossValueError, match="token_sum_norm needs a positive constant"):
        headloss.aggregation(y, cu, "token_sum_norm")
    for bad in (cu[1:], np.concatenate([cu[:-1], [cu[-1] + 1]]), np.array([0, 9, 4, len(y)])):
        with pytest.raises(headloss.HeadlossValueError, match="it must rise from 0 to rows"):
            headloss.aggregation(y, bad, "seq_mean_token_mean")
    with pytest.raises(headloss.HeadlossValueError, match=r"labels has shape \[2, 11\]; expected \[any\]"):
        headloss.aggregation(y.reshape(2, -1), cu, "seq_mean_token_mean")


# ---- Sequence-level ratio (GSPO) and rollout / trainer mismatch corrections ---------------------

@pytest.mark.parametrize("case", ["gspo", "gspo_all", "tis", "mis_seq_mean", "reject_seq_product"])
def test_sequence_cases_reach_their_branches(case):
    """At test_terms' size the cases' data take both sides of every new branch: GSPO clips some
    sequences and not others (with several sequence ratios), the corrections truncate or mask some
    tokens and not others."""
    for dtype in ("float32", "float16", "bfloat16"):
        rng = np.random.default_rng(zlib.crc32(f"{case}-{dtype}".encode()))
        terms, opts, inp = build(rng, 24, 300, dtype, case)
        sc, toks, _ = run_ref(inp, terms, opts)
        if opts.get("ratio_level"):
            assert 0 < sc["clip_any"] < 1 and sc["ratio_min"] < sc["ratio_max"], (case, dtype, sc)
        if opts.get("rollout_correction"):
            assert 0 < sc["rollout_corrected"] < 1, (case, dtype, sc["rollout_corrected"])


def test_gspo_finite_differences():
    """GSPO's gradient (GSPO-token: each token's ratio has its sequence's value and its own
    log-prob's gradient) is the sequence-level loss's true gradient where each sequence's
    advantage, weight and rollout correction are constant, as in GRPO: central differences of the reference's loss,
    whose ratio is exp(mean of the sequence's log-ratios), against the library's gradient. (CISPO's
    weight is a constant by definition, which differences cannot see: test_finite_differences.)"""
    rng = np.random.default_rng(4)
    terms, opts, inp = build(rng, 9, 11, "float32", "gspo_all")
    terms = tuple(t for t in terms if t != "cispo")
    # a sequence-level correction: constant within a sequence too (a token-level one is not)
    opts = dict(opts, rollout_correction="tis", rollout_level="seq_mean", rollout_cap=1.25)
    cu = inp["cu_seqlens"] = np.array([0, 1, 1, 5, 9], np.int64)
    for b, e in zip(cu[:-1], cu[1:]):
        inp["advantages"][b:e] = inp["advantages"][b]
        inp["weights"][b:e] = inp["weights"][b]
    check_finite_differences(inp, terms, opts, [(0, 2), (2, 0), (3, 7), (6, 5), (8, 10)])


@pytest.mark.parametrize("case", ["gspo_all", "mis_seq_mean"])
def test_long_sequences(be, case):
    """Sequences longer than a CTA's threads (the CUDA sequence kernel's rows loop) and more
    sequences than rows in a CTA of the prep kernel; twice, the same bits."""
    rng = np.random.default_rng(6)
    terms, opts, inp = build(rng, 1500, 200, "bfloat16", case)
    inp["cu_seqlens"] = np.array([0, 1, 700, 701, 701, 1290, 1500], inp["cu_seqlens"].dtype)
    got = run_lib(be, inp, terms, opts)
    check(be, got, run_ref(inp, terms, opts), "bfloat16")
    again = run_lib(be, inp, terms, opts)
    assert got[0] == again[0] and np.array_equal(got[2], again[2])


BAD_SEQUENCE_OPTIONS = [
    ({"ratio_level": "seq_mean", "cu_seqlens_dtype": "float32"}, "cu_seqlens_dtype is F32"),
    ({"ratio_level": 1}, "ratio_level is 1; use HL_LOSS_LEVEL_TOKEN"),
    ({"rollout_correction": 4}, "rollout_correction is 4"),
    ({"rollout_correction": "tis", "rollout_level": 3}, "rollout_level is 3"),
    ({"rollout_level": "seq_mean"}, "rollout_level / rollout_cap / rollout_floor are set but rollout_correction is NONE"),
    ({"rollout_cap": 3.0}, "rollout_correction is NONE"),
    ({"cu_seqlens_dtype": "int32"}, "cu_seqlens_dtype is set but no option is sequence-level"),
    ({"rollout_correction": "mis", "rollout_cap": 1.5, "rollout_floor": 1.5}, "rollout_floor is 1.5; must be in"),
    ({"rollout_correction": "mis", "rollout_floor": -0.5}, "rollout_floor is -0.5"),
    ({"rollout_correction": "tis", "rollout_cap": -2.0}, "rollout_cap is -2"),
]


@pytest.mark.parametrize("bad,msg", BAD_SEQUENCE_OPTIONS)
def test_bad_sequence_options(be, bad, msg):
    with pytest.raises(headloss.HeadlossError, match=msg):
        LossPlan(50, "float32", terms=("grpo", "cispo"), device=be.name, **bad)


def test_sequence_options_need_a_policy_term(be):
    for opts, msg in (({"ratio_level": "seq_mean"}, "GSPO\\) sets GRPO's and CISPO's ratio"),
                      ({"rollout_correction": "tis"}, "weights GRPO and CISPO, but the plan has neither")):
        with pytest.raises(headloss.HeadlossError, match=msg):
            LossPlan(50, "float32", terms=("ce",), device=be.name, **opts)
    with pytest.raises(headloss.HeadlossValueError, match="rollout_correction is 'is'"):
        LossPlan(50, "float32", terms=("grpo",), rollout_correction="is")


BAD_SEQUENCE_CALLS = [
    ("cu_seqlens", lambda cu: cu[:-1], "cu_seqlens\\[3\\] is 7; cu_seqlens must start at 0, not decrease, and end at rows = 12"),
    ("cu_seqlens", lambda cu: np.array([0, 5, 3, 12], cu.dtype), "cu_seqlens\\[2\\] is 3"),
    ("cu_seqlens", lambda cu: np.array([1, 5, 12], cu.dtype), "cu_seqlens\\[0\\] is 1"),
    ("cu_seqlens", lambda cu: np.array([0, 5, 13], cu.dtype), "cu_seqlens\\[2\\] is 13"),
    ("cu_seqlens", lambda cu: None, "cu_seqlens is NULL; a sequence-level option needs it"),
    ("rollout_logprobs", lambda r: None, "rollout_logprobs is NULL; a rollout correction needs it"),
]


@pytest.mark.parametrize("key,change,msg", BAD_SEQUENCE_CALLS)
def test_bad_sequence_calls_write_nothing(be, key, change, msg):
    rng = np.random.default_rng(8)
    terms, opts, inp = build(rng, 12, 50, "float32", "mis_seq_mean")
    inp["cu_seqlens"] = np.array([0, 1, 1, 7, 12], np.int32)
    inp[key] = change(inp[key])
    if inp[key] is None:
        inp.pop(key)
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    scalars, grad = be.full((len(SCALARS),), "float32", 7.0), be.full((12, 50), "float32", 7.0)
    tokens = [be.full((12,), "float32", 7.0) for _ in range(4)]
# ---- distillation: the generalised JSD and a sparse (top-k) teacher ------------------------------

@pytest.mark.parametrize("beta,twin", [(1.0, "distill_rev"), (None, None)])
def test_jsd_beta_endpoints(be, beta, twin):
    """As TRL, JSD at beta = 1 is reverse KL: the same bits as that term, dense and sparse (the
    formula's own limit there is 0). Without a beta, JSD's is TRL's and Liger's default 0.5."""
    for case in ("jsd", "sparse_jsd"):
        rng = np.random.default_rng(4)
        terms, opts, inp = build(rng, 24, 300, "float32", case)
        rest = {k: v for k, v in opts.items() if k != "jsd_beta"}
        if beta is None:
            jsd, other = run_lib(be, inp, terms, rest), run_lib(be, inp, terms, dict(rest, jsd_beta=0.5))
        else:
            jsd, other = run_lib(be, inp, terms, dict(rest, jsd_beta=beta)), run_lib(be, inp, (twin,), rest)
        assert jsd[0] == other[0] and np.array_equal(jsd[2], other[2]), case
        assert jsd[0]["distill"] > 0.01, case


@pytest.mark.parametrize("term", ["distill_fwd", "distill_rev", "distill_jsd"])
def test_sparse_with_every_id_is_dense(be, term):
    """A top-k teacher that lists every id (k = V, in a shuffled order) is the dense teacher: the
    rest masses are 0 up to rounding (floored at 2^-24 both sides, which adds ~1e-7 at most)."""
    rng = np.random.default_rng(8)
    N, V = 12, 40
    opts = {"jsd_beta": 0.375} if term == "distill_jsd" else {}
    opts["student_temperature"] = 1.5
    inp = make_inputs(rng, N, V, "float32", labels=None, teacher=True)
    dense = run_lib(be, inp, (term,), opts)
    t = inp.pop("teacher_logits").astype(np.float64)
    logq = t - t.max(1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(1, keepdims=True))
    ids = rng.permuted(np.tile(np.arange(V), (N, 1)), axis=1)
    inp["teacher_topk_ids"] = ids
    inp["teacher_topk_logprobs"] = logq[np.arange(N)[:, None], ids].astype(np.float32)
    sparse = run_lib(be, inp, (term,), dict(opts, teacher_topk=V))
    tol = 2e-4 if be.name == "cuda" else 1e-6
    for k in ("loss", "distill", "distill_kl_mean"):
        assert abs(sparse[0][k] - dense[0][k]) <= tol * (1 + abs(dense[0][k])), (k, sparse[0][k], dense[0][k])
    assert abs(sparse[0]["topk_mass"] - 1) < 1e-5
    assert rel(sparse[2], dense[2]) < (1e-4 if be.name == "cuda" else 1e-5)
    check(be, sparse, run_ref(inp, (term,), dict(opts, teacher_topk=V)), "float32")


def _sparse_plan_call(be, case="sparse_rl", N=6, V=50, k=8, **changes):
    """A sparse-teacher case (its terms, plan options and inputs) of N rows, V columns, k ids."""
    rng = np.random.default_rng(2)
    terms, opts, flags = CASES[case]
    inp = make_inputs(rng, N, V, "float32", **dict(flags, topk=k))
    opts = dict(opts, teacher_topk=k, **changes.pop("opts", {}))
    inp.update(changes)
    return terms, opts, inp


BAD_TOPK_INPUTS = [
    ("duplicate", r"teacher_topk_ids row 2 holds id \d+ twice"),
    ("out_of_range", r"teacher_topk_ids\[3, 1\] is 50, outside \[0, vocab = 50\) and not padding"),
    ("positive_logprob", r"teacher_topk_logprobs\[1, 2\] is 0.5; a log-prob must be finite and <= 0"),
    ("nan_logprob", r"teacher_topk_logprobs\[5, 0\] is nan"),
    ("inf_logprob", r"teacher_topk_logprobs\[0, 7\] is -inf"),
    ("dense_too", r"teacher_logits \(a dense teacher\) is set, but the plan's teacher is sparse"),
    ("no_ids", "teacher_topk_ids is NULL; a sparse teacher needs it"),
    ("no_logprobs", "teacher_topk_logprobs is NULL; a sparse teacher needs it"),
]


@pytest.mark.parametrize("bad,msg", BAD_TOPK_INPUTS, ids=[b for b, _ in BAD_TOPK_INPUTS])
def test_bad_topk_writes_nothing(be, bad, msg):
    """Each bad sparse-teacher input fails naming the entry, and no output is written."""
    terms, opts, inp = _sparse_plan_call(be)
    ids, lp = inp["teacher_topk_ids"], inp["teacher_topk_logprobs"]
    if bad == "duplicate":
        ids[2, 5] = ids[2, 1]
    elif bad == "out_of_range":
        ids[3, 1] = 50
    elif bad == "positive_logprob":
        lp[1, 2] = 0.5
    elif bad == "nan_logprob":
        lp[5, 0] = np.nan
        ids[5, 0] = 3
    elif bad == "inf_logprob":
        lp[0, 7] = -np.inf
    elif bad == "dense_too":
        inp["teacher_logits"] = inp["logits"].copy()
    else:
        inp.pop("teacher_topk_" + bad[3:])
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    scalars, grad = be.full((len(SCALARS),), "float32", 7.0), be.full((6, 50), "float32", 7.0)
    tokens = [be.full((6,), "float32", 7.0) for _ in range(4)]
    plan = LossPlan(50, "float32", terms=terms, device=be.name, **opts)
    with pytest.raises(headloss.HeadlossError, match=msg):
        plan(dev.pop("logits"), dev.pop("labels"), scalars=scalars, grad=grad, tokens=tokens, **dev)
    for out in [scalars, grad] + tokens:
        assert np.all(be.to_np(out) == 7.0)


def test_cu_seqlens_without_sequences(be):
    rng = np.random.default_rng(9)
    terms, opts, inp = build(rng, 12, 50, "float32", "tis")
    with pytest.raises(headloss.HeadlossError, match="cu_seqlens is given, but the plan was made without "
                       "cu_seqlens_dtype"):
        run_lib(be, dict(inp, cu_seqlens=np.array([0, 12], np.int32)), terms, opts)


def test_gspo_equals_grpo_on_one_token_sequences(be):
    """Sequences of one token: GSPO's ratio is the token's own, so the plan is GRPO's to rounding."""
    rng = np.random.default_rng(10)
    terms, opts, inp = build(rng, 30, 128, "float32", "gspo")
    inp["cu_seqlens"] = np.arange(31, dtype=np.int32)
    sc, toks, grad = run_lib(be, inp, terms, opts)
    grpo_opts = {k: v for k, v in opts.items() if k != "ratio_level"}
    inp.pop("cu_seqlens")
    sc0, toks0, grad0 = run_lib(be, inp, terms, grpo_opts)
    assert rel(grad, grad0) < 1e-6 and abs(sc["loss"] - sc0["loss"]) < 1e-6 * (1 + abs(sc0["loss"]))
def test_padding_entries_are_ignored(be):
    """Padding ids (< 0) leave their log-probs unread (NaN here, by topk_teacher) and any id
    after them counts: a row padded in the middle is the row without those entries."""
    terms, opts, inp = _sparse_plan_call(be)
    ids, lp = inp["teacher_topk_ids"], inp["teacher_topk_logprobs"]
    ids[0, 2], lp[0, 2] = -7, np.inf
    got = run_lib(be, inp, terms, opts)
    check(be, got, run_ref(inp, terms, opts), "float32")
    assert np.all(np.isnan(lp[4])) and np.all(ids[4] == -1)  # an all-padding row: no teacher mass
    _, toks, _ = run_ref(inp, ("distill_rev",), opts)
    assert abs(toks["loss"][4]) < 1e-12


BAD_DISTILL_OPTIONS = [
    (dict(terms=("distill_fwd", "distill_jsd")), "more than one of HL_LOSS_DISTILL_FWD, _REV and _JSD"),
    (dict(terms=("distill_jsd",), jsd_beta=1.5), "jsd_beta is 1.5; must be in \\(0, 1\\]"),
    (dict(terms=("distill_jsd",), jsd_beta=float("nan")), "jsd_beta is not finite"),
    (dict(terms=("distill_fwd",), jsd_beta=0.7), "jsd_beta is 0.7 but the plan has no HL_LOSS_DISTILL_JSD"),
    (dict(terms=("distill_fwd",), teacher_topk=257), "teacher_topk is 257; must be in \\[1, min\\(256, vocab_global = 300\\)\\]"),
    (dict(terms=("distill_fwd",), teacher_topk=-1), "teacher_topk is -1"),
    (dict(terms=("distill_fwd",), teacher_topk=8, vocab=6), "teacher_topk is 8; must be in \\[1, min\\(256, vocab_global = 6\\)\\]"),
    (dict(terms=("ce",), teacher_topk=8), "teacher_topk is 8 but the plan has no distillation term"),
    (dict(terms=("distill_rev",), teacher_topk=8, topk_ids_dtype="float32"), "teacher_topk_ids_dtype is F32"),
    (dict(terms=("distill_rev",), teacher_topk=8, teacher_temperature=2.0),
     "teacher_temperature is 2, but a sparse teacher's log-probs are used as given"),
]


@pytest.mark.parametrize("kw,msg", BAD_DISTILL_OPTIONS)
def test_bad_distill_options(be, kw, msg):
    kw = dict(kw)
    with pytest.raises(headloss.HeadlossError, match=msg):
        LossPlan(kw.pop("vocab", 300), "float32", device=be.name, labels_dtype="int64", **kw)


def test_topk_shape_checked_in_python():
    """The Python plan refuses sparse-teacher arrays that are not [rows, k] or of another dtype
    (the library reads k entries a row through a bare pointer)."""
    terms, opts, inp = _sparse_plan_call(CpuBackend())
    plan = LossPlan(50, "float32", terms=terms, **opts)
    ids, lp = inp["teacher_topk_ids"], inp["teacher_topk_logprobs"]
    with pytest.raises(headloss.HeadlossValueError, match=r"teacher_topk_ids is \[6, 7\] as rows x columns .*; expected \[6, 8\]"):
        plan(inp["logits"], inp["labels"], teacher_topk_ids=ids[:, :7], teacher_topk_logprobs=lp)
    with pytest.raises(TypeError, match="teacher_topk_ids is int32; expected int64"):
        plan(inp["logits"], inp["labels"], teacher_topk_ids=ids.astype(np.int32), teacher_topk_logprobs=lp)


def test_sparse_unchecked(be):
    """check=False (HL_LOSS_UNCHECKED): no check of the teacher's ids (on CUDA no check kernel
    and no synchronisation), the same results on valid input."""
    terms, opts, inp = _sparse_plan_call(be, N=30, V=301, k=16)
    check(be, run_lib(be, inp, terms, dict(opts, check=False)), run_ref(inp, terms, opts), "float32")


@pytest.mark.parametrize("distill", [dict(terms=("grpo", "distill_jsd"), jsd_beta=0.5),
                                     dict(terms=("grpo", "distill_fwd"), teacher_topk=4)])
def test_gspo_with_a_two_pass_teacher(be, distill):
    """GSPO runs the split's steps with one rank: with dense JSD its middle step too, with a sparse
    teacher the k logits in its records; against the reference."""
    distill = dict(distill)
    terms = distill.pop("terms")
    rng = np.random.default_rng(31)
    k = distill.get("teacher_topk", 0)
    inp = make_inputs(rng, 24, 300, "float32", teacher=not k, topk=k, grpo="near", seqs="int32")
    opts = dict(distill, ratio_level="seq_mean", eps_low=0.125, eps_high=0.25)
    check(be, run_lib(be, inp, terms, opts), run_ref(inp, terms, opts), "float32")
