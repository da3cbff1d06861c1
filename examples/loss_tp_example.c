/* The vocabulary-sharded loss from C: two "ranks" in one process (CPU backend), each holding half
 * of the vocabulary's columns. Each computes its block of statistics, the blocks are gathered in
 * rank order (here a memcpy; in a real job ncclAllGather, MPI_Allgather, torch.distributed...),
 * and each rank finishes: the same loss on both, and its own slice of the gradient. The result is
 * checked against the unsharded plan. Build: `make`; run: build/examples/loss_tp_example. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example.h"

#define ROWS 6
#define VOCAB 10
#define RANKS 2

static hl_loss_plan_t make_plan(int64_t start, int64_t cols, int ranks) {
  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = HL_BACKEND_CPU;
  d.vocab = cols;             /* this rank's columns ...             */
  d.vocab_start = start;      /* ... starting here ...                */
  d.vocab_global = VOCAB;     /* ... of the whole vocabulary          */
  d.ranks = ranks;            /* ... split over this many ranks       */
  d.logits_dtype = HL_DTYPE_F32;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE | HL_LOSS_Z;
  d.ce_weight = 1.0f;
  d.z_weight = 1e-3f;
  d.grad_mode = HL_LOSS_GRAD_WRITE;
  d.grad_dtype = HL_DTYPE_F32;
  hl_loss_plan_t p;
  CHECK_HL(hl_loss_plan_create(&d, &p));
  return p;
}

int main(void) {
  float logits[ROWS][VOCAB], full_grad[ROWS][VOCAB], full_scalars[HL_LOSS_NUM_SCALARS];
  int64_t labels[ROWS] = {3, 9, -100, 0, 5, 7}; /* global ids; -100 is ignored */
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VOCAB; ++j) logits[i][j] = 2.0f * sinf(0.7f * (float)(i * VOCAB + j));

  /* The reference: one plan over the whole vocabulary. */
  hl_loss_plan_t whole = make_plan(0, VOCAB, 1);
  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = ROWS;
  a.logits = logits;
  a.labels = labels;
  a.grad = full_grad;
  a.scalars = full_scalars;
  CHECK_HL(hl_loss_plan_execute(whole, &a, NULL, 0, NULL));

  /* Two shards: columns [0, 4) and [4, 10). Each rank sees only its columns (row stride VOCAB). */
  const int64_t start[RANKS] = {0, 4}, cols[RANKS] = {4, 6};
  hl_loss_plan_t plan[RANKS];
  size_t block = 0;
  for (int r = 0; r < RANKS; ++r) {
    plan[r] = make_plan(start[r], cols[r], RANKS);
    CHECK_HL(hl_loss_plan_get_stats_size(plan[r], ROWS, &block));
  }
  unsigned char *gathered = malloc(RANKS * block); /* what the all-gather produces on every rank */
  float grad[ROWS][VOCAB], scalars[RANKS][HL_LOSS_NUM_SCALARS];
  hl_loss_args_t ra[RANKS];
  for (int r = 0; r < RANKS; ++r) {
    ra[r] = a;
    ra[r].logits = &logits[0][start[r]];
    ra[r].logits_stride = VOCAB;
    ra[r].grad = &grad[0][start[r]];
    ra[r].grad_stride = VOCAB;
    ra[r].scalars = scalars[r];
    /* 1. statistics of this rank's shard, straight into its slot of the gathered buffer */
    CHECK_HL(hl_loss_plan_execute_stats(plan[r], &ra[r], gathered + r * block, block, NULL));
  }
  /* 2. (the all-gather: every rank now holds all blocks in rank order) */
  for (int r = 0; r < RANKS; ++r) /* 3. merge, losses, this rank's gradient slice */
    CHECK_HL(hl_loss_plan_execute_finish(plan[r], &ra[r], gathered, RANKS * block, NULL, 0, NULL));

  double gerr = 0, gref = 0;
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VOCAB; ++j) {
      gerr += (grad[i][j] - full_grad[i][j]) * (grad[i][j] - full_grad[i][j]);
      gref += full_grad[i][j] * full_grad[i][j];
    }
  printf("headloss %d: loss over %d ranks %.7f %.7f, unsharded %.7f; ce %.7f, z %.7f\n",
         hl_get_version(), RANKS, scalars[0][HL_LOSS_OUT_LOSS], scalars[1][HL_LOSS_OUT_LOSS],
         full_scalars[HL_LOSS_OUT_LOSS], scalars[0][HL_LOSS_OUT_CE], scalars[0][HL_LOSS_OUT_Z]);
  printf("gradient: relative difference to the unsharded one %.2e\n", sqrt(gerr / gref));
  const int ok = fabsf(scalars[0][HL_LOSS_OUT_LOSS] - full_scalars[HL_LOSS_OUT_LOSS]) <=
                     1e-6f * fabsf(full_scalars[HL_LOSS_OUT_LOSS]) &&
                 scalars[0][HL_LOSS_OUT_LOSS] == scalars[1][HL_LOSS_OUT_LOSS] && sqrt(gerr / gref) < 1e-5;
  free(gathered);
  for (int r = 0; r < RANKS; ++r) hl_loss_plan_destroy(plan[r]);
  hl_loss_plan_destroy(whole);
  return ok ? 0 : 1;
}
