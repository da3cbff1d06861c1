/* The ABI fuzz harness's framework (fuzz.c); test_fuzz.c describes the entry points with it.
 *
 * A case is one entry point with one valid call (its control): `declare` lays out the buffers and
 * the descriptor in plain memory, `prepare` makes what needs the library (plans, gathered blocks,
 * workspace sizes), `invoke` calls the entry point and `check` compares the control's outputs with
 * an independent computation. A mutation is a short list of edits of the control (a field's
 * value, a buffer's placement or contents) with the outcome the header promises for it. Every call
 * runs on fresh buffers, each between canary zones and against a PROT_NONE guard page (device
 * memory with canary zones on CUDA), and is checked for crashes, silent success, writes on error,
 * modified inputs, damaged canaries and the message's form. */
#ifndef HL_FUZZ_H_
#define HL_FUZZ_H_

#include <stddef.h>
#include <stdint.h>

#include "headloss.h"

enum { MAX_BUFS = 28, MAX_EDITS = 4, MAX_PLANS = 4, NAME_LEN = 48 };

#define P2(n) ((int64_t)1 << (n))

/* ---- buffers ---------------------------------------------------------------------------------- */

typedef enum { EK_F32, EK_F16, EK_BF16, EK_F64, EK_I32, EK_I64, EK_U64, EK_BYTES, EK_HANDLE } ElemKind;
typedef enum { R_IN, R_OUT, R_INOUT, R_SCRATCH } Role;
/* Where a buffer is placed: as the call's default (PL_END or PL_START), ending at the back guard
 * page, starting at the front one, one byte off its alignment, one element short of its size, or
 * over another buffer's memory. */
typedef enum { PL_DEFAULT, PL_END, PL_START, PL_MISALIGN, PL_SHORT, PL_ALIAS } Placement;

typedef struct Buf {
  char name[NAME_LEN]; /* the C field that points at it */
  Role role;
  ElemKind kind;
  int host;            /* host memory even on CUDA (a query's outputs) */
  int optional;        /* NULL is valid */
  int64_t rows, cols, stride; /* elements; stride >= cols */
  size_t bytes;
  unsigned char *init; /* the intended contents, stride gaps included */
  Placement place;
  char alias[NAME_LEN]; /* PL_ALIAS: the buffer whose memory it shares */
  int64_t alias_off;    /* ... from this many of that buffer's elements on */
  int misalign;         /* PL_MISALIGN: bytes past a 16-byte boundary */
  void *mem;              /* what the library gets */
  unsigned char *region;  /* canary-checked memory around mem (host or device; NULL for an alias) */
  size_t region_len, off, span; /* data at region + off, span bytes (with the aliases over it) */
  unsigned char *image;   /* host copy of the region before the call, and after it */
  unsigned char *after;
  int dev;                /* region is device memory */
} Buf;

/* ---- fields ----------------------------------------------------------------------------------- */

typedef enum { W_DESC, W_PARAM } Where; /* the descriptor (or the side structure), or the parameters */
typedef enum {
  F_STRUCT_SIZE, /* size_t struct_size */
  F_SIZE,        /* int64 extent in [lo, hi] (hi 0: HL_MAX_EXTENT); `buf`, if named: it counts it */
  F_STRIDE,      /* int64 row stride of `buf` */
  F_I64,         /* int64 that is a value, not a size (ignore_index) */
  F_ENUM,        /* int-sized enumeration; bad1/bad2: enumerators that are wrong for it (where
                    `buf`, if named, is passed); lo 1: 0 is wrong too */
  F_BOOL,        /* int, 0 or 1 */
  F_INT,         /* int count in [lo, hi] (hi 0: no documented bound) */
  F_FLAGS,       /* unsigned flag word: `hi` the known bits, `lo` those that keep the results */
  F_FLOAT,       /* float with `rule`; def: what a zero stands for (NAN: none) */
  F_DOUBLE,
  F_PTR,         /* pointer to `buf` */
  F_BYTES,       /* size_t bytes of `buf` */
  F_WS_PTR,      /* the workspace, for a call needing Call.ws_need bytes */
  F_WS_BYTES,
  F_PLAN,
  F_FREE         /* an int that the header does not constrain: hostile values may go either way */
} FieldKind;

typedef enum {
  FR_MAY,    /* no documented range */
  FR_UNIT,   /* [0, 1) */
  FR_OPEN01, /* (0, 1), 0 the default */
  FR_POS,    /* > 0, 0 the default */
  FR_DUAL,   /* 0 or > 1 */
  FR_BETA,   /* (0, 1], 0 the default */
  FR_SET     /* nonzero and finite */
} FloatRule;

typedef struct Field {
  const char *name;
  Where where;
  size_t off;
  FieldKind kind;
  const char *buf;
  int64_t lo, hi;
  FloatRule rule;
  double def;
  unsigned term; /* F_FLOAT: the rule holds while the control has one of these loss terms */
  int bad1, bad2;
} Field;

#define FIELD(W, T, f, K, ...) {.name = #f, .where = W, .off = offsetof(T, f), .kind = K, __VA_ARGS__}

/* ---- mutations -------------------------------------------------------------------------------- */

typedef enum {
  T_CONTROL,    /* the valid call: succeeds (or control_status), outputs match the reference */
  T_FAIL,       /* invalid per the header: fails (status in `ok`), names `needle`, writes nothing */
  T_MATCH,      /* a valid equivalent: succeeds with bitwise-identical outputs */
  T_ALIGN,      /* a buffer moved off its alignment, contents kept: fails cleanly or matches */
  T_INPLACE,    /* an output over an input: fails cleanly, or succeeds with the right outputs */
  T_MAY,        /* valid but different: fails cleanly or succeeds cleanly */
  T_MAY_FINITE, /* ... and a success's outputs are finite */
  T_QUERY,      /* a size query: fails cleanly or answers consistently (Case.qcheck) */
  T_FAULT       /* a buffer one element short before a guard page: the call faults there */
} Tag;

typedef enum {
  E_FIELD,     /* field `name` := bits (width by its kind) */
  E_DESC_NULL, /* the descriptor pointer is NULL */
  E_TAIL,      /* the descriptor's memory is `a` bytes, byte `b` nonzero (b < a; 0: none) */
  E_PLACE,     /* buffer `name` placed as `a` (Placement): PL_ALIAS over `other` + b elements,
                  PL_MISALIGN b bytes (0: 1) past a 16-byte boundary */
  E_PTR_TO,    /* field `name` points at buffer `other` */
  E_ELEM,      /* element a of buffer `name` := bits (as its kind) */
  E_BYTES,     /* bytes [a, a + 8) of buffer `name`: op b with bits */
  E_CALL       /* case-specific: Case.edit(call, a, phase) */
} EditKind;
enum { OP_SET, OP_ADD };

typedef struct Edit {
  EditKind k;
  char name[NAME_LEN], other[NAME_LEN];
  uint64_t bits;
  int64_t a, b;
} Edit;

typedef struct Mutation {
  char field[NAME_LEN]; /* what the report names */
  char value[64];
  Tag tag;
  char needle[96];      /* names the message must contain, '|'-separated alternatives */
  unsigned ok;          /* T_FAIL: accepted statuses as bits (0: INVALID_VALUE) */
  Edit e[MAX_EDITS];
  int ne;
  Edit q[MAX_EDITS];    /* the equivalent form the outputs must match (none: the control) */
  int nq;
  int64_t expect;       /* T_QUERY: -1: the answers are at least the control's; -2: any */
} Mutation;

#define OK(s) (1u << (s))
#define NF(t) ((int)(sizeof(t) / sizeof((t)[0])))

/* ---- calls and cases -------------------------------------------------------------------------- */

typedef struct Case Case;

typedef struct Call {
  const Case *cs;
  hl_backend_t backend;
  int cuda;
  Placement place; /* PL_END or PL_START for every buffer not moved by an edit */
  Buf bufs[MAX_BUFS];
  int nbufs;
  unsigned char desc[512] __attribute__((aligned(16))); /* declared descriptor */
  unsigned char side[512] __attribute__((aligned(16)));
  unsigned char params[256] __attribute__((aligned(16)));
  unsigned char *dmem;     /* the guarded descriptor the library reads */
  size_t dlen, dtail;      /* its length and the nonzero tail byte (E_TAIL) */
  unsigned char dimage[4200]; /* dmem as passed */
  const void *dp;          /* the descriptor pointer passed */
  void *maps[MAX_BUFS + 1]; /* host regions to unmap */
  size_t maplens[MAX_BUFS + 1];
  int nmaps;
  hl_status_t status;
  char msg[512];
  int msg_set;             /* invoke captured msg itself (before more calls) */
  hl_loss_plan_t plans[MAX_PLANS];
  size_t ws_need;          /* workspace the call needs (0 on the CPU backend) */
  char note[256];          /* a downstream failure (create's execute), for the report */
} Call;

typedef struct Chk {
  int problems;
  char detail[256];
  double floor; /* the least tolerance: 0 on the CPU backend, wider on CUDA (fp32 sums) */
} Chk;

typedef struct Gen {
  const Case *cs;
  Call *ctl; /* the control, declared */
  Mutation *v;
  int n, cap;
} Gen;

enum { CASE_SCALARS_BY_SIZE = 1, /* an older descriptor writes fewer outputs: earlier sizes are MAY */
       CASE_WS_CHUNKS = 2,       /* results depend on the workspace size (the fused linear form) */
       CASE_CPU_ONLY = 4 };      /* not run on CUDA (NCCL needs a communicator) */

struct Case {
  const char *entry, *label;
  const void *spec;       /* the control's parameters, for declare */
  const char *msg_entry;  /* what messages start with (NULL: entry) */
  const char *family;     /* HL_FUZZ_FILTER matches entry, label or family */
  const char *desc_name;  /* the descriptor parameter ("args", "desc"); NULL: none */
  size_t desc_size;
  const size_t *earlier;  /* earlier struct sizes, 0-terminated */
  const Field *fields;    /* the descriptor's, mutated */
  int nfields;
  const Field *params;    /* the other arguments' (W_PARAM), mutated */
  int nparams;
  const Field *side;      /* bound, not mutated */
  int nside;
  const char *only;       /* mutate only these fields (space-separated) */
  const char *forbid;     /* unbound pointer fields that must stay NULL */
  const char *inplace;    /* documented in-place pairs "out=in" */
  int query;
  unsigned flags;
  void (*declare)(Call *);
  void (*prepare)(Call *);
  hl_status_t (*invoke)(Call *);
  void (*check)(Call *, Chk *);
  void (*extra)(Gen *);
  void (*qcheck)(Call *ref, Call *mut, Chk *);
  void (*edit)(Call *, int64_t what, int pre);
  hl_status_t control_status;
};

/* ---- what test_fuzz.c uses -------------------------------------------------------------------- */

/* Declaring buffers (in `declare` or `prepare`): inputs get random contents, outputs poison. */
Buf *buf_mat(Call *c, const char *name, Role role, hl_dtype_t dt, int64_t rows, int64_t cols, int64_t stride);
Buf *buf_vec(Call *c, const char *name, Role role, hl_dtype_t dt, int64_t n);
Buf *buf_raw(Call *c, const char *name, Role role, ElemKind kind, int64_t n);
Buf *buf_host(Call *c, const char *name, ElemKind kind); /* a query's output in host memory */
Buf *buf_find(Call *c, const char *name);
void buf_resize(Buf *b, size_t bytes);                    /* keeps contents, poisons the rest */
double buf_get(const Buf *b, const unsigned char *data, int64_t r, int64_t col);
void buf_set(Buf *b, int64_t r, int64_t col, double v);   /* into init */
int64_t buf_geti(const Buf *b, const unsigned char *data, int64_t i);
void buf_seti(Buf *b, int64_t i, int64_t v);
const unsigned char *buf_out(const Buf *b);               /* data after the call (host copy) */
void buf_fill(Buf *b, uint64_t seed, double lo, double hi);
double round_to(hl_dtype_t dt, double v); /* v as stored in dt (F32 or BF16) */
double tol_of(hl_dtype_t dt);             /* relative tolerance of a store in dt against fp64 */
double *dalloc(int64_t n);                /* zeroed doubles */
double buf_in(Call *c, const char *name, int64_t r, int64_t col); /* an input's element */
uint64_t rng_next(uint64_t *s);
double rng_unit(uint64_t *s);
uint64_t seed_of(const char *a, const char *b);

/* Device memory for a case's own library calls (the gathered blocks on CUDA). */
void *dev_alloc(size_t bytes);
void *query_scratch(int cuda);
/* Stops the harness (exit 2) on its own error, naming it. */
void die(const char *what);
void dev_free(void *p);
void to_dev(void *dst, const void *src, size_t bytes);
void from_dev(void *dst, const void *src, size_t bytes);

/* Descriptor access in `declare`: the declared descriptor and the side structure. */
#define DESC(c, T) ((T *)(void *)(c)->desc)
#define SIDE(c, T) ((T *)(void *)(c)->side)
#define PARAMS(c, T) ((T *)(void *)(c)->params)
/* The descriptor as the library receives it (invoke). */
#define DP(c, T) ((const T *)(c)->dp)

/* Control checks. */
void chk_fail(Chk *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Buffer `name`'s [rows, cols] elements against ref (packed), |got - ref| <= rtol |ref| + atol
 * max|ref| (each at least Chk.floor); a NaN in ref is not checked. */
void chk_mat(Chk *k, Call *c, const char *name, const double *ref, int64_t rows, int64_t cols, double rtol,
             double atol);
void chk_val(Chk *k, const char *what, double got, double ref, double rtol, double atol);
void chk_eq_u64(Chk *k, const char *what, uint64_t got, uint64_t ref);

/* Mutations (in `extra`). */
Mutation *gen_add(Gen *g, const char *field, const char *value, Tag tag, const char *needle);
Edit *mut_edit(Mutation *m, EditKind k, const char *name);
Edit *mut_equiv(Mutation *m, EditKind k, const char *name);
Edit *mut_set(Mutation *m, const char *field, uint64_t bits);
/* Output `out` placed over buffer `over` (exactly, or from its second element on). */
Mutation *gen_overlap(Gen *g, const char *field, const char *out, const char *over, int partial, Tag tag);
uint64_t f32_bits(float f);
uint64_t f64_bits(double d);

int fuzz_main(int argc, char **argv, const Case *const *cases, int ncases);

/* The loss plan's cases (fuzz_loss.c): fills out, returns how many. */
int loss_cases(const Case **out);

#endif
