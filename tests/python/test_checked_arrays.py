"""Every entry point checks every array against the sizes it passes to the library before the call
(the C ABI takes bare pointers and cannot know a buffer's length): for each entry point and each
of its arrays, a version one row short and one long, one column short and one long, of a wrong
dtype, non-contiguous, and in another device's memory, must raise a HeadlossError (a ValueError or
a TypeError) naming the argument, and leave every preallocated output as it was (poisoned first).

Table-driven: CASES lists the entry points (NumPy on the CPU backend; PyTorch CPU tensors and JAX
on the CPU where installed), each with valid arrays, the call, the arrays it varies and how, and
its preallocated outputs. Variants: r / R one row short / long (the first axis; T, the second, for
3-d to 5-d arrays), c / C one column short / long, d a wrong dtype (int32 for a float array, float32 for
an int one), s non-contiguous, x in GPU memory (a fake __cuda_array_interface__ object whose
memory is never touched: the check must refuse it first)."""
from typing import Callable, Dict, NamedTuple, Tuple

import numpy as np
import pytest

import headloss
from headloss import GDNGrads, LinearLossPlan, LossPlan, SCALARS

R, V, H, C = 6, 11, 8, 12  # rows, vocabulary, hidden, RMSNorm columns


class Case(NamedTuple):
    make: Callable[[np.random.Generator], Dict[str, np.ndarray]]  # the valid arrays by name
    run: Callable[[Dict[str, np.ndarray]], object]                 # the call on them
    vary: Dict[str, str]                                           # argument -> its variants
    outputs: Tuple[str, ...] = ()                                  # preallocated outputs


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def labels(rng, n=R, dtype=np.int64):
    return rng.integers(0, V, n).astype(dtype)


def per_row(rng):
    return rng.uniform(0.5, 1.5, R).astype(np.float32)


def nan(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


MAT, ROW, VEC = "rRcCdsx", "rRdsx", "rRdsx"  # a matrix, a per-row array, a [cols] vector


def _loss_inputs(rng):
    return dict(logits=f32(rng, R, V), labels=labels(rng), weights=per_row(rng),
                teacher_logits=f32(rng, R, V), advantages=f32(rng, R), old_logprobs=-per_row(rng),
                ref_logprobs=-per_row(rng), rollout_logprobs=-per_row(rng),
                grad=nan(R, V), scalars=nan(len(SCALARS)), token_loss=nan(R), token_logp=nan(R),
                token_entropy=nan(R), token_lse=nan(R))


_LOSS_PLAN = dict(terms=("ce", "distill_fwd", "grpo", "kl_ref"), kl_ref_beta=0.1,
                  rollout_correction="tis")
_TOKENS = ("token_loss", "token_logp", "token_entropy", "token_lse")
_LOSS_ARGS = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def _loss_call(a):
    plan = LossPlan(V, "float32", **_LOSS_PLAN)
    return plan(a["logits"], a["labels"], grad=a["grad"], scalars=a["scalars"],
                tokens=[a[k] for k in _TOKENS], **{k: a[k] for k in _LOSS_ARGS})


def _sparse_inputs(rng):
    ids = np.stack([rng.permutation(V)[:3] for _ in range(R)]).astype(np.int64)
    lp = np.log(np.full((R, 3), 0.25, np.float32))
    return dict(logits=f32(rng, R, V), labels=labels(rng), teacher_topk_ids=ids, teacher_topk_logprobs=lp,
                grad=nan(R, V), scalars=nan(len(SCALARS)))


def _sparse_call(a):
    plan = LossPlan(V, "float32", terms=("ce", "distill_fwd"), teacher_topk=3)
    return plan(a["logits"], a["labels"], teacher_topk_ids=a["teacher_topk_ids"],
                teacher_topk_logprobs=a["teacher_topk_logprobs"], grad=a["grad"], scalars=a["scalars"])


def _seq_inputs(rng):
    return dict(logits=f32(rng, R, V), labels=labels(rng), advantages=f32(rng, R), old_logprobs=-per_row(rng),
                cu_seqlens=np.array([0, 2, R], np.int32), grad=nan(R, V), scalars=nan(len(SCALARS)))


def _seq_call(a):
    plan = LossPlan(V, "float32", terms=("grpo",), ratio_level="seq_mean")
    return plan(a["logits"], a["labels"], advantages=a["advantages"], old_logprobs=a["old_logprobs"],
                cu_seqlens=a["cu_seqlens"], grad=a["grad"], scalars=a["scalars"])


def _linear_inputs(rng):
    return dict(hidden=f32(rng, R, H), weight=f32(rng, V, H), labels=labels(rng), weights=per_row(rng),
                teacher_hidden=f32(rng, R, 5), teacher_weight=f32(rng, V, 5), grad_hidden=nan(R, H),
                grad_weight=nan(V, H), scalars=nan(len(SCALARS)), token_loss=nan(R))


def _linear_call(a):
    plan = LinearLossPlan(V, H, "float32", terms=("ce", "distill_rev"), teacher_hidden=5)
    return plan(a["hidden"], a["weight"], a["labels"], weights=a["weights"], teacher_hidden=a["teacher_hidden"],
                teacher_weight=a["teacher_weight"], grad_hidden=a["grad_hidden"], grad_weight=a["grad_weight"],
                scalars=a["scalars"], tokens=[a["token_loss"], None, None, None])


_SHARD = dict(terms=("ce", "z"), z_weight=1e-3, vocab_global=V, ranks=1)


def _finish_call(a):
    plan = LossPlan(V, "float32", **_SHARD)
    gathered = plan.stats(a["stats_logits"], a["stats_labels"])  # valid statistics of valid inputs
    return plan.finish(gathered, a["logits"], a["labels"], weights=a["weights"], grad=a["grad"],
                       scalars=a["scalars"])


def _gdn_inputs(rng):
    B, T, Hq, HV, K, Vd = 1, 70, 1, 2, 8, 4
    h16 = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    return dict(q=h16(B, T, Hq, K), k=h16(B, T, Hq, K), v=h16(B, T, HV, Vd), do=h16(B, T, HV, Vd),
                h=h16(B, 2, HV, K, Vd), dh=h16(B, 2, HV, K, Vd), dv=h16(B, T, HV, Vd),
                g=-rng.uniform(0, 1, (B, T, HV)).astype(np.float32), dq=nan(B, T, Hq, K, dtype=np.float16),
                dk=nan(B, T, Hq, K, dtype=np.float16), dw=nan(B, T, HV, K, dtype=np.float16),
                dg=nan(B, T, HV))


def _gdn_call(a):
    return headloss.gdn_bwd_dqkwg(a["q"], a["k"], a["v"], a["do"], a["h"], a["dh"], g=a["g"], dv=a["dv"],
                                  out=GDNGrads(a["dq"], a["dk"], a["dw"], a["dg"]))


CASES = {
    "rmsnorm_fwd": Case(
        lambda rng: dict(x=f32(rng, R, C), weight=f32(rng, C), residual=f32(rng, R, C), out=nan(R, C),
                         residual_out=nan(R, C), rstd=nan(R)),
        lambda a: headloss.rmsnorm_fwd(a["x"], a["weight"], residual=a["residual"], out=a["out"],
                                       residual_out=a["residual_out"], rstd=a["rstd"]),
        dict(x="ds", weight=VEC, residual=MAT, out=MAT, residual_out=MAT, rstd=ROW),
        ("out", "residual_out", "rstd")),
    "rmsnorm_bwd": Case(
        lambda rng: dict(dy=f32(rng, R, C), x=f32(rng, R, C), weight=f32(rng, C), rstd=per_row(rng),
                         dresidual_out=f32(rng, R, C), dx=nan(R, C), dw=nan(C)),
        lambda a: headloss.rmsnorm_bwd(a["dy"], a["x"], a["weight"], a["rstd"], dresidual_out=a["dresidual_out"],
                                       dx=a["dx"], dw=a["dw"]),
        dict(dy=MAT, x="ds", weight=VEC, rstd=ROW, dresidual_out=MAT, dx=MAT, dw=VEC), ("dx", "dw")),
    "rmsnorm": Case(
        lambda rng: dict(x=f32(rng, R, C), weight=f32(rng, C)),
        lambda a: headloss.rmsnorm(a["x"], a["weight"]), dict(x="ds", weight=VEC)),
    "gdn_bwd_dqkwg": Case(
        _gdn_inputs, _gdn_call,
        dict(q="ds", k=MAT, v="ds", do=MAT, h="cCdsx", dh=MAT, dv=MAT, g=MAT, dq=MAT, dk=MAT, dw=MAT,
             dg=MAT), ("dq", "dk", "dw", "dg")),
    "LossPlan": Case(
        _loss_inputs, _loss_call,
        dict(logits="cCds", labels=ROW, weights=ROW, teacher_logits=MAT, advantages=ROW, old_logprobs=ROW,
             ref_logprobs=ROW, rollout_logprobs=ROW, grad=MAT, scalars="rRdsx", token_loss=ROW,
             token_lse=ROW), ("grad", "scalars") + _TOKENS),
    "LossPlan sparse teacher": Case(
        _sparse_inputs, _sparse_call, dict(teacher_topk_ids=MAT, teacher_topk_logprobs=MAT),
        ("grad", "scalars")),
    "LossPlan sequences": Case(
        _seq_inputs, _seq_call, dict(cu_seqlens="dsx", advantages=ROW, old_logprobs=ROW), ("grad", "scalars")),
    "LinearLossPlan": Case(
        _linear_inputs, _linear_call,
        dict(hidden="cCds", weight=MAT, labels=ROW, weights=ROW, teacher_hidden=MAT, teacher_weight=MAT,
             grad_hidden=MAT, grad_weight=MAT, scalars="rRdsx", token_loss=ROW),
        ("grad_hidden", "grad_weight", "scalars", "token_loss")),
    "LossPlan.stats / finish": Case(
        lambda rng: dict(logits=f32(rng, R, V), labels=labels(rng), weights=per_row(rng), grad=nan(R, V),
                         scalars=nan(len(SCALARS)), stats_logits=f32(rng, R, V), stats_labels=labels(rng)),
        _finish_call, dict(logits="cCds", labels=ROW, weights=ROW, grad=MAT, scalars="rRdsx"),
        ("grad", "scalars")),
    "fused_loss": Case(
        lambda rng: dict(logits=f32(rng, R, V), labels=labels(rng), weights=per_row(rng)),
        lambda a: headloss.fused_loss(a["logits"], a["labels"], weights=a["weights"]),
        dict(logits="ds", labels=ROW, weights=ROW)),
    "aggregation": Case(
        lambda rng: dict(labels=labels(rng), cu_seqlens=np.array([0, 2, R], np.int64)),
        lambda a: headloss.aggregation(a["labels"], a["cu_seqlens"], "seq_mean_token_mean"),
        dict(labels="d", cu_seqlens="dx")),
}


class FakeDevice:
    """An array in GPU memory as far as the package can tell; its memory is never read."""

    def __init__(self, a):
        self.__cuda_array_interface__ = dict(shape=a.shape, typestr=a.dtype.str, data=(0xdead0000, False),
                                             strides=None, version=3)


def _resize(a, axis, by):
    if by < 0:
        return np.take(a, range(a.shape[axis] + by), axis=axis).copy()
    return np.concatenate([a, np.take(a, range(by), axis=axis)], axis=axis)


def variant(a: np.ndarray, kind: str):
    """The valid array `a` made wrong one way (see the module's docstring)."""
    row_axis = 1 if a.ndim >= 3 else 0
    if kind in "rR":
        return _resize(a, row_axis, -1 if kind == "r" else 1)
    if kind in "cC":
        return _resize(a, a.ndim - 1, -1 if kind == "c" else 1)
    if kind == "d":
        return np.zeros(a.shape, np.float32 if a.dtype.kind == "i" else np.int32)
    if kind == "s":  # every other element of the last axis of one twice as wide
        wide = np.repeat(a, 2, axis=a.ndim - 1)
        return wide[..., ::2]
    if kind == "x":
        return FakeDevice(a)
    raise AssertionError(kind)


PARAMS = [(case, arg, kind) for case, c in CASES.items() for arg, kinds in c.vary.items() for kind in kinds]


@pytest.mark.parametrize("case, arg, kind", PARAMS, ids=[f"{c}-{a}-{k}" for c, a, k in PARAMS])
def test_numpy_entry_points_check_every_array(case, arg, kind):
    c = CASES[case]
    rng = np.random.default_rng(0)
    a = c.make(rng)
    c.run({k: v.copy() for k, v in a.items()})  # the valid call passes
    bad = dict(a)
    bad[arg] = variant(a[arg], kind)
    poisoned = {k: bad[k] for k in c.outputs if isinstance(bad[k], np.ndarray)}
    before = {k: v.copy() for k, v in poisoned.items()}
    with pytest.raises(headloss.HeadlossError) as e:
        c.run(bad)
    assert isinstance(e.value, (ValueError, TypeError)), type(e.value)
    assert arg in str(e.value), f"the error does not name {arg}: {e.value}"
    for k, v in poisoned.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"{k} changed by a refused call")


# ---- PyTorch (CPU tensors run on the CPU backend) ------------------------------------------------

def _torch_cases(torch, ops, tl):
    t = lambda x: torch.from_numpy(x)  # noqa: E731
    loss_kw = dict(terms=("ce", "distill_fwd"))

    def lm(a):
        return ops.lm_head_loss(t(a["logits"]), t(a["labels"]), weights=t(a["weights"]),
                                teacher_logits=t(a["teacher_logits"]), **loss_kw)

    def lm_module(a):
        return ops.LMHeadLoss(**loss_kw)(t(a["logits"]), t(a["labels"]), weights=t(a["weights"]),
                                         teacher_logits=t(a["teacher_logits"]))

    def fused_module(a):
        return tl.FusedLMHeadLoss(**loss_kw)(t(a["logits"]), t(a["labels"]), weights=t(a["weights"]),
                                             teacher_logits=t(a["teacher_logits"]))

    def fused_fn(a):
        return tl.fused_lm_head_loss(t(a["logits"]), t(a["labels"]), weights=t(a["weights"]),
                                     teacher_logits=t(a["teacher_logits"]), **loss_kw)

    def linear(a):
        return ops.linear_loss(t(a["hidden"]), t(a["weight"]), t(a["labels"]), weights=t(a["weights"]))

    def linear_module(a):
        return ops.LinearLoss()(t(a["hidden"]), t(a["weight"]), t(a["labels"]), weights=t(a["weights"]))

    def linear_fn(a):
        plan = LinearLossPlan(V, H, "float32", terms="ce")
        return tl.LinearLossFunction.apply(t(a["hidden"]), t(a["weight"]), t(a["labels"]), plan, None, None,
                                           t(a["weights"]))

    def norm(a):
        return ops.rmsnorm(t(a["x"]), t(a["weight"]), residual=t(a["residual"]))

    def norm_fwd(a):
        return headloss.rmsnorm_fwd(t(a["x"]), t(a["weight"]), residual=t(a["residual"]), out=t(a["out"]))

    logits_in = lambda rng: dict(logits=f32(rng, R, V), labels=labels(rng), weights=per_row(rng),  # noqa: E731
                                 teacher_logits=f32(rng, R, V))
    linear_in = lambda rng: dict(hidden=f32(rng, R, H), weight=f32(rng, V, H), labels=labels(rng),  # noqa: E731
                                 weights=per_row(rng))
    norm_in = lambda rng: dict(x=f32(rng, R, C), weight=f32(rng, C), residual=f32(rng, R, C),  # noqa: E731
                               out=nan(R, C))
    # The custom ops and modules reshape per-row inputs and matrices to packed ones (a copy
    # where needed), so only the fused-loss forms see a strided per-row array as such.
    loss_vary = dict(logits="cCd", labels="rRds", weights="rRds", teacher_logits="rRcCds")
    # hidden sets H, and the weight's rows the vocabulary, except for a plan of one's own.
    linear_vary = dict(hidden="d", weight="cCd", labels="rRd", weights="rRd")
    return {
        "lm_head_loss": Case(logits_in, lm, loss_vary),
        "LMHeadLoss": Case(logits_in, lm_module, loss_vary),
        "FusedLMHeadLoss": Case(logits_in, fused_module, loss_vary),
        "fused_lm_head_loss": Case(logits_in, fused_fn, loss_vary),
        "linear_loss": Case(linear_in, linear, linear_vary),
        "LinearLoss": Case(linear_in, linear_module, linear_vary),
        "LinearLossFunction": Case(linear_in, linear_fn, dict(linear_vary, weight="rRcCd")),
        "torch_ops.rmsnorm": Case(norm_in, norm, dict(weight="rRds", residual="rRcCds")),
        "rmsnorm_fwd (torch)": Case(norm_in, norm_fwd, dict(weight="rRds", residual="rRcCds", out="rRcCds"),
                                    ("out",)),
    }


TORCH_CASES = ["lm_head_loss", "LMHeadLoss", "FusedLMHeadLoss", "fused_lm_head_loss", "linear_loss", "LinearLoss",
               "LinearLossFunction", "torch_ops.rmsnorm", "rmsnorm_fwd (torch)"]


@pytest.fixture(scope="module")
def torch_cases():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from headloss import torch_loss, torch_ops
    return torch, _torch_cases(torch, torch_ops, torch_loss)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_entry_points_check_every_array(torch_cases, case):
    torch, cases = torch_cases
    c = cases[case]
    a = c.make(np.random.default_rng(0))
    c.run({k: v.copy() for k, v in a.items()})
    for arg, kinds in c.vary.items():
        for kind in kinds:
            bad = dict(a)
            bad[arg] = variant(a[arg], kind)
            before = {k: bad[k].copy() for k in c.outputs}
            with pytest.raises(headloss.HeadlossError, match=arg):
                c.run(bad)
            for k in c.outputs:
                np.testing.assert_array_equal(bad[k], before[k])


def test_torch_device_is_checked(torch_cases):
    torch, _ = torch_cases
    x = torch.zeros(R, C)
    with pytest.raises(headloss.HeadlossTypeError, match="weight is on the torch device meta"):
        headloss.rmsnorm_fwd(x, torch.zeros(C, device="meta"))


# ---- JAX (shapes and dtypes at trace time) -------------------------------------------------------

def _jax_cases(jnp, hlj):
    j = {}

    def fused(a):
        return hlj.fused_loss(jnp.asarray(a["logits"]), jnp.asarray(a["labels"]), weights=jnp.asarray(a["weights"]),
                              teacher_logits=jnp.asarray(a["teacher_logits"]), terms=("ce", "distill_fwd"))

    def linear(a):
        return hlj.linear_loss(jnp.asarray(a["hidden"]), jnp.asarray(a["weight"]), jnp.asarray(a["labels"]),
                               weights=jnp.asarray(a["weights"]))

    def stats(a):
        return hlj.loss_stats(jnp.asarray(a["logits"]), jnp.asarray(a["labels"]), vocab_start=0,
                              vocab_global=V, ranks=1, teacher_logits=jnp.asarray(a["teacher_logits"]),
                              terms=("ce", "distill_fwd"))

    def norm_fwd(a):
        return hlj.rmsnorm_fwd(jnp.asarray(a["x"]), jnp.asarray(a["weight"]), residual=jnp.asarray(a["residual"]))

    def norm_bwd(a):
        return hlj.rmsnorm_bwd(jnp.asarray(a["dy"]), jnp.asarray(a["x"]), jnp.asarray(a["weight"]),
                               jnp.asarray(a["rstd"]), dresidual_out=jnp.asarray(a["dresidual_out"]))

    logits_in = lambda rng: dict(logits=f32(rng, R, V), labels=labels(rng, dtype=np.int32),  # noqa: E731
                                 weights=per_row(rng), teacher_logits=f32(rng, R, V))
    j["fused_loss"] = Case(logits_in, fused, dict(logits="d", labels="rRd", weights="rRd", teacher_logits="rRcCd"))
    j["loss_stats"] = Case(logits_in, stats, dict(labels="rRd", teacher_logits="rRcCd"))
    j["linear_loss"] = Case(lambda rng: dict(hidden=f32(rng, R, H), weight=f32(rng, V, H),
                                             labels=labels(rng, dtype=np.int32), weights=per_row(rng)),
                            linear, dict(hidden="d", weight="cCd", labels="rRd", weights="rRd"))
    j["rmsnorm_fwd"] = Case(lambda rng: dict(x=f32(rng, R, C), weight=f32(rng, C), residual=f32(rng, R, C)),
                            norm_fwd, dict(x="d", weight="rRd", residual="rRcCd"))
    j["rmsnorm_bwd"] = Case(lambda rng: dict(dy=f32(rng, R, C), x=f32(rng, R, C), weight=f32(rng, C),
                                             rstd=per_row(rng), dresidual_out=f32(rng, R, C)),
                            norm_bwd, dict(dy="rRcCd", x="d", weight="rRd", rstd="rRd", dresidual_out="rRcCd"))
    return j


JAX_CASES = ["fused_loss", "loss_stats", "linear_loss", "rmsnorm_fwd", "rmsnorm_bwd"]


@pytest.mark.parametrize("case", JAX_CASES)
def test_jax_functions_check_every_array(case):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    try:
        import headloss.jax as hlj
    except ImportError as e:
        pytest.skip(f"no JAX adapter: {e}")
    c = _jax_cases(jax.numpy, hlj)[case]
    a = c.make(np.random.default_rng(0))
    with jax.default_device(jax.devices("cpu")[0]):
        c.run(a)
        for arg, kinds in c.vary.items():
            for kind in kinds:
                with pytest.raises(headloss.HeadlossError, match=arg):
                    c.run(dict(a, **{arg: variant(a[arg], kind)}))
