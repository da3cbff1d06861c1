"""The vocabulary-sharded (tensor-parallel) loss: R ranks simulated in one process (on the CPU
backend, or on one GPU), each with its slice of the logits, the blocks of statistics concatenated
(the all-gather), and every rank's finish compared with the unsharded run: the same bits on every
rank, scalars within 1e-6 (the GRPO ratio metrics 4e-6), fp32 gradient slices within 1e-5, per-token outputs within 1e-5 (a
token's loss is a difference of large terms, and the GPU merges in fp32 in another order). Then
every refusal of bad blocks. A sparse teacher (global ids, each rank's record carrying the
student's logits at the ids in its shard) and dense JSD (a middle step and a second exchange) are
checked against the fp64 reference too. The NCCL path on two GPUs is in test_loss_nccl.py."""
import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS, LossPlan
from test_loss import CASES, GRAD_TOL, be, make_inputs, rel, run_ref  # noqa: F401  (be: the backend fixture)

N, V = 37, 1000


def random_shards(rng, R, V):
    """R contiguous, non-empty, uneven shards of [0, V) as (start, size)."""
    cuts = np.sort(rng.choice(np.arange(1, V), R - 1, replace=False))
    edges = [0, *cuts.tolist(), V]
    return [(edges[r], edges[r + 1] - edges[r]) for r in range(R)]


def plan_for(be, inp, terms, opts, shard=None, ranks=2, **extra):
    dtype = str(inp["logits"].dtype)
    labels_dtype = str(inp["labels"].dtype) if "labels" in inp else None
    kw = {} if shard is None else {"vocab_start": shard[0], "vocab_global": V, "ranks": ranks}
    if "teacher_topk_ids" in inp:
        kw["topk_ids_dtype"] = str(inp["teacher_topk_ids"].dtype)
    vocab = V if shard is None else shard[1]
    return LossPlan(vocab, dtype, terms=terms, device=be.name, labels_dtype=labels_dtype,
                    grad_dtype="float32", **kw, **opts, **extra)


def columns(be, inp, key, shard):
    if key not in inp:
        return None
    return be.to_dev(np.ascontiguousarray(inp[key][:, shard[0]:shard[0] + shard[1]]))


def per_row(be, inp):
    return {k: be.to_dev(inp[k]) for k in ("weights", "advantages", "old_logprobs", "ref_logprobs",
                                            "rollout_logprobs", "cu_seqlens") if k in inp}


def sparse(be, inp):
    """A sparse teacher's arrays (global ids: the same on every rank), if the case has one."""
    return {k: be.to_dev(inp[k]) for k in ("teacher_topk_ids", "teacher_topk_logprobs") if k in inp}


def concat(be, blocks):
    """The all-gather, simulated: the blocks one after another."""
    if be.name == "cpu":
        return np.concatenate(blocks)
    return be.torch.cat(blocks)


def run_sharded(be, inp, terms, opts, shards):
    """Every rank's LossOutput (its outputs NaN-poisoned before the finish), after the simulated
    all-gather (and, for a plan of two exchanges, the middle step and the second one)."""
    plans = [plan_for(be, inp, terms, opts, s, len(shards)) for s in shards]
    labels = be.to_dev(inp["labels"]) if "labels" in inp else None
    blocks = [p.stats(columns(be, inp, "logits", s), labels,
                      teacher_logits=columns(be, inp, "teacher_logits", s), **sparse(be, inp))
              for p, s in zip(plans, shards)]
    gathered = concat(be, blocks)
    mid = {}
    if plans[0].exchanges == 2:
        mid["gathered_middle"] = concat(be, [
            p.middle(gathered, columns(be, inp, "logits", s), labels,
                     teacher_logits=columns(be, inp, "teacher_logits", s)) for p, s in zip(plans, shards)])
    return [p.finish(gathered, columns(be, inp, "logits", s), labels,
                     scalars=be.full((len(SCALARS),), "float32"),
                     tokens=[be.full((N,), "float32") for _ in range(4)], grad=be.full((N, s[1]), "float32"),
                     teacher_logits=columns(be, inp, "teacher_logits", s), **sparse(be, inp), **mid,
                     **per_row(be, inp))
            for p, s in zip(plans, shards)]


def one_shard_row(rng, inp, shards, i=5):
    """Row i's sparse teacher with all its ids in the widest shard (other ranks hold none)."""
    start, size = max(shards, key=lambda s: s[1])
    ids = inp["teacher_topk_ids"]
    k = ids.shape[1]
    ids[i] = start + rng.choice(size, k, replace=False) if size >= k else -1
    q = rng.dirichlet(np.ones(k)) * 0.9
    inp["teacher_topk_logprobs"][i] = np.log(q).astype(np.float32)


DISTILL_CASES = ["sparse_fwd", "sparse_rev", "sparse_jsd", "sparse_rl", "sparse_jsd_ce", "sparse_k1",
                 "jsd", "jsd_ce"]


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("case", ["all", "ce_smooth_weights_cap", "distill_fwd", "grpo_kl", "rl",
                                  "rl_cispo", "gspo_all", "mis_seq_mean"] + DISTILL_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_matches_unsharded(be, rng, R, case, dtype):
    terms, opts, flags = CASES[case]
    flags = dict(flags)
    inp = make_inputs(rng, N, V, dtype, labels=flags.pop("labels", "int64"), **flags)
    # A row whose maximum sits in two shards: the accuracy's argmax must pick the first column.
    inp["logits"][3, 10] = inp["logits"][3, V - 10] = 40.0
    if "labels" in inp:  # some rows right, so the accuracy tests the merged (global) argmax
        hit = [i for i in range(2, N, 3) if inp["labels"][i] >= 0]
        inp["labels"][hit] = np.argmax(inp["logits"][hit].astype(np.float32), axis=1)
    shards = random_shards(rng, R, V)
    if "teacher_topk_ids" in inp:
        one_shard_row(rng, inp, shards)
    full = plan_for(be, inp, terms, opts)(
        be.to_dev(inp["logits"]), be.to_dev(inp["labels"]) if "labels" in inp else None,
        token_outputs=True, teacher_logits=columns(be, inp, "teacher_logits", (0, V)),
        **sparse(be, inp), **per_row(be, inp))
    outs = run_sharded(be, inp, terms, opts, shards)
    ref = be.to_np(full.scalars)
    got = [be.to_np(o.scalars) for o in outs]
    for r, out in enumerate(outs):
        # Every rank merges the same blocks in the same order: the same bits.
        assert np.array_equal(got[r], got[0])
        for t in range(4):
            assert np.array_equal(be.to_np(out[2 + t]), be.to_np(outs[0][2 + t]))
    # Sharded and unsharded runs merge a row's statistics in different orders (ranks vs warps and
    # CTAs), so on the GPU they differ by a few fp32 ulps of each row's lse; summed over rows
    # that reaches ~2e-6 relative (seen: 1.4e-6 on the loss). The GRPO ratio metrics are
    # exp(log-prob difference): their relative error is the log-prob's absolute error.
    tol = [5e-6] * len(SCALARS)
    bad = [(SCALARS[k], got[0][k], ref[k]) for k in range(len(SCALARS))
           if abs(got[0][k] - ref[k]) > tol[k] * max(abs(ref[k]), 1e-3)]
    assert not bad, f"{bad} differ from the unsharded run (shards {shards})"
    for t in range(4):
        assert np.allclose(be.to_np(outs[0][2 + t]), be.to_np(full[2 + t]), rtol=1e-5, atol=1e-5)
    grad = np.concatenate([be.to_np(o.grad) for o in outs], axis=1)
    g_ref = be.to_np(full.grad)
    assert np.linalg.norm(grad - g_ref) <= 1e-5 * np.linalg.norm(g_ref)
    if case in DISTILL_CASES:  # and the fp64 reference
        rsc, rtoks, rgrad = run_ref(inp, terms, opts)
        tol = 2e-4 if be.name == "cuda" else 2e-6
        for k, name in enumerate(SCALARS):
            assert abs(got[0][k] - rsc.get(name, 0.0)) <= tol * (1 + abs(rsc.get(name, 0.0))), name
        assert rel(be.to_np(outs[0].token_loss), rtoks["loss"]) < (1e-4 if be.name == "cuda" else 1e-6)
        assert rel(grad, rgrad) < GRAD_TOL["float32"] * (5 if be.name == "cuda" else 1)


@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("beta", [0.125, 0.5, 0.875])
def test_sharded_jsd_betas(be, rng, R, beta):
    """Dense JSD's two exchanges at several betas, with CE, z-loss and entropy, against the
    reference."""
    terms, opts = ("ce", "z", "entropy", "distill_jsd"), dict(jsd_beta=beta, z_weight=1e-3,
                                                              entropy_weight=-0.25, softcap=12.0,
                                                              teacher_temperature=1.5)
    inp = make_inputs(rng, N, V, "float32", teacher=True, weights=True)
    shards = random_shards(rng, R, V)
    outs = run_sharded(be, inp, terms, opts, shards)
    rsc, rtoks, rgrad = run_ref(inp, terms, opts)
    gpu = be.name == "cuda"
    for k, name in enumerate(SCALARS):
        want = rsc.get(name, 0.0)
        assert abs(be.to_np(outs[0].scalars)[k] - want) <= (2e-4 if gpu else 2e-6) * (1 + abs(want)), name
    grad = np.concatenate([be.to_np(o.grad) for o in outs], axis=1)
    assert rel(grad, rgrad) < (1e-4 if gpu else 2e-6)


def jsd_setup(be, rng):
    """Two ranks of a dense-JSD plan, their stats and middle blocks gathered."""
    terms, opts, _ = CASES["jsd_ce"]
    inp = make_inputs(rng, N, V, "float32", teacher=True, weights=True, grpo="near")
    shards = [(0, 400), (400, 600)]
    plans = [plan_for(be, inp, terms, opts, s) for s in shards]
    labels = be.to_dev(inp["labels"])
    t = [columns(be, inp, "teacher_logits", s) for s in shards]
    gathered = concat(be, [p.stats(columns(be, inp, "logits", s), labels, teacher_logits=t[r])
                           for r, (p, s) in enumerate(zip(plans, shards))])
    middle = concat(be, [p.middle(gathered, columns(be, inp, "logits", s), labels, teacher_logits=t[r])
                         for r, (p, s) in enumerate(zip(plans, shards))])
    return inp, shards, plans, gathered, middle


def finish_middle_fails(be, plan, shard, inp, gathered, middle, needle):
    """finish (finish_with_middle with middle blocks) raises with `needle` and leaves its outputs untouched."""
    scalars = be.full((len(SCALARS),), "float32")
    grad = be.full((N, shard[1]), "float32")
    kw = {} if middle is None else {"gathered_middle": middle}
    with pytest.raises(headloss.HeadlossError, match=needle):
        plan.finish(gathered, columns(be, inp, "logits", shard), be.to_dev(inp["labels"]), scalars=scalars,
                    grad=grad, teacher_logits=columns(be, inp, "teacher_logits", shard), **kw,
                    **per_row(be, inp))
    assert np.isnan(be.to_np(scalars)).all() and np.isnan(be.to_np(grad)).all()


def test_jsd_call_sequences(be, rng):
    """A plan of two exchanges refuses the one-exchange finish; a plan of one refuses the middle
    step and finish_with_middle; bad or short middle buffers are refused; nothing is written."""
    inp, shards, plans, gathered, middle = jsd_setup(be, rng)
    assert plans[0].exchanges == 2 and plans[0].middle_bytes(N) == 64 + N * (16 if be.name == "cpu" else 8)
    finish_middle_fails(be, plans[0], shards[0], inp, gathered, None, "needs two exchanges")
    finish_middle_fails(be, plans[0], shards[0], inp, gathered, middle[:-1], "gathered_middle_bytes is")
    finish_middle_fails(be, plans[0], shards[0], inp, gathered, gathered * 1, "is not a block of middle sums")
    finish_middle_fails(be, plans[0], shards[0], inp, middle, middle, "gathered_bytes is")
    half = middle[:middle.shape[0] // 2]  # rank 0's middle block twice: column 0 owned twice
    finish_middle_fails(be, plans[0], shards[0], inp, gathered, concat(be, [half, half]), "owned by two shards")
    labels = be.to_dev(inp["labels"])
    x0, t0 = columns(be, inp, "logits", shards[0]), columns(be, inp, "teacher_logits", shards[0])
    with pytest.raises(headloss.HeadlossError, match="is not a block of statistics"):
        plans[0].middle(gathered * 0, x0, labels, teacher_logits=t0)
    with pytest.raises(headloss.HeadlossError, match="gathered_bytes is"):
        plans[0].middle(gathered[:-1], x0, labels, teacher_logits=t0)
    # A plan of one exchange (CE alone) has no middle step.
    terms, opts, inp1, shards1, plans1, blocks1 = bad_setup(be, rng)
    assert plans1[0].exchanges == 1
    with pytest.raises(headloss.HeadlossError, match="has no middle step"):
        plans1[0].middle(concat(be, blocks1), columns(be, inp1, "logits", shards1[0]), be.to_dev(inp1["labels"]))
    with pytest.raises(headloss.HeadlossError, match="has no middle step"):
        plans1[0].middle_bytes(N)
    with pytest.raises(headloss.HeadlossError, match="has no middle step"):
        plans1[0].finish(concat(be, blocks1), columns(be, inp1, "logits", shards1[0]), be.to_dev(inp1["labels"]),
                         gathered_middle=concat(be, blocks1))


def test_sparse_record_size(be):
    """A sparse teacher's records carry its k logits: the block grows by k values a row."""
    k = 16
    base = LossPlan(400, "float32", terms=("distill_fwd",), device=be.name, vocab_start=0,
                    vocab_global=V, ranks=2).stats_bytes(N)
    topk = LossPlan(400, "float32", terms=("distill_fwd",), device=be.name, vocab_start=0,
                    vocab_global=V, ranks=2, teacher_topk=k).stats_bytes(N)
    assert topk - base == N * k * (8 if be.name == "cpu" else 4)


def bad_setup(be, rng):
    terms, opts, _ = CASES["ce"]
    inp = make_inputs(rng, N, V, "float32")
    shards = [(0, 400), (400, 600)]
    plans = [plan_for(be, inp, terms, opts, s) for s in shards]
    labels = be.to_dev(inp["labels"])
    blocks = [p.stats(columns(be, inp, "logits", s), labels) for p, s in zip(plans, shards)]
    return terms, opts, inp, shards, plans, blocks


def finish_fails(be, plan, shard, inp, gathered, needle):
    """finish raises with `needle` in the library's message and leaves its outputs untouched."""
    scalars = be.full((len(SCALARS),), "float32")
    grad = be.full((N, shard[1]), "float32")
    with pytest.raises(headloss.HeadlossError, match=needle):
        plan.finish(gathered, columns(be, inp, "logits", shard), be.to_dev(inp["labels"]),
                    scalars=scalars, grad=grad)
    assert np.isnan(be.to_np(scalars)).all() and np.isnan(be.to_np(grad)).all()


def test_ranks_that_disagree_on_rows(be, rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    short = plans[1].stats(columns(be, inp, "logits", shards[1])[:-1], be.to_dev(inp["labels"][:-1]))
    pad = blocks[0][: blocks[0].shape[0] - short.shape[0]] * 0
    finish_fails(be, plans[0], shards[0], inp, concat(be, [blocks[0], short, pad]), "ranks disagree on N")


def test_ranks_that_disagree_on_the_plan(be, rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    other = plan_for(be, inp, terms, opts, shards[1], label_smoothing=0.5)
    gathered = concat(be, [blocks[0], other.stats(columns(be, inp, "logits", shards[1]),
                                                  be.to_dev(inp["labels"]))])
    finish_fails(be, plans[0], shards[0], inp, gathered, "comes from a different plan")
    three = plan_for(be, inp, terms, opts, shards[1], ranks=3)  # disagrees on the rank count
    gathered = concat(be, [blocks[0], three.stats(columns(be, inp, "logits", shards[1]),
                                                  be.to_dev(inp["labels"]))])
    finish_fails(be, plans[0], shards[0], inp, gathered, "comes from a different plan")


def test_a_buffer_too_small_and_bad_blocks(be, rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    gathered = concat(be, blocks)
    finish_fails(be, plans[0], shards[0], inp, gathered[:-1], "gathered_bytes is")
    finish_fails(be, plans[0], shards[0], inp, gathered * 0, "bad header")


def test_shards_that_do_not_tile_the_vocabulary(be, rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    labels = be.to_dev(inp["labels"])
    # A second shard starting past column 400: columns 400.. are owned by no shard.
    late = plan_for(be, inp, terms, opts, (500, 500))
    b_late = late.stats(columns(be, inp, "logits", (500, 500)), labels)
    finish_fails(be, plans[0], shards[0], inp, concat(be, [blocks[0], b_late]),
                 "column 400 is owned by no shard")
    # Rank 0's block twice: column 0 owned by two shards.
    finish_fails(be, plans[0], shards[0], inp, concat(be, [blocks[0], blocks[0]]),
                 "column 0 is owned by two shards")
    # Rank 1's twice: this plan's own shard is missing (and 0..400 uncovered).
    finish_fails(be, plans[0], shards[0], inp, concat(be, [blocks[1], blocks[1]]), "owned by no shard")


def test_labels_are_global_and_checked(be, rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    labels = inp["labels"].copy()
    labels[2] = V  # out of the global vocabulary
    scalars = be.full((len(SCALARS),), "float32")
    with pytest.raises(headloss.HeadlossError, match=r"outside \[0, vocab = 1000\)"):
        if be.name == "cpu":  # the host checks at once; the GPU at the finish (its one sync)
            plans[1].stats(columns(be, inp, "logits", shards[1]), labels)
        plans[1].finish(concat(be, blocks), columns(be, inp, "logits", shards[1]), be.to_dev(labels),
                        scalars=scalars)
    assert np.isnan(be.to_np(scalars)).all()


def test_a_shard_plan_is_not_run_whole(be, rng):
    terms, opts, inp, shards, plans, _ = bad_setup(be, rng)
    with pytest.raises(headloss.HeadlossError, match="execute_stats"):
        plans[0](columns(be, inp, "logits", shards[0]), be.to_dev(inp["labels"]))
    with pytest.raises(headloss.HeadlossError, match=r"is not inside \[0, vocab_global = 1000\)"):
        plan_for(be, inp, terms, opts, (900, 200))
    with pytest.raises(headloss.HeadlossError, match="needs ranks >= 2"):
        plan_for(be, inp, terms, opts, (0, 400), ranks=1)
    if be.name == "cpu":
        with pytest.raises(headloss.HeadlossError, match="NCCL needs a CUDA plan"):
            plans[0].nccl(1, columns(be, inp, "logits", shards[0]), be.to_dev(inp["labels"]))


def test_finish_keeps_keyword_arrays_alive(be, rng, monkeypatch):
    """The library gets bare pointers: an array passed to finish() only as a keyword (a temporary)
    must live until the call returns (it used to be freed before, its memory reused)."""
    import weakref
    import headloss.loss as hl_loss
    terms, opts, inp, shards, plans, blocks = bad_setup(be, rng)
    weights = []  # a weak reference to the temporary
    alive = []
    real = hl_loss._finish

    def finish(*args):
        alive.append(weights[0]() is not None)
        return real(*args)

    def temporary():
        w = be.to_dev(np.ones(N, np.float32))
        weights.append(weakref.ref(w))
        return w
    monkeypatch.setattr(hl_loss, "_finish", finish)
    plans[0].finish(concat(be, blocks), columns(be, inp, "logits", shards[0]), be.to_dev(inp["labels"]),
                    weights=temporary())
    assert alive == [True]
