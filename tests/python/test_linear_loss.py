"""The fused linear form of the loss plan (hidden states and the head's weight in, the logits never
whole in memory) against an fp64 reference of matmul + loss: every term alone and combined, every
dtype, ragged sizes, strides, gradient modes, a fused teacher, chunking, tensor-parallel shards,
bad input. CPU backend always; CUDA when a GPU and PyTorch are present, also against the logits
form on the same (16-bit) logits. Outputs are NaN-poisoned before each run."""
import zlib

import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS, LinearLossPlan, LossPlan
from ref_loss import reference
from test_loss import (CASES, GRAD_TOL, NP_DTYPES, be, old_logprobs, rel, seq_inputs,  # noqa: F401  (be: fixture)
                       run_ref, topk_teacher)

# The CUDA path rounds the logits to the 16-bit dtype between the products (the header says so):
# its reference rounds them too (reference_linear's backend), and what is left is a logit rounded
# the other way where the fp32 sums differ in their last bits.
SCALAR_RTOL = {"cpu": 2e-6, "float32": 2e-4, "float16": 2e-3, "bfloat16": 1e-2}


def make(rng, N, H, V, dtype, case, *, Ht=0, labels="int64", scale=2.5):
    """Inputs of a CASES entry in the linear form: hidden [N, H], weight [V, H] with logits of
    std ~scale; a teacher as logits or (Ht > 0) as its own hidden states and weight."""
    terms, opts, flags = CASES[case]
    flags = dict(flags)
    np_dt = NP_DTYPES[dtype]
    inp = {"hidden": rng.standard_normal((N, H)).astype(np_dt),
           "weight": (rng.standard_normal((V, H)) * scale / np.sqrt(H)).astype(np_dt)}
    lab = flags.pop("labels", labels)
    if lab:
        y = rng.integers(0, V, N)
        y[::5] = -100
        y[1] = 7
        inp["labels"] = y.astype(lab)
    if flags.get("weights"):
        inp["weights"] = rng.uniform(0.25, 2.0, N).astype(np.float32)
    if flags.get("teacher"):
        if Ht:
            inp["teacher_hidden"] = rng.standard_normal((N, Ht)).astype(np_dt)
            inp["teacher_weight"] = (rng.standard_normal((V, Ht)) * scale / np.sqrt(Ht)).astype(np_dt)
        else:
            inp["teacher_logits"] = (rng.standard_normal((N, V)) * scale).astype(np_dt)
    if flags.get("grpo"):
        inp["advantages"] = rng.standard_normal(N).astype(np.float32)
        logits = f64(inp["hidden"]) @ f64(inp["weight"]).T
        inp["old_logprobs"] = old_logprobs(rng, logits, inp.get("labels"), flags["grpo"])
    if flags.get("ref"):
        inp["ref_logprobs"] = (-rng.uniform(5, 9, N)).astype(np.float32)
    seq_inputs(rng, inp, N, rollout=flags.get("rollout"), seqs=flags.get("seqs"))
    if flags.get("topk"):
        inp["teacher_topk_ids"], inp["teacher_topk_logprobs"] = topk_teacher(
            rng, N, V, flags["topk"], inp.get("labels"), "int32" if dtype == "float16" else "int64", scale)
    return terms, opts, inp


def f64(x):
    return np.asarray(x).astype(np.float64)


def reference_linear(inp, terms, opts, backend="cpu", **kw):
    """(scalars, tokens, grad_hidden, grad_weight): fp64 logits = X W^T, the loss reference, then
    G W and G^T X. backend "cuda": the logits (a fused teacher's too) rounded once to a 16-bit
    input dtype first, as the CUDA path stores them between the products; everything else fp64."""
    X, W = f64(inp["hidden"]), f64(inp["weight"])
    dt = inp["hidden"].dtype
    stored = (lambda z: z.astype(dt).astype(np.float64)) if backend == "cuda" and dt.itemsize == 2 else (lambda z: z)
    ref_inp = {k: v for k, v in inp.items() if k not in ("hidden", "weight", "teacher_hidden", "teacher_weight")}
    ref_inp["logits"] = stored(X @ W.T)
    if "teacher_hidden" in inp:
        ref_inp["teacher_logits"] = stored(f64(inp["teacher_hidden"]) @ f64(inp["teacher_weight"]).T)
    sc, toks, G = run_ref(ref_inp, terms, opts, **kw)
    return sc, toks, G @ W, G.T @ X


def shifted_path(be, inp, terms, opts, strided=False):
    """Whether the CUDA plan runs the shifted path (kernels/loss/shifted.h): bf16 on a 9.0 GPU, a
    gradient of the form p cp + [v = y] cy, row strides of multiples of 8 elements. Its logits stay
    fp32 (no rounding between the products), so its reference is the CPU one."""
    if be.name != "cuda" or str(inp["hidden"].dtype) != "bfloat16" or strided or inp["hidden"].shape[1] % 8:
        return False
    if be.torch.cuda.get_device_capability() != (9, 0) or "teacher_hidden" in inp:
        return False
    return not (set(terms) & {"entropy", "distill_fwd", "distill_rev", "distill_jsd"}) and not (
        opts.get("label_smoothing") or opts.get("softcap") or opts.get("teacher_topk")
        or opts.get("ratio_level") == "seq_mean")


def run_linear(be, inp, terms, opts, *, grad_hidden="write", grad_weight="write", gh_dtype=None,
               gw_dtype=None, init=None, divisor=None, grad_scale=None, workspace_bytes=None,
               strided=False):
    """Runs the plan with poisoned outputs; returns (scalars, tokens, grad_hidden, grad_weight) in
    fp64 NumPy. strided: every matrix is a column slice of a wider one (row stride > columns): 5
    columns wider, or, given a number, the H-column matrices' row stride."""
    dtype = str(inp["hidden"].dtype)
    N, H = inp["hidden"].shape
    V = inp["weight"].shape[0]
    Ht = inp["teacher_hidden"].shape[1] if "teacher_hidden" in inp else 0
    if "teacher_topk_ids" in inp:
        opts = dict(opts, topk_ids_dtype=str(inp["teacher_topk_ids"].dtype))
    plan = LinearLossPlan(V, H, dtype, terms=terms, device=be.name,
                          labels_dtype=str(inp["labels"].dtype) if "labels" in inp else None,
                          grad_hidden=grad_hidden, grad_weight=grad_weight,
                          grad_hidden_dtype=gh_dtype, grad_weight_dtype=gw_dtype, teacher_hidden=Ht, **opts)

    def pad(cols):
        return 0 if not strided else 5 if strided is True or cols != H else strided - cols

    def put(x):
        if strided and x.ndim == 2:
            wide = np.zeros((x.shape[0], x.shape[1] + pad(x.shape[1])), x.dtype)
            wide[:, :x.shape[1]] = x
            return be.to_dev(wide)[:, :x.shape[1]]
        return be.to_dev(x)

    def out(shape, dt, mode, start):
        if mode is None:
            return None
        if mode == "accumulate":
            return put(start.astype(NP_DTYPES[dt]))
        full = be.full((shape[0], shape[1] + pad(shape[1])), dt)
        return full[:, :shape[1]] if strided else full

    init = init or {}
    gh = out((N, H), gh_dtype or dtype, grad_hidden, init.get("gh"))
    gw = out((V, H), gw_dtype or dtype, grad_weight, init.get("gw"))
    dev = {k: put(v) for k, v in inp.items()}
    scalars = be.full((len(SCALARS),), "float32")
    tokens = [be.full((N,), "float32") for _ in range(4)]
    ws = None
    if workspace_bytes is not None and be.name == "cuda":
        ws = plan.workspace(dev["hidden"], N, workspace_bytes)
    res = plan(dev.pop("hidden"), dev.pop("weight"), dev.pop("labels", None), grad_hidden=gh, grad_weight=gw,
               scalars=scalars, tokens=tokens, divisor=divisor, grad_scale=grad_scale, workspace=ws, **dev)
    sc = dict(zip(SCALARS, be.to_np(res.scalars)))
    toks = dict(zip(("loss", "logp", "entropy", "lse"), (be.to_np(t) for t in tokens)))
    conv = lambda g: None if g is None else be.to_np(g)  # noqa: E731
    return sc, toks, conv(res.grad_hidden), conv(res.grad_weight)


def check(be, got, want, dtype, *, gh_dtype=None, gw_dtype=None, init=None, gtol=None):
    sc, toks, gh, gw = got
    rsc, rtoks, rgh, rgw = want
    rtol = SCALAR_RTOL["cpu" if be.name == "cpu" else dtype]
    for k in SCALARS:
        w = rsc.get(k, 0.0)
        # exp(logp - old) turns the logits' rounding (CUDA, 16-bit) into a relative error of r
        tol = rtol * (4 if k.startswith(("ratio", "k3")) and be.name == "cuda" else 1)
        assert np.isfinite(sc[k]), f"scalar {k} is {sc[k]}"
        assert abs(sc[k] - w) <= tol * (1 + abs(w)), f"scalar {k}: {sc[k]} vs {w}"
    for k in rtoks:
        assert rel(toks[k], rtoks[k]) < (1e-6 if be.name == "cpu" else 10 * rtol), f"token {k}"
    init = init or {}
    for name, g, r, dt, start in (("grad_hidden", gh, rgh, gh_dtype, init.get("gh")),
                                  ("grad_weight", gw, rgw, gw_dtype, init.get("gw"))):
        if g is None:
            continue
        if start is not None:
            r = r + start.astype(np.float64)
        assert np.all(np.isfinite(g)), f"{name} has non-finite (unwritten?) entries"
        # CUDA: G and the logits are in the input dtype between the products (fp32: ~1e-5)
        tol = gtol or (GRAD_TOL[dt or dtype] if be.name == "cpu" else
                       1e-4 if dtype == "float32" else 3 * GRAD_TOL[dtype])
        assert rel(g, r) < tol, f"{name}: {rel(g, r)}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_terms(be, case, dtype):
    """Every term alone and combined, ragged sizes (H and V not multiples of any tile)."""
    rng = np.random.default_rng(zlib.crc32(f"lin-{case}-{dtype}".encode()))
    terms, opts, inp = make(rng, 29, 72, 301, dtype, case, labels="int32" if dtype == "float16" else "int64")
    ref_be = "cpu" if shifted_path(be, inp, terms, opts) else be.name
    check(be, run_linear(be, inp, terms, opts), reference_linear(inp, terms, opts, ref_be), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_teacher(be, dtype):
    """Distillation from a teacher given as its own hidden states (another width) and weight."""
    rng = np.random.default_rng(11)
    terms, opts, inp = make(rng, 27, 40, 263, dtype, "all", Ht=56)
    check(be, run_linear(be, inp, terms, opts), reference_linear(inp, terms, opts, be.name), dtype)


def mode_kwargs(mode, rng, N, H, V):
    """run_linear's keywords for a test mode, the outputs' starting values (accumulate), and the
    reference's keywords."""
    kw, init = {}, None
    if mode == "f32_grads":
        kw = dict(gh_dtype="float32", gw_dtype="float32")
    elif mode == "accumulate":
        init = {"gh": rng.standard_normal((N, H)) * 1e-2, "gw": rng.standard_normal((V, H)) * 1e-2}
        kw = dict(grad_hidden="accumulate", grad_weight="accumulate", gw_dtype="float32", init=init)
    elif mode == "hidden_only":
        kw = dict(grad_weight=None)
    elif mode == "weight_only":
        kw = dict(grad_hidden=None)
    elif mode == "eval":
        kw = dict(grad_hidden=None, grad_weight=None)
    elif mode == "divisor":
        kw = dict(divisor=50.0, grad_scale=0.5)
    elif mode == "strided":
        kw = dict(strided=True)
    return kw, init, dict(divisor=50.0, grad_scale=0.5) if mode == "divisor" else {}


@pytest.mark.parametrize("case", ["all", "sparse_rl", "jsd_ce"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["f32_grads", "accumulate", "hidden_only", "weight_only", "eval",
                                  "divisor", "strided", "odd_hidden"])
def test_modes(be, mode, dtype, case):
    rng = np.random.default_rng(zlib.crc32(f"mode-{mode}-{dtype}".encode()))
    H = 37 if mode == "odd_hidden" else 64
    terms, opts, inp = make(rng, 21, H, 257, dtype, case)
    kw, init, ref_kw = mode_kwargs(mode, rng, 21, H, 257)
    got = run_linear(be, inp, terms, opts, **kw)
    if mode in ("hidden_only", "eval"):
        assert got[3] is None
    if mode in ("weight_only", "eval"):
        assert got[2] is None
    check(be, got, reference_linear(inp, terms, opts, be.name, **ref_kw), dtype, gh_dtype=kw.get("gh_dtype"),
          gw_dtype=kw.get("gw_dtype"), init=init)


def test_no_rows(be):
    """rows = 0: grad_weight is written whole (zeros, the empty sum), the scalars are zero."""
    V, H = 50, 16
    plan = LinearLossPlan(V, H, "float32", terms=("ce",), device=be.name)
    gw = be.full((V, H), "float32")
    scalars = be.full((len(SCALARS),), "float32")
    x = be.to_dev(np.zeros((0, H), np.float32))
    w = be.to_dev(np.ones((V, H), np.float32))
    y = be.to_dev(np.zeros(0, np.int64))
    out = plan(x, w, y, grad_weight=gw, scalars=scalars)
    assert np.all(be.to_np(out.grad_weight) == 0)
    assert np.all(be.to_np(out.scalars) == 0)


def shard_plans(be, R, V, H, dtype, terms, opts, labels_dtype, **kw):
    bounds = np.linspace(0, V, R + 1).astype(int)
    return bounds, [LinearLossPlan(int(bounds[r + 1] - bounds[r]), H, dtype, terms=terms, device=be.name,
                                   labels_dtype=labels_dtype, vocab_start=int(bounds[r]), vocab_global=V,
                                   ranks=R, **kw, **opts) for r in range(R)]


def run_sharded(be, inp, terms, opts, R, keep, dtype):
    """The weight sharded by vocabulary rows over R ranks (run one after another here): stats, the
    blocks concatenated (the all-gather), finish; returns (scalars, grad_hidden summed over the ranks
    (the all-reduce), grad_weight shards stacked, every rank's scalars). keep: the workspace holds
    every row's logits (CUDA), else finish forms them again."""
    N, H = inp["hidden"].shape
    V = inp["weight"].shape[0]
    Ht = inp["teacher_hidden"].shape[1] if "teacher_hidden" in inp else 0
    ids = {"topk_ids_dtype": str(inp["teacher_topk_ids"].dtype)} if "teacher_topk_ids" in inp else {}
    X, W = inp["hidden"], inp["weight"]
    labels = str(inp["labels"].dtype) if "labels" in inp else None
    bounds, plans = shard_plans(be, R, V, H, dtype, terms, opts, labels, teacher_hidden=Ht, **ids)
    dev = {k: be.to_dev(v) for k, v in inp.items() if k not in ("hidden", "weight", "teacher_weight")}
    x, y = be.to_dev(X), dev.pop("labels", None)
    teacher = {k: dev.pop(k) for k in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logprobs") if k in dev}
    cat = (lambda bs: be.torch.cat([b.view(-1) for b in bs])) if be.name == "cuda" else np.concatenate
    ws, blocks = [], []
    for r, p in enumerate(plans):
        lo, hi = bounds[r], bounds[r + 1]
        w = be.to_dev(np.ascontiguousarray(W[lo:hi]))
        tw = {"teacher_weight": be.to_dev(np.ascontiguousarray(inp["teacher_weight"][lo:hi]))} if Ht else {}
        wsr = None
        if be.name == "cuda":
            lo_b, hi_b = p.workspace_sizes(N)
            wsr = p.workspace(x, N, hi_b if keep else lo_b)
        ws.append((w, tw, wsr))
        blocks.append(p.stats(x, w, y, workspace=wsr, **tw, **teacher))
    gathered = cat(blocks)
    mid = {}
    if plans[0].exchanges == 2:
        mid["gathered_middle"] = cat([p.middle(gathered, x, ws[r][0], y, workspace=ws[r][2], **ws[r][1], **teacher)
                                      for r, p in enumerate(plans)])
    gh_sum, gws, scal = 0.0, [], []
    for r, p in enumerate(plans):
        w, tw, wsr = ws[r]
        out = p.finish(gathered, x, w, y, workspace=wsr, **tw, **teacher, **mid,
                       grad_hidden=be.full((N, H), dtype), grad_weight=be.full((int(bounds[r + 1] - bounds[r]), H), dtype),
                       **dev)
        gh_sum = gh_sum + be.to_np(out.grad_hidden)
        gws.append(be.to_np(out.grad_weight))
        scal.append(be.to_np(out.scalars))
    for s in scal[1:]:
        assert np.array_equal(s, scal[0]), "the ranks' scalars differ"
    return dict(zip(SCALARS, scal[0])), gh_sum, np.concatenate(gws)


@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("case", ["all", "sparse_rl", "jsd_ce"])
def test_sharded_equals_unsharded(be, R, keep, case):
    """Sharded (run_sharded) equals the unsharded result. A sparse teacher's ids are global; dense
    JSD (a fused teacher) takes the middle step and a second exchange, which reuse the kept logits too."""
    if be.name == "cpu" and not keep:
        pytest.skip("the CPU backend keeps no logits: one case covers it")
    dtype = "float32" if be.name == "cpu" else "bfloat16"
    rng = np.random.default_rng(R)
    Ht = 0 if case.startswith("sparse") else 32
    terms, opts, inp = make(rng, 23, 48, 211, dtype, case, Ht=Ht)
    sc, gh_sum, gw = run_sharded(be, inp, terms, opts, R, keep, dtype)
    got = (sc, {}, gh_sum, gw)
    ref = reference_linear(inp, terms, opts, be.name)
    check(be, got, (ref[0], {}, *ref[2:]), dtype)
    if be.name == "cuda":  # and against the unsharded run, which rounds the same logits
        whole = run_linear(be, inp, terms, opts)
        for k in SCALARS:
            assert abs(sc[k] - whole[0][k]) <= 1e-4 * (1 + abs(whole[0][k])), f"scalar {k}"
        assert rel(gh_sum, whole[2]) < 5e-3 and rel(got[3], whole[3]) < 5e-3


# ---- bad input: a status and a message, nothing written ------------------------------------------

def _plan(**kw):
    base = dict(terms=("ce",), device="cpu")
    base.update(kw)
    return LinearLossPlan(40, 16, "float32", **base)


@pytest.mark.parametrize("kw, msg", [
    (dict(grad="write"), "grad is the logits form's"),
])
def test_bad_python_options(kw, msg):
    with pytest.raises(TypeError, match=msg):
        _plan(**kw)


@pytest.mark.parametrize("desc, msg", [
    (dict(hidden=-1), "hidden is -1"),
    (dict(weight_dtype=9), "weight_dtype is"),
    (dict(logits_dtype=1, weight_dtype=3), "logits_dtype is F32"),
    (dict(grad_mode=1), "grad_mode / grad_dtype are the logits form's"),
    (dict(grad_hidden_mode=7), "grad_hidden_mode is 7"),
    (dict(grad_weight_dtype=2), "grad_weight_dtype is F16; use F32"),
    (dict(teacher_hidden=8), "no distillation term"),
    (dict(hidden=0, weight_dtype=1), "weight_dtype is set, but it belongs to the fused linear form"),
])
def test_bad_descriptions(desc, msg):
    from headloss.loss import _Desc  # the raw descriptor: options the Python class would refuse
    import ctypes
    from headloss.loss import _check, _create
    d = _Desc(ctypes.sizeof(_Desc), 1, 40, 0, 5, 1, 0, 1.0)
    d.hidden, d.weight_dtype, d.grad_hidden_mode, d.grad_weight_mode = 16, 1, 1, 1
    for k, v in desc.items():
        setattr(d, k, v)
    h = ctypes.c_void_p()
    with pytest.raises(headloss.HeadlossError, match=msg) as e:
        _check(_create(ctypes.byref(d), ctypes.byref(h)))
    assert e.value.status == 1


def _bad_call(mutate, msg, status=1):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((6, 16)).astype(np.float32)
    W = rng.standard_normal((40, 16)).astype(np.float32)
    y = np.arange(6, dtype=np.int64)
    gh = np.full((6, 16), -7.0, np.float32)
    gw = np.full((40, 16), -7.0, np.float32)
    sc = np.full(len(SCALARS), -7.0, np.float32)
    args = dict(hidden=X, weight=W, labels=y, grad_hidden=gh, grad_weight=gw, scalars=sc)
    plan_kw = {}
    mutate(args, plan_kw)
    plan = _plan(**plan_kw)
    with pytest.raises((headloss.HeadlossError, ValueError), match=msg):
        plan(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)
    assert np.all(gh == -7.0) and np.all(gw == -7.0) and np.all(sc == -7.0), "a failed call wrote"


def test_bad_label():
    _bad_call(lambda a, k: a["labels"].__setitem__(2, 40), "labels\\[2\\] is 40")


def test_outputs_overlap():
    def m(a, k):
        a["grad_hidden"] = a["grad_weight"][:6]
    _bad_call(m, "overlaps")


def test_teacher_without_distillation():
    _bad_call(lambda a, k: a.update(teacher_logits=np.zeros((6, 40), np.float32)),
              r"\(a teacher\) is set but the plan has no distillation term")


def test_weight_rows_disagree():
    _bad_call(lambda a, k: a.update(weight=a["weight"][:39]), r"weight is \[39, 16\] as rows x columns \(shape \[39, 16\]\); expected \[40, 16\]")


def test_logits_form_refuses_linear_args():
    plan = LossPlan(40, "float32", terms=("ce",), device="cpu")
    from headloss.loss import _Args, _check, _execute
    import ctypes
    z = np.zeros((2, 40), np.float32)
    g = np.full((2, 40), -7.0, np.float32)
    y = np.zeros(2, np.int64)
    a = _Args(ctypes.sizeof(_Args), 2, z.ctypes.data, 40)
    a.labels, a.grad, a.weight = y.ctypes.data, g.ctypes.data, z.ctypes.data
    with pytest.raises(headloss.HeadlossError, match="weight is set, but the plan is the logits form"):
        _check(_execute(plan._handle, ctypes.byref(a), None, 0, None))
    assert np.all(g == -7.0)


# ---- CUDA: chunking, the logits form on the same logits, determinism ------------------------------

@pytest.fixture
def cuda_be():
    from test_loss import _cuda_backend
    return _cuda_backend()


@pytest.mark.parametrize("case", ["all", "sparse_rl", "jsd_ce", "ce", "grpo_kl"])
def test_cuda_chunks_and_determinism(cuda_be, case):
    """Chunks of 1, 7 and all rows each match the reference (a sparse teacher's per-row inputs
    offset by the chunk's first row), and a call gives the same bits on every run."""
    be = cuda_be
    rng = np.random.default_rng(5)
    terms, opts, inp = make(rng, 45, 96, 1031, "bfloat16", case)
    plan = LinearLossPlan(1031, 96, "bfloat16", terms=terms, device="cuda", **opts)
    lo, hi = plan.workspace_sizes(45)
    row = (hi - lo) // 44  # bytes a row (fast_bytes holds all 45 rows here)
    want = reference_linear(inp, terms, opts, "cpu" if shifted_path(be, inp, terms, opts) else be.name)
    results = []
    for nbytes in (lo, lo + 6 * row, hi, hi):
        got = run_linear(be, inp, terms, opts, gw_dtype="float32", workspace_bytes=nbytes)
        check(be, got, want, "bfloat16", gw_dtype="float32")
        results.append(got)
    last, again = results[-1], results[-2]
    for a, b in zip(last[:2], again[:2]):  # scalars and tokens
        assert all(np.array_equal(a[k], b[k]) for k in a), "two runs of the same call differ"
    assert np.array_equal(last[2], again[2]) and np.array_equal(last[3], again[3]), \
        "two runs of the same call differ"


@pytest.mark.parametrize("case", ["ce", "all", "distill_fwd", "grpo_kl", "sparse_rl", "jsd_ce"])
def test_cuda_equals_logits_form(cuda_be, case, monkeypatch):
    """On the GPU the linear form's row path equals the logits form run on the same 16-bit logits
    (X W^T rounded once, as cuBLAS stores them): the same loss math, then G W and G^T X."""
    monkeypatch.setenv("HEADLOSS_LINEAR_PATH", "rows")  # CE and GRPO plans take the shifted path
    be = cuda_be
    torch = be.torch
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    terms, opts, inp = make(rng, 300, 256, 4099, "bfloat16", case)
    got = run_linear(be, inp, terms, opts, gh_dtype="float32", gw_dtype="float32")
    X, W = be.to_dev(inp["hidden"]), be.to_dev(inp["weight"])
    logits = X @ W.T
    rest = {k: be.to_dev(v) for k, v in inp.items() if k not in ("hidden", "weight", "labels")}
    plan = LossPlan(4099, "bfloat16", terms=terms, device="cuda", grad_dtype="float32",
                    labels_dtype=str(inp["labels"].dtype) if "labels" in inp else None, **opts)
    out = plan(logits, be.to_dev(inp["labels"]) if "labels" in inp else None, token_outputs=True, **rest)
    G = out.grad.to(torch.bfloat16).float()  # the linear form's G is rounded to bf16 too
    sc_l = dict(zip(SCALARS, be.to_np(out.scalars)))
    for k in SCALARS:
        assert abs(got[0][k] - sc_l[k]) <= 1e-4 * (1 + abs(sc_l[k])), f"scalar {k}: {got[0][k]} vs {sc_l[k]}"
    assert rel(got[2], be.to_np(G @ W.float())) < 2e-3
    assert rel(got[3], be.to_np(G.T @ X.float())) < 2e-3


# The shifted path (bf16 on a 9.0 GPU; plans whose gradient is p cp + [v = y] cy): the logits stay
# fp32 up to E = exp(z - shift) in bf16, so it is checked against the reference of unrounded logits.
SHIFTED_CASES = ["ce", "z", "grpo_kl", "cispo"]


def shifted_inputs(case, N=70, H=136, V=1000, extremes=True):
    """A CASES entry's inputs with weights; extremes: some rows' logits all near +150 or -150 (the
    first hidden column large, the weight's first column 1), outside the first pass's window, so
    those rows' blocks run again at their own max."""
    rng = np.random.default_rng(zlib.crc32(f"shifted-{case}-{N}".encode()))
    terms, opts, inp = make(rng, N, H, V, "bfloat16", case)
    inp["weights"] = rng.uniform(0.25, 2.0, N).astype(np.float32)
    if extremes:
        inp["weight"][:, 0] = 1.0
        inp["hidden"][3, 0], inp["hidden"][N - 2, 0] = 150.0, -150.0
        if "old_logprobs" in inp:  # GRPO's old log-probs near the new ones again
            logits = f64(inp["hidden"]) @ f64(inp["weight"]).T
            inp["old_logprobs"] = old_logprobs(np.random.default_rng(1), logits, inp.get("labels"), "near")
    return terms, opts, inp


def check_unrounded_scalars(sc, want):
    """The shifted path's scalars against the reference of the unrounded logits: 1e-4, where bf16
    logits (the row path) would be off by ~0.3 at logits of 150 (the ratios' metrics 1e-3)."""
    for k in SCALARS:
        w = want.get(k, 0.0)
        tol = 1e-3 if k.startswith(("ratio", "k3", "clip")) else 1e-4
        assert abs(sc[k] - w) <= tol * (1 + abs(w)), f"scalar {k}: {sc[k]} vs {w}"


@pytest.mark.parametrize("case", SHIFTED_CASES)
@pytest.mark.parametrize("mode", ["write", "f32_grads", "accumulate", "hidden_only", "weight_only", "eval",
                                  "divisor"])
def test_cuda_shifted(cuda_be, case, mode):
    """Against the fp64 reference of the unrounded logits, rows at both ends of the window included:
    the scalars to 1e-4 where bf16 logits (the row path) would be off by ~0.3 at logits of 150."""
    be = cuda_be
    terms, opts, inp = shifted_inputs(case)
    N, H = inp["hidden"].shape
    V = inp["weight"].shape[0]
    kw, init, ref_kw = mode_kwargs(mode, np.random.default_rng(3), N, H, V)
    got = run_linear(be, inp, terms, opts, **kw)
    want = reference_linear(inp, terms, opts, "cpu", **ref_kw)
    check_unrounded_scalars(got[0], want[0])
    for k in want[1]:
        assert rel(got[1][k], want[1][k]) < 1e-4, f"token {k}"
    check(be, got, want, "bfloat16", gh_dtype=kw.get("gh_dtype"), gw_dtype=kw.get("gw_dtype"), init=init,
          gtol=1e-2)


@pytest.mark.parametrize("case", SHIFTED_CASES)
def test_cuda_forward_only_chunks(cuda_be, case):
    """A call without gradient on the shifted path keeps its tile statistics alone (no E): in the
    least workspace, a few rows' and fast_bytes, the scalars and token outputs match the reference
    of the unrounded logits (the row path's bf16 logits would miss it), bit for bit between sizes."""
    be = cuda_be
    terms, opts, inp = shifted_inputs(case)
    N, H = inp["hidden"].shape
    V = inp["weight"].shape[0]
    plan = LinearLossPlan(V, H, "bfloat16", terms=terms, device="cuda", grad_hidden=None, grad_weight=None, **opts)
    lo, hi = plan.workspace_sizes(N)
    want = reference_linear(inp, terms, opts, "cpu")
    runs = [run_linear(be, inp, terms, opts, grad_hidden=None, grad_weight=None, workspace_bytes=nbytes)
            for nbytes in (lo, lo + 6 * (hi - lo) // max(N - 1, 1), hi)]
    for got in runs:
        check_unrounded_scalars(got[0], want[0])
        for k in want[1]:
            assert rel(got[1][k], want[1][k]) < 1e-4, f"token {k}"
    assert all(np.array_equal(runs[0][1][k], r[1][k]) for r in runs[1:] for k in runs[0][1])


@pytest.mark.parametrize("H", [100, 102])
@pytest.mark.parametrize("mode", ["write", "f32_grads", "accumulate"])
def test_cuda_shifted_ragged_hidden(cuda_be, H, mode):
    """H not a multiple of 8 (100) or 4 (102) in rows of 104 elements, as the shifted path takes
    them: its 8- and 4-column loops' scalar tails (the label's dot product, alpha X, grad_hidden)."""
    be = cuda_be
    terms, opts, inp = shifted_inputs("grpo_kl", H=H)
    N, V = inp["hidden"].shape[0], inp["weight"].shape[0]
    kw, init, _ = mode_kwargs(mode, np.random.default_rng(4), N, H, V)
    got = run_linear(be, inp, terms, opts, strided=104, **kw)
    want = reference_linear(inp, terms, opts, "cpu")
    assert abs(got[0]["loss"] - want[0]["loss"]) <= 1e-4 * (1 + abs(want[0]["loss"]))  # not the row path's 0.3
    check(be, got, want, "bfloat16", gh_dtype=kw.get("gh_dtype"), gw_dtype=kw.get("gw_dtype"), init=init,
          gtol=1e-2)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("case", SHIFTED_CASES)
def test_cuda_shifted_sharded(cuda_be, R, keep, case):
    """Shards on the shifted path (each rank's own shifts; the records merged as the row path's):
    against the fp64 reference of the unrounded logits, rows at both ends of the window included, and
    against the unsharded run."""
    be = cuda_be
    terms, opts, inp = shifted_inputs(case, N=90, H=64, V=1500)
    sc, gh_sum, gw = run_sharded(be, inp, terms, opts, R, keep, "bfloat16")
    want = reference_linear(inp, terms, opts, "cpu")
    check_unrounded_scalars(sc, want[0])
    check(be, (sc, {}, gh_sum, gw), (want[0], {}, *want[2:]), "bfloat16", gtol=1e-2)
    whole = run_linear(be, inp, terms, opts)
    assert rel(gh_sum, whole[2]) < 5e-3 and rel(gw, whole[3]) < 5e-3


def test_cuda_path_fixed_at_plan_creation(cuda_be, monkeypatch):
    """HEADLOSS_LINEAR_PATH is read when a plan is created: a plan made under =rows keeps the row path (its
    workspace sizes and its bits) once the variable is gone, and one made without it the shifted path."""
    be = cuda_be
    terms, opts, inp = shifted_inputs("ce", N=300, H=256, V=4099)
    N, H = inp["hidden"].shape
    dev = {k: be.to_dev(v) for k, v in inp.items()}
    hidden, weight, labels = dev.pop("hidden"), dev.pop("weight"), dev.pop("labels")

    def grads(plan):
        gh, gw = be.full((N, H), "bfloat16"), be.full((4099, H), "bfloat16")
        plan(hidden, weight, labels, grad_hidden=gh, grad_weight=gw, **dev)
        return be.to_np(gh), be.to_np(gw)

    monkeypatch.setenv("HEADLOSS_LINEAR_PATH", "rows")
    rows = LinearLossPlan(4099, H, "bfloat16", terms=terms, device="cuda", **opts)
    monkeypatch.delenv("HEADLOSS_LINEAR_PATH")
    shifted = LinearLossPlan(4099, H, "bfloat16", terms=terms, device="cuda", **opts)
    sizes = {p: p.workspace_sizes(N) for p in (rows, shifted)}
    assert sizes[rows] != sizes[shifted], "the shifted path's buffers"
    first = {p: grads(p) for p in (rows, shifted)}
    assert not np.array_equal(first[rows][0], first[shifted][0]), "the two paths round differently"
    monkeypatch.setenv("HEADLOSS_LINEAR_PATH", "rows")
    for p in (rows, shifted):
        assert p.workspace_sizes(N) == sizes[p]
        again = grads(p)
        assert np.array_equal(again[0], first[p][0]) and np.array_equal(again[1], first[p][1])


def test_cuda_shifted_large(cuda_be):
    """Rows in several 128-row blocks and vocabulary tiles (a ragged last one), one block's rows
    outside the window, chunks of 300 rows: the reference, and the same bits on a second run."""
    be = cuda_be
    terms, opts, inp = shifted_inputs("ce", N=700, H=256, V=5000)
    plan = LinearLossPlan(5000, 256, "bfloat16", terms=terms, device="cuda", **opts)
    lo, hi = plan.workspace_sizes(700)
    row = (hi - lo) // 699
    want = reference_linear(inp, terms, opts, "cpu")
    first = run_linear(be, inp, terms, opts, gw_dtype="float32", workspace_bytes=lo + 299 * row)
    check(be, first, want, "bfloat16", gw_dtype="float32", gtol=1e-2)
    assert abs(first[0]["loss"] - want[0]["loss"]) <= 1e-4 * abs(want[0]["loss"])
    again = run_linear(be, inp, terms, opts, gw_dtype="float32", workspace_bytes=lo + 299 * row)
    assert np.array_equal(first[2], again[2]) and np.array_equal(first[3], again[3])
    assert all(np.array_equal(first[0][k], again[0][k]) for k in first[0])
