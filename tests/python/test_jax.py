"""headloss.jax: the XLA FFI handlers (libheadloss_jax.so) under jax.jit and jax.grad, against
jax.numpy references, on each JAX platform present ("cpu" runs the CPU reference backend, "gpu"
the CUDA kernels on XLA's stream). Skips without jax or without the adapter library."""
import os
import subprocess
import sys
import types
import zlib
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import headloss  # noqa: E402
from headloss.loss import SCALARS  # noqa: E402

try:
    import headloss.jax as hlj
except ImportError as e:  # the adapter is built only where jax's FFI headers were found
    pytest.skip(f"headloss.jax unavailable: {e}", allow_module_level=True)

EPS = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def _platforms():
    out = ["cpu"]
    try:
        if jax.devices("gpu") and headloss.cuda_available():
            out.append("gpu")
    except RuntimeError:
        pass
    return out


PLATFORMS = ["cpu", "gpu"]


@pytest.fixture(params=PLATFORMS)
def device(request):
    if request.param not in _platforms():
        pytest.skip("no JAX GPU backend, or the library's CUDA backend is unavailable")
    return jax.devices(request.param)[0]


def ref_rmsnorm(x, w, r=None):
    s = x if r is None else x + r
    sf = s.astype(jnp.float32)
    y = sf * jax.lax.rsqrt(jnp.mean(sf * sf, -1, keepdims=True) + EPS)
    return (y * w.astype(jnp.float32) if w is not None else y), s


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_fwd_and_grad(device, dtype, rng):
    tol = 1e-5 if dtype == "float32" else 2e-2
    put = lambda a: jax.device_put(jnp.asarray(a, dtype), device)  # noqa: E731
    x, r = put(rng.standard_normal((4, 6, 256))), put(rng.standard_normal((4, 6, 256)))
    w = put(1 + 0.1 * rng.standard_normal(256))
    ct = jax.device_put(jnp.asarray(rng.standard_normal((4, 6, 256)), jnp.float32), device)

    y = jax.jit(lambda x, w: hlj.rmsnorm(x, w, eps=EPS))(x, w)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel(y.astype(jnp.float32), ref_rmsnorm(x, w)[0]) <= tol

    def f(x, w, r):
        y, s = hlj.rmsnorm(x, w, eps=EPS, residual=r)
        return jnp.sum(y.astype(jnp.float32) * ct) + jnp.sum(jnp.sin(s.astype(jnp.float32)))

    def f_ref(x, w, r):
        y, s = ref_rmsnorm(x, w, r)
        return jnp.sum(y * ct) + jnp.sum(jnp.sin(s.astype(jnp.float32)))

    ours = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, r)
    theirs = jax.grad(f_ref, argnums=(0, 1, 2))(x, w, r)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        assert rel(a.astype(jnp.float32), b.astype(jnp.float32)) <= tol


def test_rmsnorm_no_weight(device, rng):
    x = jax.device_put(jnp.asarray(rng.standard_normal((5, 70)), jnp.float32), device)
    g = jax.grad(lambda x: jnp.sum(jnp.cos(hlj.rmsnorm(x, eps=EPS))))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.cos(ref_rmsnorm(x, None)[0])))(x)
    assert rel(g, g_ref) <= 1e-5


def ref_loss(z, labels, z_weight):
    lse = jax.nn.logsumexp(z.astype(jnp.float32), -1)
    ce = lse - jnp.take_along_axis(z.astype(jnp.float32), labels[:, None], -1)[:, 0]
    return jnp.mean(ce) + z_weight * jnp.mean(lse * lse)


def test_loss_value_grad_and_plan_reuse(device, rng):
    z = jax.device_put(jnp.asarray(rng.standard_normal((32, 1000)), jnp.float32), device)
    labels = jax.device_put(jnp.asarray(rng.integers(0, 1000, 32), jnp.int32), device)

    @jax.jit
    def step(z, labels):
        (loss, metrics), g = jax.value_and_grad(
            lambda z: hlj.fused_loss(z, labels, terms=("ce", "z"), z_weight=1e-3), has_aux=True)(z)
        return loss, metrics, g

    loss, metrics, g = step(z, labels)
    assert rel(loss, ref_loss(z, labels, 1e-3)) <= 1e-5
    assert rel(metrics["ce"], ref_loss(z, labels, 0.0)) <= 1e-5
    assert rel(g, jax.grad(ref_loss)(z, labels, 1e-3)) <= 1e-5
    # A cotangent other than 1 scales the saved gradient.
    g3 = jax.grad(lambda z: 3.0 * hlj.fused_loss(z, labels, terms=("ce", "z"), z_weight=1e-3)[0])(z)
    assert rel(g3, 3.0 * g) <= 1e-6
    n = hlj.loss_plan_count()
    for i in range(3):  # same configuration, new data: no new plan, no recompilation
        step(z * (i + 2), labels)[0].block_until_ready()
    assert hlj.loss_plan_count() == n


def test_loss_bf16_tokens(device, rng):
    z = jax.device_put(jnp.asarray(rng.standard_normal((8, 4, 512)), jnp.bfloat16), device)
    labels = jax.device_put(jnp.asarray(rng.integers(0, 512, (8, 4)), jnp.int32), device)
    labels = labels.at[0, 0].set(-100)
    loss, metrics, toks = jax.jit(lambda z, l: hlj.fused_loss(z, l, token_outputs=True))(z, labels)
    assert float(metrics["valid_rows"]) == 31
    token_loss = np.asarray(toks[0]).reshape(-1)
    assert token_loss[0] == 0 and rel(np.mean(token_loss[1:]), loss) <= 1e-5


def test_loss_error_carries_message(device, rng):
    z = jax.device_put(jnp.zeros((4, 10), jnp.float32), device)
    labels = jax.device_put(jnp.asarray([0, 1, 2, 99], jnp.int32), device)
    with pytest.raises(Exception, match="labels"):
        hlj.fused_loss(z, labels)[0].block_until_ready()
    with pytest.raises(headloss.HeadlossTypeError, match="unknown loss plan option 'zz_weight'; the numeric options are ce_weight"):
        hlj.fused_loss(z, labels, zz_weight=1.0)


def test_shard_map_example():
    """examples/jax_shard_map.py: the sharded loss under jax.shard_map against fused_loss. In its own
    process: XLA fixes the number of host devices when jax starts, and this one has started."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example asks for 4
    env["HEADLOSS_LIBRARY"] = str(headloss._lib.lib_path)
    env["HEADLOSS_JAX_LIBRARY"] = str(hlj.adapter_path)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_shard_map.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


# The split steps on two uneven shards of one vocabulary.
N, V, SHARDS = 24, 700, [(0, 300), (300, 400)]
SPLIT_OPTIONS = dict(terms=("ce", "z", "distill_fwd"), z_weight=1e-3, label_smoothing=0.1,
                     teacher_temperature=2.0, ignore_index=5)


def split_inputs(rng):
    z = rng.standard_normal((N, V)).astype(np.float32) * 3
    t = rng.standard_normal((N, V)).astype(np.float32)
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[[1, 7]] = -100, 5  # ignored: negative, and ignore_index
    weights = rng.uniform(0.5, 2.0, N).astype(np.float32)
    return z, t, labels, weights


def cols(a, shard):
    return a[:, shard[0]:shard[0] + shard[1]]


def test_split_steps_match_loss_plan(rng):
    """loss_stats / loss_finish give LossPlan.stats / finish's bits (vocab_start traced under jit)."""
    z, t, labels, weights = split_inputs(rng)
    cpu = jax.devices("cpu")[0]
    kw = dict(SPLIT_OPTIONS, vocab_global=V, ranks=len(SHARDS))
    stats = jax.jit(lambda z, t, y, start: hlj.loss_stats(z, y, teacher_logits=t, vocab_start=start,
                                                          **kw))
    finish = jax.jit(lambda g, z, t, y, w, start: hlj.loss_finish(
        g, z, y, teacher_logits=t, weights=w, vocab_start=start, token_outputs=True, **kw))
    plans = [headloss.LossPlan(s[1], "float32", labels_dtype="int32", grad_dtype="float32",
                               vocab_start=s[0], **kw) for s in SHARDS]
    with jax.default_device(cpu):
        blocks = [stats(cols(z, s), cols(t, s), labels, np.int32(s[0])) for s in SHARDS]
        ref_blocks = [p.stats(cols(z, s), labels, teacher_logits=cols(t, s))
                      for p, s in zip(plans, SHARDS)]
        for b, rb in zip(blocks, ref_blocks):
            assert b.dtype == jnp.uint8 and np.array_equal(np.asarray(b), rb.view(np.uint8))
        gathered = jnp.concatenate(blocks)
        for p, s in zip(plans, SHARDS):
            loss, metrics, grad, toks = finish(gathered, cols(z, s), cols(t, s), labels, weights,
                                               np.int32(s[0]))
            ref = p.finish(np.concatenate(ref_blocks), cols(z, s), labels, teacher_logits=cols(t, s),
                           weights=weights, token_outputs=True)
            got = np.array([metrics[k] for k in SCALARS])
            assert np.array_equal(got, ref.scalars) and loss == ref.scalars[0]
            assert np.array_equal(np.asarray(grad), ref.grad)
            for a, b in zip(toks, ref[2:]):
                assert np.array_equal(np.asarray(a), b)


def test_split_steps_against_fused_loss(device, rng):
    """loss_stats / loss_finish on two uneven shards held by one device, and sharded_fused_loss on a
    one-device mesh, against fused_loss (on the GPU: the CUDA handlers, vocab_start read back)."""
    z, t, labels, weights = [jax.device_put(a, device) for a in split_inputs(rng)]

    def whole(z):
        return hlj.fused_loss(z, labels, teacher_logits=t, weights=weights, **SPLIT_OPTIONS)[0]
    ref_loss, ref_grad = jax.value_and_grad(whole)(z)
    kw = dict(SPLIT_OPTIONS, vocab_global=V, ranks=len(SHARDS), weights=weights)
    start = [jax.device_put(np.int32(s[0]), device) for s in SHARDS]  # in device memory
    shards = [(cols(z, s), dict(kw, teacher_logits=cols(t, s), vocab_start=v0))
              for s, v0 in zip(SHARDS, start)]
    gathered = jnp.concatenate([hlj.loss_stats(zs, labels, **a) for zs, a in shards])
    outs = [hlj.loss_finish(gathered, zs, labels, **a) for zs, a in shards]
    assert outs[0][0] == outs[1][0] and rel(outs[0][0], ref_loss) <= 1e-5
    assert rel(jnp.concatenate([o[2] for o in outs], axis=1), ref_grad) <= 1e-4

    mesh = jax.sharding.Mesh(np.array([device]), ("tp",))
    sharded = jax.shard_map(jax.value_and_grad(lambda z, y, t, w: hlj.sharded_fused_loss(
        z, y, axis_name="tp", vocab_global=V, teacher_logits=t, weights=w, **SPLIT_OPTIONS)[0]),
        mesh=mesh, in_specs=(P(None, "tp"), P(), P(None, "tp"), P()), out_specs=(P(), P(None, "tp")))
    loss, grad = jax.jit(sharded)(z, labels, t, weights)
    assert rel(loss, ref_loss) <= 1e-5 and rel(grad, ref_grad) <= 1e-4


def _topk(rng, t, k=16):
    """A sparse teacher from teacher logits t: each row's top k (global ids), row 3 half padding."""
    lq = t - np.log(np.exp(t).sum(1, keepdims=True))
    ids = np.argsort(-t, 1)[:, :k].astype(np.int32)
    lp = np.take_along_axis(lq, ids, 1).astype(np.float32)
    ids[3, k // 2:] = -1
    return ids, lp


@pytest.mark.parametrize("teacher", ["sparse", "jsd"])
def test_split_distill_against_fused_loss(device, rng, teacher):
    """A sparse teacher (one exchange) and dense JSD (loss_middle and a second one): the split
    steps on two uneven shards and sharded_fused_loss on a one-device mesh against fused_loss."""
    z, t, labels, weights = [jax.device_put(a, device) for a in split_inputs(rng)]
    if teacher == "sparse":
        ids, lp = [jax.device_put(a, device) for a in _topk(rng, np.asarray(t))]
        opts, tin = dict(terms=("ce", "distill_rev"), student_temperature=1.5), dict(teacher_topk_ids=ids, teacher_topk_logprobs=lp)
        tcols = lambda s: {}  # noqa: E731  (global ids: the same on every shard)
    else:
        opts, tin = dict(terms=("ce", "entropy", "distill_jsd"), entropy_weight=1.0, jsd_beta=0.375,
                          teacher_temperature=2.0), dict(teacher_logits=t)
        tcols = lambda s: dict(teacher_logits=cols(t, s))  # noqa: E731
    common = {k: v for k, v in tin.items() if k != "teacher_logits"}

    def whole(z):
        return hlj.fused_loss(z, labels, weights=weights, **tin, **opts)[0]
    ref_loss, ref_grad = jax.value_and_grad(whole)(z)
    kw = dict(opts, vocab_global=V, ranks=len(SHARDS), weights=weights, **common)
    shards = [(cols(z, s), dict(kw, vocab_start=jax.device_put(np.int32(s[0]), device), **tcols(s)))
              for s in SHARDS]
    assert hlj.loss_exchanges(*shards[0][0:1], labels, vocab_global=V, ranks=2, **opts, **common,
                              **tcols(SHARDS[0])) == (2 if teacher == "jsd" else 1)
    gathered = jnp.concatenate([hlj.loss_stats(zs, labels, **a) for zs, a in shards])
    mid = {}
    if teacher == "jsd":
        mid["gathered_middle"] = jnp.concatenate([hlj.loss_middle(gathered, zs, labels, **a) for zs, a in shards])
    outs = [hlj.loss_finish(gathered, zs, labels, **a, **mid) for zs, a in shards]
    assert outs[0][0] == outs[1][0] and rel(outs[0][0], ref_loss) <= 1e-5
    assert rel(jnp.concatenate([o[2] for o in outs], axis=1), ref_grad) <= 1e-4

    mesh = jax.sharding.Mesh(np.array([device]), ("tp",))
    tspec = P(None, "tp") if teacher == "jsd" else P()
    tkeys = list(tin)
    sharded = jax.shard_map(jax.value_and_grad(lambda z, y, w, *tv: hlj.sharded_fused_loss(
        z, y, axis_name="tp", vocab_global=V, weights=w, **dict(zip(tkeys, tv)), **opts)[0]),
        mesh=mesh, in_specs=(P(None, "tp"), P(), P(), *([tspec] * len(tkeys))), out_specs=(P(), P(None, "tp")))
    loss, grad = jax.jit(sharded)(z, labels, weights, *tin.values())
    assert rel(loss, ref_loss) <= 1e-5 and rel(grad, ref_grad) <= 1e-4


def test_finish_refuses_blocks_of_other_shards(rng):
    z, t, labels, weights = split_inputs(rng)
    kw = dict(SPLIT_OPTIONS, vocab_global=V, ranks=len(SHARDS), teacher_logits=cols(t, SHARDS[0]))
    with jax.default_device(jax.devices("cpu")[0]):
        b0 = hlj.loss_stats(cols(z, SHARDS[0]), labels, vocab_start=0, **kw)
        with pytest.raises(Exception, match="column 0 is owned by two shards"):
            hlj.loss_finish(jnp.concatenate([b0, b0]), cols(z, SHARDS[0]), labels, vocab_start=0,
                            **kw)[0].block_until_ready()
        other = hlj.loss_stats(cols(z, SHARDS[0]), labels, vocab_start=0, **dict(kw, z_weight=0.5))
        with pytest.raises(Exception, match="comes from a different plan"):
            hlj.loss_finish(jnp.concatenate([other, b0]), cols(z, SHARDS[0]), labels, vocab_start=0,
                            **kw)[0].block_until_ready()


def test_sharded_loss_needs_equal_shards():
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("tp",))
    z, labels = jnp.zeros((4, 10), jnp.float32), jnp.zeros((4,), jnp.int32)
    f = jax.shard_map(lambda z, y: hlj.sharded_fused_loss(z, y, axis_name="tp", vocab_global=12)[0],
                      mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=P())
    with pytest.raises(ValueError, match="equal shards"):
        f(z, labels)


@pytest.mark.parametrize("case", ["sparse_rl", "sparse_jsd", "sparse_k1", "jsd_ce"])
def test_loss_distill_against_reference(device, case):
    """A sparse teacher (ids and log-probs [4, 6, k]; padding rows) and dense JSD under
    jit(value_and_grad): the loss, every metric and the gradient against the fp64 reference."""
    from test_loss import build, rel as rel_np, run_ref
    terms, opts, inp = build(np.random.default_rng(zlib.crc32(case.encode())), 24, 300, "float32", case)
    put = {k: jax.device_put(jnp.asarray(v).reshape(4, 6, *v.shape[1:]), device) for k, v in inp.items()}
    z, y = put.pop("logits"), put.pop("labels", None)

    @jax.jit
    def step(z):
        return jax.value_and_grad(lambda z: hlj.fused_loss(z, y, terms=terms, **put, **opts), has_aux=True)(z)

    (loss, metrics), g = step(z)
    want, _, want_g = run_ref(inp, terms, opts)
    tol = 2e-6 if device.platform == "cpu" else 2e-4
    for k in SCALARS:
        assert abs(float(metrics[k]) - want.get(k, 0.0)) <= tol * (1 + abs(want.get(k, 0.0))), k
    assert float(loss) == float(metrics["loss"]) and float(metrics["distill"]) > 0
    assert rel_np(np.asarray(g, np.float64).reshape(24, 300), want_g) < (1e-5 if device.platform == "cpu" else 1e-4)


def test_loss_topk_shapes_checked():
    z = jnp.zeros((6, 50), jnp.float32)
    ids, lp = jnp.zeros((6, 8), jnp.int32), jnp.zeros((6, 8), jnp.float32)
    with pytest.raises(ValueError, match="go together"):
        hlj.fused_loss(z, terms=("distill_fwd",), teacher_topk_ids=ids)
    with pytest.raises(ValueError, match=r"teacher_topk_logprobs is \[6, 7\] as rows x columns .*; expected \[6, 8\]"):
        hlj.fused_loss(z, terms=("distill_fwd",), teacher_topk_ids=ids, teacher_topk_logprobs=lp[:, :7])
    with pytest.raises(ValueError, match="teacher_topk is 4"):
        hlj.fused_loss(z, terms=("distill_fwd",), teacher_topk_ids=ids, teacher_topk_logprobs=lp, teacher_topk=4)


# ---- the fused linear form -----------------------------------------------------------------------

def _linear_case(case, dtype, Ht=0, seed=0):
    """(terms, options, NumPy inputs) of test_linear_loss's cases: hidden [23, 40], weight [173, 40]."""
    from test_linear_loss import make
    rng = np.random.default_rng(zlib.crc32(f"jax-lin-{case}-{dtype}-{seed}".encode()))
    return make(rng, 23, 40, 173, dtype, case, Ht=Ht)


def _linear_want(device, inp, terms, opts, scale=1.0):
    from test_linear_loss import reference_linear
    rsc, _, rgh, rgw = reference_linear(inp, terms, opts, "cpu" if device.platform == "cpu" else "cuda")
    return rsc, {}, scale * rgh, scale * rgw


def _linear_check(device, got, want, dtype):
    from test_linear_loss import check
    check(types.SimpleNamespace(name="cpu" if device.platform == "cpu" else "cuda"), got, want, dtype)


def _split_linear(inp, device):
    put = {k: jax.device_put(jnp.asarray(v), device) for k, v in inp.items()}
    return put.pop("hidden"), put.pop("weight"), put.pop("labels", None), put


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["ce", "ce_smooth_weights_cap", "distill_fwd", "grpo_kl", "all",
                                  "rl", "rl_cispo", "gspo_all", "mis_seq_mean", "sparse_rl", "jsd_ce"])
def test_linear_loss_against_reference(device, case, dtype):
    """jit(value_and_grad) w.r.t. hidden and weight, cotangent 2.5, against the fp64 reference of
    matmul + loss: the loss, every metric, both gradients (in the operands' dtypes)."""
    terms, opts, inp = _linear_case(case, dtype)
    x, w, y, kw = _split_linear(inp, device)

    @jax.jit
    def step(x, w):
        def f(x, w):
            loss, metrics = hlj.linear_loss(x, w, y, terms=terms, **kw, **opts)
            return 2.5 * loss, metrics
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)

    (loss, metrics), (gx, gw) = step(x, w)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype and set(metrics) == set(SCALARS)
    sc = {k: float(v) for k, v in metrics.items()}
    assert float(loss) == pytest.approx(2.5 * sc["loss"], rel=1e-6)
    _linear_check(device, (sc, {}, np.asarray(gx, np.float64), np.asarray(gw, np.float64)),
                  _linear_want(device, inp, terms, opts, 2.5), dtype)


def test_linear_loss_fused_teacher_tokens_f32_grad(device):
    """A teacher of its own (teacher_hidden / teacher_weight), token outputs, grad_weight summed in
    fp32 and cast to the weight's bf16 in the backward pass."""
    from test_linear_loss import reference_linear
    terms, opts, inp = _linear_case("all", "bfloat16", Ht=24)
    x, w, y, kw = _split_linear(inp, device)
    def f(x, w):
        loss, metrics, toks = hlj.linear_loss(x, w, y, terms=terms, token_outputs=True,
                                              grad_weight_dtype="float32", **kw, **opts)
        return loss, (metrics, toks)

    f = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    (loss, (metrics, toks)), (gx, gw) = f(x, w)
    assert gw.dtype == jnp.bfloat16
    sc = {k: float(v) for k, v in metrics.items()}
    _linear_check(device, (sc, {}, np.asarray(gx, np.float64), np.asarray(gw, np.float64)),
                  _linear_want(device, inp, terms, opts), "bfloat16")
    rtoks = reference_linear(inp, terms, opts, "cpu" if device.platform == "cpu" else "cuda")[1]
    tol = 1e-6 if device.platform == "cpu" else 0.1
    for got, k in zip(toks, ("loss", "logp", "entropy", "lse")):
        assert rel(got, rtoks[k]) < tol, k


@pytest.mark.parametrize("case", ["gspo_all", "reject_seq_product", "rollout_metrics"])
def test_fused_loss_sequence_options(device, case):
    """GSPO, the rollout corrections and their metrics (rollout_logprobs, cu_seqlens) through
    jit(value_and_grad) of the logits form, against the fp64 reference."""
    from test_loss import build, check, run_ref
    terms, opts, inp = build(np.random.default_rng(zlib.crc32(case.encode())), 24, 300, "float32", case)
    put = {k: jax.device_put(jnp.asarray(v), device) for k, v in inp.items()}
    z, y = put.pop("logits"), put.pop("labels")
    opts = {k: v for k, v in opts.items() if k != "ignore_index"}
    ignore = CASES_IGNORE.get(case)

    @jax.jit
    def step(z):
        return jax.value_and_grad(lambda z: hlj.fused_loss(z, y, terms=terms, ignore_index=ignore, **put,
                                                           **opts), has_aux=True)(z)

    (loss, metrics), g = step(z)
    sc = {k: float(v) for k, v in metrics.items()}
    be = types.SimpleNamespace(name="cpu" if device.platform == "cpu" else "cuda")
    rsc, _, rgrad = run_ref(inp, terms, dict(opts, ignore_index=ignore) if ignore is not None else opts)
    check(be, (sc, {}, np.asarray(g, np.float64)), (rsc, {}, rgrad), "float32")


CASES_IGNORE = {"gspo_all": 7, "reject_seq_product": 7}


def _ffi_params(jaxpr):
    """The attributes of every headloss ffi_call in a jaxpr, nested ones included."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "ffi_call":
            out.append(dict(e.params["attributes"]))
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _ffi_params(inner)
    return out


@pytest.mark.parametrize("argnums, modes", [((0,), (1, 0)), ((1,), (0, 1)), ((0, 1), (1, 1)), (None, (0, 0))])
def test_linear_loss_forms_only_the_gradients_asked_for(argnums, modes):
    """jax.grad w.r.t. hidden alone makes the plan form grad_hidden alone (and so on); the value
    alone forms none. Each result matches the reference."""
    terms, opts, inp = _linear_case("ce", "float32")
    cpu = jax.devices("cpu")[0]
    x, w, y, kw = _split_linear(inp, cpu)
    f = lambda x, w: hlj.linear_loss(x, w, y, terms=terms, **kw, **opts)[0]  # noqa: E731
    fn = f if argnums is None else jax.grad(f, argnums=argnums)
    params = _ffi_params(jax.make_jaxpr(fn)(x, w).jaxpr)
    assert len(params) == 1 and params[0]["linear"] == 1
    assert (params[0]["grad_hidden_mode"], params[0]["grad_weight_mode"]) == modes
    _, _, rgh, rgw = _linear_want(cpu, inp, terms, opts)
    res = jax.jit(fn)(x, w)
    if argnums is not None:
        for i, g in zip(argnums, res):
            assert rel(g, (rgh, rgw)[i]) < 1e-5


def test_linear_loss_plan_reuse_and_workspace_cap(device):
    """One plan per configuration under jit; max_workspace_bytes (down to the plan's minimum:
    chunks of few rows on CUDA) gives the reference's result."""
    terms, opts, inp = _linear_case("ce", "bfloat16")
    x, w, y, kw = _split_linear(inp, device)
    want = _linear_want(device, inp, terms, opts)
    for cap in (None, 0, 1 << 20):
        f = jax.jit(jax.value_and_grad(lambda x, w: hlj.linear_loss(
            x, w, y, terms=terms, max_workspace_bytes=cap, **opts), argnums=(0, 1), has_aux=True))
        (_, metrics), (gx, gw) = f(x, w)
        sc = {k: float(v) for k, v in metrics.items()}
        _linear_check(device, (sc, {}, np.asarray(gx, np.float64), np.asarray(gw, np.float64)), want,
                      "bfloat16")
        n = hlj.loss_plan_count()
        for i in range(2):  # new data, same configuration: no new plan, no recompilation
            f(x * (i + 2), w)[0][0].block_until_ready()
        assert hlj.loss_plan_count() == n


def test_linear_loss_errors():
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        x, w = jnp.zeros((4, 8), jnp.float32), jnp.zeros((10, 8), jnp.float32)
        y = jnp.asarray([0, 1, 2, 99], jnp.int32)
        with pytest.raises(Exception, match="labels"):
            hlj.linear_loss(x, w, y)[0].block_until_ready()
        with pytest.raises(headloss.HeadlossValueError, match=r"weight has shape \[10, 7\]; expected \[any, 8\]"):
            hlj.linear_loss(x, jnp.zeros((10, 7), jnp.float32), y)
        with pytest.raises(headloss.HeadlossTypeError, match="weight is bfloat16; expected float32"):
            hlj.linear_loss(x, w.astype(jnp.bfloat16), y)
        with pytest.raises(ValueError, match="go together"):
            hlj.linear_loss(x, w, y, terms=("distill_fwd",), teacher_hidden=x)
        with pytest.raises(headloss.HeadlossTypeError, match="unknown loss plan option 'zz_weight'"):
            hlj.linear_loss(x, w, y, zz_weight=1.0)


def test_sharded_linear_loss_one_device(device):
    """sharded_linear_loss on a one-device mesh against linear_loss (examples/jax_shard_map.py
    runs it on 4 devices): the same loss, the same gradients w.r.t. hidden and weight."""
    terms, opts, inp = _linear_case("all", "float32", Ht=16)
    x, w, y, kw = _split_linear(inp, device)
    whole = jax.value_and_grad(lambda x, w: hlj.linear_loss(x, w, y, terms=terms, **kw, **opts)[0],
                               argnums=(0, 1))
    ref_loss, (rx, rw) = whole(x, w)
    mesh = jax.sharding.Mesh(np.array([device]), ("tp",))
    names = sorted(kw)
    specs = tuple(P("tp", None) if k in ("teacher_weight",) else P(None, "tp") if k == "teacher_logits" else P()
                  for k in names)

    def body(x, w, y, *rest):
        return jax.value_and_grad(lambda x, w: hlj.sharded_linear_loss(
            x, w, y, axis_name="tp", vocab_global=w.shape[0], terms=terms, **dict(zip(names, rest)),
            **opts)[0], argnums=(0, 1))(x, w)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("tp", None), P()) + specs,
                                 out_specs=(P(), (P(), P("tp", None)))))
    loss, (gx, gw) = step(x, w, y, *(kw[k] for k in names))
    tol = 1e-6 if device.platform == "cpu" else 1e-3
    assert rel(loss, ref_loss) <= tol and rel(gx, rx) <= tol and rel(gw, rw) <= tol
