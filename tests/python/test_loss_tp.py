"""The vocabulary-sharded (tensor-parallel) loss on the CPU backend: R ranks simulated in one
process, each with its slice of the logits, statistics gathered in rank order, and every rank's
finish compared with the unsharded run (scalars within 1e-6, gradient slices within 1e-5)."""
import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS, LossPlan
from test_loss import CASES, make_inputs

N, V = 37, 1000


def random_shards(rng, R, V):
    """R contiguous, non-empty, uneven shards of [0, V) as (start, size)."""
    cuts = np.sort(rng.choice(np.arange(1, V), R - 1, replace=False))
    edges = [0, *cuts.tolist(), V]
    return [(edges[r], edges[r + 1] - edges[r]) for r in range(R)]


def plan_for(inp, terms, opts, shard=None, **extra):
    dtype = str(inp["logits"].dtype)
    labels_dtype = str(inp["labels"].dtype) if "labels" in inp else None
    kw = {} if shard is None else {"vocab_start": shard[0], "vocab_global": V}
    vocab = V if shard is None else shard[1]
    return LossPlan(vocab, dtype, terms=terms, labels_dtype=labels_dtype, **kw, **opts, **extra)


def columns(inp, key, shard):
    return None if key not in inp else np.ascontiguousarray(inp[key][:, shard[0]:shard[0] + shard[1]])


def per_row(inp):
    return {k: inp[k] for k in ("weights", "advantages", "old_logprobs", "ref_logprobs") if k in inp}


def run_sharded(inp, terms, opts, shards):
    """Every rank's LossOutput, after the simulated all-gather."""
    plans = [plan_for(inp, terms, opts, s) for s in shards]
    labels = inp.get("labels")
    blocks = [p.stats(columns(inp, "logits", s), labels, teacher_logits=columns(inp, "teacher_logits", s))
              for p, s in zip(plans, shards)]
    gathered = np.concatenate(blocks)
    return [p.finish(gathered, len(shards), columns(inp, "logits", s), labels, token_outputs=True,
                     teacher_logits=columns(inp, "teacher_logits", s), **per_row(inp))
            for p, s in zip(plans, shards)]


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("case", ["all", "ce_smooth_weights_cap", "distill_fwd", "grpo_kl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_matches_unsharded(rng, R, case, dtype):
    terms, opts, flags = CASES[case]
    flags = dict(flags)
    inp = make_inputs(rng, N, V, dtype, labels=flags.pop("labels", "int64"), **flags)
    # A row whose maximum sits in two shards: the accuracy's argmax must pick the first column.
    inp["logits"][3, 10] = inp["logits"][3, V - 10] = 40.0
    if "labels" in inp:  # some rows right, so the accuracy tests the merged (global) argmax
        hit = [i for i in range(2, N, 3) if inp["labels"][i] >= 0]
        inp["labels"][hit] = np.argmax(inp["logits"][hit].astype(np.float32), axis=1)
    full = plan_for(inp, terms, opts)(inp["logits"], inp.get("labels"), token_outputs=True,
                                      teacher_logits=inp.get("teacher_logits"), **per_row(inp))
    shards = random_shards(rng, R, V)
    outs = run_sharded(inp, terms, opts, shards)
    ref = np.asarray(full.scalars, np.float64)
    for out in outs:
        # Every rank merges the same blocks in the same order: the same bits.
        assert np.array_equal(out.scalars, outs[0].scalars)
        for t in range(4):
            assert np.array_equal(out[2 + t], outs[0][2 + t])
    got = np.asarray(outs[0].scalars, np.float64)
    bad = [SCALARS[k] for k in range(len(SCALARS))
           if abs(got[k] - ref[k]) > 1e-6 * max(abs(ref[k]), 1e-3)]
    assert not bad, f"{bad} differ from the unsharded run (shards {shards})"
    for t in range(4):
        assert np.allclose(outs[0][2 + t], full[2 + t], rtol=1e-6, atol=1e-6)
    grad = np.concatenate([np.asarray(o.grad, np.float64) for o in outs], axis=1)
    g_ref = np.asarray(full.grad, np.float64)
    assert np.linalg.norm(grad - g_ref) <= 1e-5 * np.linalg.norm(g_ref)


def bad_setup(rng):
    terms, opts, _ = CASES["ce"]
    inp = make_inputs(rng, N, V, "float32")
    shards = [(0, 400), (400, 600)]
    plans = [plan_for(inp, terms, opts, s) for s in shards]
    blocks = [p.stats(columns(inp, "logits", s), inp["labels"]) for p, s in zip(plans, shards)]
    return terms, opts, inp, shards, plans, blocks


def finish_fails(plan, shard, inp, gathered, ranks, needle):
    """finish raises with `needle` in the library's message and leaves its outputs untouched."""
    scalars = np.full(len(SCALARS), np.nan, np.float32)
    grad = np.full((N, shard[1]), np.nan, np.float32)
    with pytest.raises(headloss.HeadlossError, match=needle):
        plan.finish(gathered, ranks, columns(inp, "logits", shard), inp["labels"], scalars=scalars,
                    grad=grad)
    assert np.isnan(scalars).all() and np.isnan(grad).all()


def test_ranks_that_disagree_on_rows(rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(rng)
    short = plans[1].stats(columns(inp, "logits", shards[1])[:-1], inp["labels"][:-1])
    gathered = np.concatenate([blocks[0], short, np.zeros(blocks[0].nbytes - short.nbytes, np.uint8)])
    finish_fails(plans[0], shards[0], inp, gathered, 2, "ranks disagree on N")


def test_ranks_that_disagree_on_the_plan(rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(rng)
    other = plan_for(inp, terms, opts, shards[1], label_smoothing=0.5)
    gathered = np.concatenate([blocks[0], other.stats(columns(inp, "logits", shards[1]), inp["labels"])])
    finish_fails(plans[0], shards[0], inp, gathered, 2, "comes from a different plan")


def test_a_buffer_too_small_and_bad_blocks(rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(rng)
    gathered = np.concatenate(blocks)
    finish_fails(plans[0], shards[0], inp, gathered[:-8], 2, "gathered_bytes is")
    finish_fails(plans[0], shards[0], inp, np.zeros_like(gathered), 2, "bad header")


def test_shards_that_do_not_tile_the_vocabulary(rng):
    terms, opts, inp, shards, plans, blocks = bad_setup(rng)
    # Only rank 0's block: columns 400.. are owned by no shard (their labels could be in none).
    finish_fails(plans[0], shards[0], inp, blocks[0], 1, "columns from 400 are owned by no shard")
    # Rank 0's block twice: column 0 owned by two shards.
    finish_fails(plans[0], shards[0], inp, np.concatenate([blocks[0], blocks[0], blocks[1]]), 3,
                 "column 0 is owned by two shards")
    # Rank 1 alone: this plan's own shard is missing (and 0..400 uncovered).
    finish_fails(plans[0], shards[0], inp, blocks[1], 1, "owned by no shard")


def test_labels_are_global_and_checked(rng):
    terms, opts, inp, shards, plans, _ = bad_setup(rng)
    labels = inp["labels"].copy()
    labels[2] = V  # out of the global vocabulary
    with pytest.raises(headloss.HeadlossError, match=r"outside \[0, vocab = 1000\)"):
        plans[1].stats(columns(inp, "logits", shards[1]), labels)


def test_a_shard_plan_is_not_run_whole(rng):
    terms, opts, inp, shards, plans, _ = bad_setup(rng)
    with pytest.raises(headloss.HeadlossError, match="execute_stats"):
        plans[0](columns(inp, "logits", shards[0]), inp["labels"])
    with pytest.raises(headloss.HeadlossError, match=r"is not inside \[0, vocab_global = 1000\)"):
        plan_for(inp, terms, opts, (900, 200))
