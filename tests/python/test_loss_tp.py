"""The vocabulary-sharded (tensor-parallel) loss: R ranks simulated in one process (on the CPU
backend, or on one GPU), each with its slice of the logits, the blocks of statistics concatenated
(the all-gather), and every rank's finish compared with the unsharded run: the same bits on every
rank, scalars within 1e-6 (the GRPO ratio metrics 4e-6), fp32 gradient slices within 1e-5, per-token outputs within 1e-5 (a
token's loss is a difference of large terms, and the GPU merges in fp32 in another order). Then
every refusal of bad blocks. The NCCL path on two GPUs is in test_loss_nccl.py."""
import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS, LossPlan
from test_loss import CASES, be, make_inputs  # noqa: F401  (be: the backend fixture)

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


def concat(be, blocks):
    """The all-gather, simulated: the blocks one after another."""
    if be.name == "cpu":
        return np.concatenate(blocks)
    return be.torch.cat(blocks)


def run_sharded(be, inp, terms, opts, shards):
    """Every rank's LossOutput, after the simulated all-gather."""
    plans = [plan_for(be, inp, terms, opts, s, len(shards)) for s in shards]
    labels = be.to_dev(inp["labels"]) if "labels" in inp else None
    blocks = [p.stats(columns(be, inp, "logits", s), labels,
                      teacher_logits=columns(be, inp, "teacher_logits", s))
              for p, s in zip(plans, shards)]
    gathered = concat(be, blocks)
    return [p.finish(gathered, columns(be, inp, "logits", s), labels, token_outputs=True,
                     teacher_logits=columns(be, inp, "teacher_logits", s), **per_row(be, inp))
            for p, s in zip(plans, shards)]


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("case", ["all", "ce_smooth_weights_cap", "distill_fwd", "grpo_kl", "rl",
                                  "rl_cispo", "gspo_all", "mis_seq_mean"])
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
    full = plan_for(be, inp, terms, opts)(
        be.to_dev(inp["logits"]), be.to_dev(inp["labels"]) if "labels" in inp else None,
        token_outputs=True, teacher_logits=columns(be, inp, "teacher_logits", (0, V)),
        **per_row(be, inp))
    shards = random_shards(rng, R, V)
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
