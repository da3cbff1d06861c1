/* The ABI fuzz harness's framework: see fuzz.h. */
#define _GNU_SOURCE
#include "fuzz.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#if HL_FUZZ_CUDA
#include <cuda_runtime_api.h>
#endif

static int fz_cuda; /* CUDA mode */
static int fz_verbose;
static char fz_running[200]; /* the mutation in flight, for a crash of the in-process CUDA mode */
static long fz_page;
enum { CANARY = 64, DEV_CANARY = 256, FAULT_EXIT = 86, CHILD_SECONDS = 20 };

/* ---- small helpers ---------------------------------------------------------------------------- */

void die(const char *what) {
  fprintf(stderr, "test_fuzz: %s\n", what);
  exit(2);
}

static void *xcalloc(size_t n) {
  void *p = calloc(n ? n : 1, 1);
  if (!p) die("out of memory");
  return p;
}

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

double *dalloc(int64_t n) { return xcalloc((size_t)(n > 0 ? n : 1) * sizeof(double)); }

uint64_t rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

uint64_t seed_of(const char *a, const char *b) {
  uint64_t h = 1469598103934665603ull;
  for (const char *p = a; *p; ++p) h = (h ^ (unsigned char)*p) * 1099511628211ull;
  h = (h ^ '/') * 1099511628211ull;
  for (const char *p = b; *p; ++p) h = (h ^ (unsigned char)*p) * 1099511628211ull;
  return h;
}

uint64_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

uint64_t f64_bits(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}

static float bits_f32(uint64_t b) {
  uint32_t u = (uint32_t)b;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static double bits_f64(uint64_t b) {
  double d;
  memcpy(&d, &b, 8);
  return d;
}

/* Round to nearest even, as the library stores bf16. */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float bf16_round(float f) { return from_bf16(to_bf16(f)); }

double round_to(hl_dtype_t dt, double v) { return dt == HL_DTYPE_BF16 ? bf16_round((float)v) : (double)(float)v; }

double tol_of(hl_dtype_t dt) { return dt == HL_DTYPE_BF16 ? 1.0 / 64 : 2e-6; }

static float from_f16(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

static size_t elem_size(ElemKind k) {
  static const size_t sizes[] = {4, 2, 2, 8, 4, 8, 8, 1, 8};
  return sizes[k];
}

static ElemKind kind_of(hl_dtype_t dt) {
  switch (dt) {
    case HL_DTYPE_F32: return EK_F32;
    case HL_DTYPE_F16: return EK_F16;
    case HL_DTYPE_BF16: return EK_BF16;
    case HL_DTYPE_I32: return EK_I32;
    case HL_DTYPE_I64: return EK_I64;
    default: return EK_BYTES;
  }
}

static int is_float(ElemKind k) { return k <= EK_F64; }

/* ---- buffers ---------------------------------------------------------------------------------- */

Buf *buf_find(Call *c, const char *name) {
  for (int i = 0; i < c->nbufs; ++i)
    if (!strcmp(c->bufs[i].name, name)) return &c->bufs[i];
  return NULL;
}

static size_t buf_index(const Buf *b, int64_t r, int64_t col) { return (size_t)(r * b->stride + col) * elem_size(b->kind); }

double buf_get(const Buf *b, const unsigned char *data, int64_t r, int64_t col) {
  const unsigned char *p = data + buf_index(b, r, col);
  uint16_t h;
  float f;
  double d;
  switch (b->kind) {
    case EK_F32: memcpy(&f, p, 4); return f;
    case EK_F16: memcpy(&h, p, 2); return from_f16(h);
    case EK_BF16: memcpy(&h, p, 2); return from_bf16(h);
    case EK_F64: memcpy(&d, p, 8); return d;
    default: return (double)buf_geti(b, data, r * b->stride + col);
  }
}

void buf_set(Buf *b, int64_t r, int64_t col, double v) {
  unsigned char *p = b->init + buf_index(b, r, col);
  const float f = (float)v;
  uint16_t h;
  switch (b->kind) {
    case EK_F32: memcpy(p, &f, 4); break;
    case EK_BF16: h = to_bf16(f); memcpy(p, &h, 2); break;
    case EK_F64: memcpy(p, &v, 8); break;
    case EK_F16: die("no F16 stores"); break;
    default: buf_seti(b, r * b->stride + col, (int64_t)v);
  }
}

int64_t buf_geti(const Buf *b, const unsigned char *data, int64_t i) {
  int32_t v32;
  int64_t v64;
  if (b->kind == EK_BYTES) return data[i];
  if (b->kind == EK_I32) {
    memcpy(&v32, data + 4 * i, 4);
    return v32;
  }
  memcpy(&v64, data + 8 * i, 8);
  return v64;
}

double buf_in(Call *c, const char *name, int64_t r, int64_t col) {
  const Buf *b = buf_find(c, name);
  if (!b) die(name);
  return buf_get(b, b->init, r, col);
}

void buf_seti(Buf *b, int64_t i, int64_t v) {
  const int32_t v32 = (int32_t)v;
  if (b->kind == EK_BYTES)
    b->init[i] = (unsigned char)v;
  else if (b->kind == EK_I32)
    memcpy(b->init + 4 * i, &v32, 4);
  else
    memcpy(b->init + 8 * i, &v, 8);
}

/* Uniform values in [lo, hi), as the buffer's kind rounds them (never all zero). */
void buf_fill(Buf *b, uint64_t seed, double lo, double hi) {
  for (int64_t r = 0; r < b->rows; ++r)
    for (int64_t col = 0; col < b->cols; ++col) buf_set(b, r, col, lo + (hi - lo) * rng_unit(&seed));
}

/* Poison: NaN in every float kind, an id far out of range in the integer ones. */
static unsigned char poison_byte(ElemKind k) { return is_float(k) || k == EK_U64 || k == EK_HANDLE ? 0xFF : 0x7F; }

static Buf *buf_new(Call *c, const char *name, Role role, ElemKind kind, int64_t rows, int64_t cols, int64_t stride) {
  if (c->nbufs == MAX_BUFS) die("too many buffers");
  Buf *b = &c->bufs[c->nbufs++];
  memset(b, 0, sizeof *b);
  snprintf(b->name, sizeof b->name, "%s", name);
  b->role = role;
  b->kind = kind;
  b->rows = rows;
  b->cols = cols;
  b->stride = stride ? stride : cols;
  b->bytes = rows && cols ? (size_t)((rows - 1) * b->stride + cols) * elem_size(kind) : 0;
  b->init = xcalloc(b->bytes);
  memset(b->init, poison_byte(kind), b->bytes);
  if (role == R_IN || role == R_INOUT) buf_fill(b, seed_of(c->cs->label, name), -2.0, 2.0);
  return b;
}

Buf *buf_mat(Call *c, const char *name, Role role, hl_dtype_t dt, int64_t rows, int64_t cols, int64_t stride) {
  return buf_new(c, name, role, kind_of(dt), rows, cols, stride);
}

Buf *buf_vec(Call *c, const char *name, Role role, hl_dtype_t dt, int64_t n) {
  return buf_new(c, name, role, kind_of(dt), 1, n, 0);
}

Buf *buf_raw(Call *c, const char *name, Role role, ElemKind kind, int64_t n) {
  return buf_new(c, name, role, kind, 1, n, 0);
}

Buf *buf_host(Call *c, const char *name, ElemKind kind) {
  Buf *b = buf_new(c, name, R_OUT, kind, 1, 1, 0);
  b->host = 1;
  return b;
}

void buf_resize(Buf *b, size_t bytes) {
  b->init = realloc(b->init, bytes);
  if (!b->init) die("out of memory");
  if (bytes > b->bytes) memset(b->init + b->bytes, poison_byte(b->kind), bytes - b->bytes);
  b->bytes = bytes;
  b->rows = 1;
  b->cols = b->stride = (int64_t)(bytes / elem_size(b->kind));
}

const unsigned char *buf_out(const Buf *b) {
  return b->after ? b->after + b->off : NULL;
}

/* ---- device memory ---------------------------------------------------------------------------- */

#if HL_FUZZ_CUDA
static void cuda_ok(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "test_fuzz: %s: %s (running %s)\n", what, cudaGetErrorString(e), fz_running);
    exit(2);
  }
}
void *dev_alloc(size_t bytes) {
  void *p = NULL;
  cuda_ok(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  return p;
}
void dev_free(void *p) { cuda_ok(cudaFree(p), "cudaFree"); }
void to_dev(void *dst, const void *src, size_t bytes) { cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy"); }
void from_dev(void *dst, const void *src, size_t bytes) { cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"); }
static void dev_sync(void) { cuda_ok(cudaDeviceSynchronize(), "after the call: cudaDeviceSynchronize"); }
#else
void *dev_alloc(size_t bytes) { (void)bytes; die("device memory in a build without CUDA"); return NULL; }
void dev_free(void *p) { (void)p; }
void to_dev(void *dst, const void *src, size_t bytes) { (void)dst, (void)src, (void)bytes; }
void from_dev(void *dst, const void *src, size_t bytes) { (void)dst, (void)src, (void)bytes; }
static void dev_sync(void) {}
#endif

/* Memory of the call's kind for a size query made before the call's buffers are placed (the query
 * checks its pointers like the call): 256 bytes of device memory on CUDA, of host memory else. */
void *query_scratch(int cuda) {
  static unsigned char host[256];
  static void *dev;
  if (!cuda) return host;
  if (!dev) dev = dev_alloc(256);
  return dev;
}

/* ---- placement -------------------------------------------------------------------------------- */

static unsigned char canary(size_t i) { return (unsigned char)(0xA5 ^ (i * 29)); }

/* A host region between two PROT_NONE pages with room for n data bytes and a canary zone;
 * *off: where the data starts in it (against the back page, or the front one). */
static unsigned char *host_region(Call *c, size_t n, Placement pl, size_t align, int mis, size_t *off, size_t *len) {
  const size_t mid = round_up(n + CANARY + 32, (size_t)fz_page);
  unsigned char *map = mmap(NULL, mid + 2 * (size_t)fz_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) die("mmap failed");
  if (mprotect(map, (size_t)fz_page, PROT_NONE) || mprotect(map + fz_page + mid, (size_t)fz_page, PROT_NONE))
    die("mprotect failed");
  c->maps[c->nmaps] = map;
  c->maplens[c->nmaps++] = mid + 2 * (size_t)fz_page;
  unsigned char *r = map + fz_page;
  const uintptr_t end = (uintptr_t)(r + mid);
  if (pl == PL_START)
    *off = 0;
  else if (pl == PL_MISALIGN)
    *off = (((end - n - 32) & ~(uintptr_t)15) + (uintptr_t)mis) - (uintptr_t)r;
  else
    *off = ((end - n) & ~(uintptr_t)(align - 1)) - (uintptr_t)r;
  *len = mid;
  return r;
}

/* Places b (and the aliases over it): the region, its image (canaries around the contents), then
 * the memory the library gets. */
static void place_buf(Call *c, Buf *b) {
  const size_t es = elem_size(b->kind);
  size_t span = b->bytes;
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *a = &c->bufs[i];
    if (a->place == PL_ALIAS && !strcmp(a->alias, b->name)) {
      const size_t end = (size_t)a->alias_off * es + a->bytes;
      if (end > span) span = end;
    }
  }
  const Placement pl = b->place == PL_DEFAULT ? c->place : b->place;
  const size_t less = es > 1 ? es : 8; /* blocks of bytes hold 8-byte words */
  const size_t n = pl == PL_SHORT ? (b->bytes >= less ? b->bytes - less : 0) : span;
  b->dev = c->cuda && !b->host;
  if (b->dev) {
    b->region_len = 2 * DEV_CANARY + n + 16;
    b->region = dev_alloc(b->region_len);
    b->off = DEV_CANARY + (pl == PL_MISALIGN ? (size_t)b->misalign : 0);
  } else {
    b->region = host_region(c, n, pl, es, b->misalign, &b->off, &b->region_len);
  }
  b->span = n;
  b->image = xcalloc(b->region_len);
  for (size_t i = 0; i < b->region_len; ++i) b->image[i] = canary(i);
  unsigned char *data = b->image + b->off;
  memset(data, poison_byte(b->kind), n);
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *a = &c->bufs[i];
    if (a->place == PL_ALIAS && !strcmp(a->alias, b->name))
      memcpy(data + (size_t)a->alias_off * es, a->init, a->bytes);
  }
  memcpy(data, b->init, n < b->bytes ? n : b->bytes); /* an input's contents win where they overlap */
  if (b->dev)
    to_dev(b->region, b->image, b->region_len);
  else
    memcpy(b->region, b->image, b->region_len);
  b->mem = b->region + b->off;
}

static void place_all(Call *c) {
  for (int i = 0; i < c->nbufs; ++i)
    if (c->bufs[i].place != PL_ALIAS) place_buf(c, &c->bufs[i]);
  for (int i = 0; i < c->nbufs; ++i) {
    Buf *a = &c->bufs[i];
    if (a->place != PL_ALIAS) continue;
    Buf *t = buf_find(c, a->alias);
    if (!t) die("alias of an unknown buffer");
    a->mem = (unsigned char *)t->mem + (size_t)a->alias_off * elem_size(t->kind);
  }
}

/* The descriptor in host memory ending at a guard page, dlen bytes (at least its size), zeros
 * after the declared contents but for the tail byte. */
static void place_desc(Call *c) {
  const size_t size = c->cs->desc_size;
  if (!size) return;
  const size_t len = round_up(c->dlen > size ? c->dlen : size, 8);
  size_t off, rlen;
  unsigned char *r = host_region(c, len, PL_END, 8, 0, &off, &rlen);
  c->dmem = r + off;
  memset(c->dmem, 0, len);
  memcpy(c->dmem, c->desc, size);
  if (c->dtail) c->dmem[c->dtail] = 0x5A;
  c->dlen = len;
  c->dp = c->dmem;
}

/* ---- fields ----------------------------------------------------------------------------------- */

static int field_width(FieldKind k) {
  return k == F_ENUM || k == F_BOOL || k == F_INT || k == F_FLAGS || k == F_FLOAT || k == F_FREE ? 4 : 8;
}

/* The i-th mutable field: the descriptor's, then the parameters'. */
static const Field *case_field(const Case *cs, int i) { return i < cs->nfields ? &cs->fields[i] : &cs->params[i - cs->nfields]; }

static const Field *field_find(const Case *cs, const char *name) {
  for (int i = 0; i < cs->nfields + cs->nparams; ++i)
    if (!strcmp(case_field(cs, i)->name, name)) return case_field(cs, i);
  return NULL;
}

static unsigned char *field_addr(Call *c, const Field *f, int side) {
  return (side ? c->side : f->where == W_PARAM ? c->params : c->dmem) + f->off;
}

static void field_write(unsigned char *p, const Field *f, uint64_t bits) {
  const uint32_t b32 = (uint32_t)bits;
  if (field_width(f->kind) == 4)
    memcpy(p, &b32, 4);
  else
    memcpy(p, &bits, 8);
}

static uint64_t field_read(const unsigned char *p, const Field *f) {
  uint32_t b32;
  uint64_t b64;
  if (field_width(f->kind) == 4) {
    memcpy(&b32, p, 4);
    return b32;
  }
  memcpy(&b64, p, 8);
  return b64;
}

/* The control's value of f (declared; pointers unbound). */
static uint64_t ctl_value(Call *c, const Field *f) {
  return field_read((f->where == W_PARAM ? c->params : c->desc) + f->off, f);
}

static void bind_table(Call *c, const Field *t, int n, int side) {
  for (int i = 0; i < n; ++i) {
    const Field *f = &t[i];
    if (!side && f->where == W_DESC && !c->dmem) continue;
    const Buf *b = f->buf ? buf_find(c, f->buf) : f->kind == F_WS_PTR || f->kind == F_WS_BYTES ? buf_find(c, "workspace") : NULL;
    unsigned char *p = field_addr(c, f, side);
    if (f->kind == F_PTR || f->kind == F_WS_PTR) field_write(p, f, (uint64_t)(uintptr_t)(b ? b->mem : NULL));
    if (f->kind == F_BYTES || f->kind == F_WS_BYTES) field_write(p, f, b ? b->bytes : 0);
  }
}

/* ---- edits ------------------------------------------------------------------------------------ */

static int is_post(EditKind k) { return k == E_FIELD || k == E_DESC_NULL || k == E_PTR_TO; }

static void apply_edits(Call *c, const Edit *e, int n, int pre) {
  for (int i = 0; i < n; ++i) {
    const Edit *x = &e[i];
    if (x->k == E_CALL) {
      c->cs->edit(c, x->a, pre);
      continue;
    }
    if (is_post(x->k) == pre) continue;
    Buf *b = buf_find(c, x->name);
    const Field *f = field_find(c->cs, x->name);
    switch (x->k) {
      case E_FIELD:
        if (!f) die(x->name);
        field_write(field_addr(c, f, 0), f, x->bits);
        break;
      case E_DESC_NULL: c->dp = NULL; break;
      case E_TAIL:
        c->dlen = (size_t)x->a;
        c->dtail = (size_t)x->b;
        break;
      case E_PLACE:
        if (!b) die(x->name);
        b->place = (Placement)x->a;
        snprintf(b->alias, sizeof b->alias, "%s", x->other);
        b->alias_off = x->a == PL_ALIAS ? x->b : 0;
        b->misalign = x->a == PL_MISALIGN ? (int)(x->b ? x->b : 1) : 0;
        break;
      case E_PTR_TO: {
        const Buf *t = buf_find(c, x->other);
        if (!f || !t) die(x->name);
        field_write(field_addr(c, f, 0), f, (uint64_t)(uintptr_t)t->mem);
        break;
      }
      case E_ELEM:
        if (!b) die(x->name);
        if (is_float(b->kind))
          buf_set(b, 0, x->a, bits_f64(x->bits));
        else
          buf_seti(b, x->a, (int64_t)x->bits);
        break;
      case E_BYTES: {
        if (!b || (size_t)x->a + 8 > b->bytes) die(x->name);
        int64_t v;
        memcpy(&v, b->init + x->a, 8);
        v = x->b == OP_ADD ? (int64_t)((uint64_t)v + x->bits) : (int64_t)x->bits;
        memcpy(b->init + x->a, &v, 8);
        break;
      }
      default: break;
    }
  }
}

/* ---- one call --------------------------------------------------------------------------------- */

static void call_free(Call *c) {
  for (int i = 0; i < MAX_PLANS; ++i)
    if (c->plans[i]) hl_loss_plan_destroy(c->plans[i]);
  for (int i = 0; i < c->nbufs; ++i) {
    Buf *b = &c->bufs[i];
    if (b->dev && b->region) dev_free(b->region);
    free(b->init);
    free(b->image);
    free(b->after);
  }
  for (int i = 0; i < c->nmaps; ++i) munmap(c->maps[i], c->maplens[i]);
  c->nbufs = c->nmaps = 0;
}

/* Declares, prepares, edits, places and runs the call; its buffers are read back. */
static void call_run(Call *c, const Case *cs, int cuda, Placement pl, const Edit *e, int ne) {
  memset(c, 0, sizeof *c);
  c->cs = cs;
  c->cuda = cuda;
  c->backend = cuda ? HL_BACKEND_CUDA : HL_BACKEND_CPU;
  c->place = pl;
  cs->declare(c);
  if (cs->prepare) cs->prepare(c);
  apply_edits(c, e, ne, 1);
  place_all(c);
  place_desc(c);
  bind_table(c, cs->fields, cs->nfields, 0);
  bind_table(c, cs->params, cs->nparams, 0);
  bind_table(c, cs->side, cs->nside, 1);
  apply_edits(c, e, ne, 0);
  if (c->dmem) memcpy(c->dimage, c->dmem, c->dlen);
  c->status = cs->invoke(c);
  if (!c->msg_set) snprintf(c->msg, sizeof c->msg, "%s", hl_get_last_error());
  if (cuda) dev_sync();
  for (int i = 0; i < c->nbufs; ++i) {
    Buf *b = &c->bufs[i];
    if (!b->region) continue;
    b->after = xcalloc(b->region_len);
    if (b->dev)
      from_dev(b->after, b->region, b->region_len);
    else
      memcpy(b->after, b->region, b->region_len);
  }
  for (int i = 0; i < c->nbufs; ++i) { /* an alias reads its data from the memory it shares */
    Buf *a = &c->bufs[i];
    const Buf *t = a->place == PL_ALIAS ? buf_find(c, a->alias) : NULL;
    if (!t) continue;
    a->after = xcalloc(t->region_len);
    a->image = xcalloc(t->region_len);
    memcpy(a->after, t->after, t->region_len);
    memcpy(a->image, t->image, t->region_len);
    a->off = t->off + (size_t)a->alias_off * elem_size(t->kind);
    a->region_len = t->region_len;
  }
}

/* ---- checks ----------------------------------------------------------------------------------- */

enum {
  P_CRASH = 1 << 0, P_HANG = 1 << 1, P_SILENT = 1 << 2, P_STATUS = 1 << 3, P_REFUSED = 1 << 4,
  P_MISMATCH = 1 << 5, P_WROTE = 1 << 6, P_INPUT = 1 << 7, P_CANARY = 1 << 8, P_MSG_EMPTY = 1 << 9,
  P_MSG_PREFIX = 1 << 10, P_MSG_FIELD = 1 << 11, P_MSG_STALE = 1 << 12, P_NOFAULT = 1 << 13,
  P_NONFINITE = 1 << 14, P_REF = 1 << 15, P_SANITIZER = 1 << 16
};
static const char *const problem_names[] = {
    "crashed", "hung", "succeeded on invalid input", "wrong status", "refused a valid call",
    "wrong outputs", "wrote outputs on error", "modified an input", "wrote outside a buffer",
    "empty message", "message does not start with the entry point", "message does not name the field",
    "message not cleared on success", "no fault on a buffer one element short", "non-finite outputs",
    "reference call failed", "sanitizer report"};

void chk_fail(Chk *k, const char *fmt, ...) {
  if (!k->detail[0]) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->detail, sizeof k->detail, fmt, ap);
    va_end(ap);
  }
  k->problems |= P_MISMATCH;
}

static int close_enough(double got, double ref, double rtol, double atol) {
  if (isnan(ref) || isnan(got)) return isnan(ref) && isnan(got);
  if (isinf(ref)) return got == ref;
  return fabs(got - ref) <= rtol * fabs(ref) + atol;
}

void chk_val(Chk *k, const char *what, double got, double ref, double rtol, double atol) {
  if (!close_enough(got, ref, fmax(rtol, k->floor), fmax(atol, k->floor))) chk_fail(k, "%s = %.9g, expected %.9g", what, got, ref);
}

void chk_eq_u64(Chk *k, const char *what, uint64_t got, uint64_t ref) {
  if (got != ref) chk_fail(k, "%s = %llu, expected %llu", what, (unsigned long long)got, (unsigned long long)ref);
}

void chk_mat(Chk *k, Call *c, const char *name, const double *ref, int64_t rows, int64_t cols, double rtol,
             double atol) {
  const Buf *b = buf_find(c, name);
  if (!b || !buf_out(b)) {
    chk_fail(k, "%s: no such output", name);
    return;
  }
  double amax = 0;
  for (int64_t i = 0; i < rows * cols; ++i) amax = fmax(amax, isfinite(ref[i]) ? fabs(ref[i]) : 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < cols; ++col) {
      const double got = buf_get(b, buf_out(b), r, col), want = ref[r * cols + col];
      if (!isnan(want) && !close_enough(got, want, fmax(rtol, k->floor), fmax(atol, k->floor) * amax)) {
        chk_fail(k, "%s[%lld, %lld] = %.9g, expected %.9g", name, (long long)r, (long long)col, got, want);
        return;
      }
    }
}

/* Tolerance of a CUDA result against the CPU backend's: by the narrowest float input of the call
 * (an fp32 output of 16-bit inputs, GDN's dg, carries their rounding), as ||out - ref|| / ||ref||. */
static double call_rtol(const Call *c) {
  double tol = 2e-3;
  for (int i = 0; i < c->nbufs; ++i) {
    const ElemKind k = c->bufs[i].kind;
    if (c->bufs[i].role == R_IN && (k == EK_BF16 || k == EK_F16)) tol = k == EK_BF16 ? 2e-2 : fmax(tol, 5e-3);
  }
  return tol;
}

/* b's elements against r's (same layout) by the relative norm of their difference. */
static int close_in_norm(const Buf *b, const Buf *r, double rtol, char *detail, size_t dn) {
  const unsigned char *x = buf_out(b), *y = buf_out(r);
  if (!memcmp(x, y, b->bytes)) return 1; /* the same bits (an output neither call wrote too) */
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < b->rows; ++i)
    for (int64_t j = 0; j < b->cols; ++j) {
      const double got = buf_get(b, x, i, j), want = buf_get(r, y, i, j);
      diff += (got - want) * (got - want), ref += want * want;
    }
  if (sqrt(diff) <= rtol * sqrt(ref) || (diff == 0 && ref == 0)) return 1;
  snprintf(detail, dn, "%s: ||out - ref|| / ||ref|| = %.3g, above %.3g", b->name, sqrt(diff / ref), rtol);
  return 0;
}

/* b's logical elements against r's (same layout): bitwise, or within rtol of the largest. */
static int same_outputs(const Buf *b, const Buf *r, double rtol, char *detail, size_t dn) {
  if (b->bytes != r->bytes) {
    snprintf(detail, dn, "%s has %zu bytes, the reference %zu", b->name, b->bytes, r->bytes);
    return 0;
  }
  const unsigned char *x = buf_out(b), *y = buf_out(r);
  if (rtol == 0 || !is_float(b->kind)) {
    for (size_t i = 0; i < b->bytes; ++i)
      if (x[i] != y[i]) {
        snprintf(detail, dn, "%s differs at byte %zu (element %zu)", b->name, i, i / elem_size(b->kind));
        return 0;
      }
    return 1;
  }
  double amax = 0;
  for (int64_t i = 0; i < b->rows; ++i)
    for (int64_t j = 0; j < b->cols; ++j) amax = fmax(amax, fabs(buf_get(r, y, i, j)));
  for (int64_t i = 0; i < b->rows; ++i)
    for (int64_t j = 0; j < b->cols; ++j) {
      const double got = buf_get(b, x, i, j), want = buf_get(r, y, i, j);
      if (!close_enough(got, want, rtol, rtol * 0.1 * amax)) {
        snprintf(detail, dn, "%s[%lld, %lld] = %.9g, the reference %.9g", b->name, (long long)i, (long long)j, got, want);
        return 0;
      }
    }
  return 1;
}

static int is_output(const Buf *b) { return b->role == R_OUT || b->role == R_INOUT; }

/* Some output's memory is b's (an in-place mutation): b may change. */
static int overwritten(const Call *c, const Buf *b) {
  for (int i = 0; i < c->nbufs; ++i)
    if (c->bufs[i].place == PL_ALIAS && is_output(&c->bufs[i]) && !strcmp(c->bufs[i].alias, b->name)) return 1;
  return 0;
}

/* The pointer field of b was set to NULL by the mutation. */
static int nulled(const Call *c, const Mutation *m, const Buf *b) {
  for (int i = 0; i < m->ne; ++i) {
    const Field *f = field_find(c->cs, m->e[i].name);
    if (m->e[i].k == E_FIELD && f && f->kind == F_PTR && f->buf && !strcmp(f->buf, b->name) && !m->e[i].bits) return 1;
  }
  return 0;
}

static int moved(const Mutation *m) {
  for (int i = 0; i < m->ne; ++i)
    if (m->e[i].k == E_PLACE) return 1;
  return 0;
}

/* Word-bounded occurrence of one of needle's '|'-separated names in s. */
static int names(const char *s, const char *needle) {
  char alt[96];
  snprintf(alt, sizeof alt, "%s", needle);
  for (char *tok = strtok(alt, "|"); tok; tok = strtok(NULL, "|")) {
    const size_t n = strlen(tok);
    for (const char *p = strstr(s, tok); p; p = strstr(p + 1, tok)) {
      const int wb = (p == s || !(isalnum((unsigned char)p[-1]) || p[-1] == '_') ||
                      !(isalnum((unsigned char)tok[0]) || tok[0] == '_'));
      const int we = !(isalnum((unsigned char)p[n]) || p[n] == '_') || !(isalnum((unsigned char)tok[n - 1]) || tok[n - 1] == '_');
      if (wb && we) return 1;
    }
  }
  return 0;
}

typedef struct {
  int status, problems, faulted;
  char msg[512];
  char detail[300];
} Outcome;

static void note(Outcome *o, int problem, const char *fmt, ...) {
  if (!o->detail[0] && fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->detail, sizeof o->detail, fmt, ap);
    va_end(ap);
  }
  o->problems |= problem;
}

/* Canaries of every region, inputs unchanged, and on failure outputs unchanged too. */
static void check_memory(const Call *c, int failed, Outcome *o) {
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *b = &c->bufs[i];
    if (!b->after) continue;
    if (b->region && b->place != PL_ALIAS)
      for (size_t j = 0; j < b->region_len; ++j)
        if ((j < b->off || j >= b->off + b->span) && b->after[j] != b->image[j]) {
          note(o, P_CANARY, "%s's canary damaged %s its data (byte %lld)", b->name, j < b->off ? "before" : "after",
               j < b->off ? (long long)j - (long long)b->off : (long long)(j - b->off - b->span));
          break;
        }
    const int check = (b->role == R_IN && (failed || !overwritten(c, b))) || (failed && is_output(b));
    if (check && memcmp(b->after + b->off, b->image + b->off, b->place == PL_SHORT ? b->span : b->bytes))
      note(o, b->role == R_IN ? P_INPUT : P_WROTE, "%s changed", b->name);
  }
  if (c->dp && memcmp(c->dmem, c->dimage, c->dlen)) note(o, P_INPUT, "the descriptor changed");
}

static int all_finite(const Call *c) {
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *b = &c->bufs[i];
    if (!is_output(b) || !is_float(b->kind) || !b->after) continue;
    for (int64_t r = 0; r < b->rows; ++r)
      for (int64_t j = 0; j < b->cols; ++j)
        if (!isfinite(buf_get(b, buf_out(b), r, j))) return 0;
  }
  return 1;
}

/* The outputs of c against ref's: the same bits (within tolerance on CUDA for moved buffers); an
 * output the mutation passed as NULL keeps its poison. */
static void compare_outputs(const Call *c, const Call *ref, const Mutation *m, Outcome *o) {
  const double rtol = fz_cuda && moved(m) ? 1e-3 : 0;
  for (int i = 0; i < c->nbufs && !(o->problems & P_MISMATCH); ++i) {
    const Buf *b = &c->bufs[i];
    if (!is_output(b) || b->kind == EK_HANDLE || !b->after) continue;
    if (nulled(c, m, b)) {
      if (memcmp(b->after + b->off, b->image + b->off, b->bytes)) note(o, P_MISMATCH, "%s was written though NULL", b->name);
      continue;
    }
    const Buf *r = buf_find((Call *)ref, b->name);
    char detail[256];
    if (r && r->after && !same_outputs(b, r, rtol, detail, sizeof detail)) note(o, P_MISMATCH, "%s", detail);
  }
}

/* Stride gaps of the control's outputs keep their poison. */
static void check_gaps(const Call *c, Chk *k) {
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *b = &c->bufs[i];
    const size_t es = elem_size(b->kind);
    if (!is_output(b) || b->stride == b->cols || !b->after) continue;
    for (int64_t r = 0; r + 1 < b->rows; ++r) {
      const size_t at = b->off + (size_t)(r * b->stride + b->cols) * es, n = (size_t)(b->stride - b->cols) * es;
      if (memcmp(b->after + at, b->image + at, n)) {
        chk_fail(k, "%s: row %lld's stride gap was written", b->name, (long long)r);
        return;
      }
    }
  }
}

/* The control on CUDA against the same call on the CPU backend. */
static void compare_backends(const Call *c, const Call *cpu, Chk *k) {
  for (int i = 0; i < c->nbufs && !k->problems; ++i) {
    const Buf *b = &c->bufs[i];
    const Buf *r = buf_find((Call *)cpu, b->name);
    if (!is_output(b) || !is_float(b->kind) || !r || !r->after || !b->after) continue;
    char detail[256];
    if (b->bytes != r->bytes || !close_in_norm(b, r, call_rtol(c), detail, sizeof detail))
      chk_fail(k, "against the CPU backend: %s", b->bytes != r->bytes ? "sizes differ" : detail);
  }
}

/* A query's answers (its host outputs) for a larger size: at least the control's (m->expect -1). */
static void query_at_least(const Mutation *m, Call *ref, Call *c, Chk *k) {
  for (int i = 0; i < c->nbufs && m->expect == -1; ++i) {
    const Buf *b = &c->bufs[i], *r = buf_find(ref, b->name);
    if (!b->host || b->kind != EK_U64 || !r || !b->after || !r->after) continue;
    const int64_t got = buf_geti(b, buf_out(b), 0), was = buf_geti(r, buf_out(r), 0);
    if ((uint64_t)got < (uint64_t)was) chk_fail(k, "%s = %llu, less than the control's %llu", b->name,
                                                (unsigned long long)got, (unsigned long long)was);
  }
}

static const char *status_name(int s) {
  static const char *const n[] = {"SUCCESS", "INVALID_VALUE", "NOT_SUPPORTED", "MISALIGNED", "INSUFFICIENT_WORKSPACE",
                                  "ALLOC_FAILED", "CUDA_ERROR", "NCCL_ERROR", "INTERNAL_ERROR"};
  return s >= 0 && s <= 8 ? n[s] : "unknown status";
}

static const unsigned kCleanFailures = OK(HL_STATUS_INVALID_VALUE) | OK(HL_STATUS_NOT_SUPPORTED) |
                                       OK(HL_STATUS_MISALIGNED) | OK(HL_STATUS_INSUFFICIENT_WORKSPACE);

static int needs_ref(Tag t) { return t == T_MATCH || t == T_ALIGN || t == T_INPLACE || t == T_QUERY || (t == T_CONTROL && fz_cuda); }

/* Runs mutation m (its reference first where it has one) and judges it. */
static void run_mutation(const Case *cs, const Mutation *m, Placement pl, Outcome *o) {
  static Call ref, c; /* large: not on the stack */
  memset(o, 0, sizeof *o);
  const int have_ref = needs_ref(m->tag);
  if (have_ref) {
    call_run(&ref, cs, m->tag == T_CONTROL ? 0 : fz_cuda, pl, m->q, m->nq);
    if (ref.status != (m->tag == T_CONTROL ? cs->control_status : HL_STATUS_SUCCESS))
      note(o, P_REF, "reference call: %s: %s", status_name(ref.status), ref.msg);
  }
  call_run(&c, cs, fz_cuda, pl, m->e, m->ne);
  if (c.note[0]) note(o, 0, "%s", c.note); /* what failed after the call (create's execute) explains the rest */
  o->status = c.status;
  snprintf(o->msg, sizeof o->msg, "%s", c.msg);
  const int failed = c.status != HL_STATUS_SUCCESS;
  check_memory(&c, failed, o);
  const char *entry = cs->msg_entry ? cs->msg_entry : cs->entry;
  const size_t elen = strlen(entry);
  const char *needle = m->needle[0] ? m->needle : m->field;
  if (!failed && c.msg[0]) note(o, P_MSG_STALE, NULL);
  if (failed && !c.msg[0]) note(o, P_MSG_EMPTY, NULL);
  if (failed && c.msg[0] && (strncmp(c.msg, entry, elen) || c.msg[elen] != ':')) note(o, P_MSG_PREFIX, NULL);
  /* A refusal of the mutated value names it; a valid value's may be refused over another field. */
  const int names_field = m->tag == T_FAIL || m->tag == T_ALIGN || m->tag == T_INPLACE || m->tag == T_QUERY;
  if (failed && names_field && needle[0] && c.msg[0] && !names(c.msg + (strncmp(c.msg, entry, elen) ? 0 : elen), needle))
    note(o, P_MSG_FIELD, NULL);
  if (failed && (c.status == HL_STATUS_INTERNAL_ERROR || c.status == HL_STATUS_ALLOC_FAILED || c.status == HL_STATUS_CUDA_ERROR))
    note(o, P_STATUS, "status %s", status_name(c.status));
  Chk k = {0, "", fz_cuda ? 2e-3 : 0}; /* the checks against closed forms: fp32 at most this far on CUDA */
  switch (m->tag) {
    case T_CONTROL:
      if (c.status != cs->control_status) {
        note(o, P_REFUSED, "status %s", status_name(c.status));
        break;
      }
      check_gaps(&c, &k);
      if (!failed && cs->check) cs->check(&c, &k);
      if (fz_cuda && !failed && !(o->problems & P_REF)) compare_backends(&c, &ref, &k);
      if (k.problems) note(o, k.problems, "%s", k.detail);
      break;
    case T_FAIL:
      if (!failed)
        note(o, P_SILENT, NULL);
      else if (!(OK(c.status) & (m->ok ? m->ok : OK(HL_STATUS_INVALID_VALUE))))
        note(o, P_STATUS, "status %s", status_name(c.status));
      break;
    case T_MATCH:
    case T_ALIGN:
    case T_INPLACE:
      if (failed && m->tag == T_MATCH) note(o, P_REFUSED, "status %s", status_name(c.status));
      if (failed && m->tag != T_MATCH &&
          !(OK(c.status) & (OK(HL_STATUS_INVALID_VALUE) | OK(HL_STATUS_MISALIGNED))))
        note(o, P_STATUS, "status %s", status_name(c.status));
      if (!failed && !(o->problems & P_REF)) compare_outputs(&c, &ref, m, o);
      break;
    case T_MAY:
    case T_MAY_FINITE:
    case T_QUERY:
      if (failed && !(OK(c.status) & kCleanFailures)) note(o, P_STATUS, "status %s", status_name(c.status));
      if (!failed && m->tag == T_MAY_FINITE && !all_finite(&c)) note(o, P_NONFINITE, NULL);
      if (!failed && m->tag == T_QUERY && !(o->problems & P_REF)) {
        if (cs->qcheck)
          cs->qcheck(&ref, &c, &k);
        else
          query_at_least(m, &ref, &c, &k);
        if (k.problems) note(o, k.problems, "%s", k.detail);
      }
      break;
    case T_FAULT: note(o, P_NOFAULT, NULL); break;
  }
  if (have_ref) call_free(&ref);
  call_free(&c);
}

/* ---- isolation -------------------------------------------------------------------------------- */

static void on_fault(int sig) {
  (void)sig;
  _exit(FAULT_EXIT);
}

/* CUDA mode runs in-process: a crash ends the run, naming the mutation that caused it. */
static void on_crash(int sig) {
  static const char head[] = "test_fuzz: crashed (a finding) while running ";
  write(2, head, sizeof head - 1);
  write(2, fz_running, strlen(fz_running));
  write(2, "\n", 1);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void write_all(int fd, const void *p, size_t n) {
  while (n) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) return;
    p = (const char *)p + w;
    n -= (size_t)w;
  }
}

/* The mutation in a child process (CPU mode): a crash or a hang is the child's, the outcome comes
 * back through a pipe and its stderr through another (scanned for sanitizer reports). */
static void isolated(const Case *cs, const Mutation *m, Placement pl, Outcome *o, char *err, size_t errcap) {
  err[0] = 0;
  if (fz_cuda) {
    snprintf(fz_running, sizeof fz_running, "%s [%s] {%s} = %s", cs->entry, cs->label, m->field, m->value);
    run_mutation(cs, m, pl, o);
    return;
  }
  int res[2], ep[2];
  if (pipe(res) || pipe(ep)) die("pipe failed");
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {
    close(res[0]);
    close(ep[0]);
    dup2(ep[1], 2);
    close(ep[1]);
    if (m->tag == T_FAULT) {
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = on_fault;
      sigaction(SIGSEGV, &sa, NULL);
      sigaction(SIGBUS, &sa, NULL);
    }
    alarm(CHILD_SECONDS);
    Outcome r;
    run_mutation(cs, m, pl, &r);
    write_all(res[1], &r, sizeof r);
    _exit(0);
  }
  close(res[1]);
  close(ep[1]);
  size_t got = 0, elen = 0;
  struct pollfd fds[2] = {{res[0], POLLIN, 0}, {ep[0], POLLIN, 0}};
  int open_fds = 2;
  char sink[4096];
  while (open_fds) {
    if (poll(fds, 2, -1) < 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char *dst = i == 0 ? (char *)o + got : elen + 1 < errcap ? err + elen : sink;
      size_t cap = i == 0 ? sizeof *o - got : elen + 1 < errcap ? errcap - 1 - elen : sizeof sink;
      if (i == 0 && cap == 0) dst = sink, cap = sizeof sink;
      const ssize_t r = read(fds[i].fd, dst, cap);
      if (r <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else if (i == 0 && dst != sink) {
        got += (size_t)r;
      } else if (i == 1 && dst != sink) {
        elen += (size_t)r;
      }
    }
  }
  err[elen] = 0;
  int ws = 0;
  waitpid(pid, &ws, 0);
  const int sig = WIFSIGNALED(ws) ? WTERMSIG(ws) : 0, code = WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
  const int segv = sig == SIGSEGV || sig == SIGBUS || code == FAULT_EXIT || strstr(err, "SEGV") || strstr(err, "BUS on");
  if (m->tag == T_FAULT && got < sizeof *o && segv) {
    memset(o, 0, sizeof *o);
    o->faulted = 1;
    return;
  }
  if (got < sizeof *o) {
    memset(o, 0, sizeof *o);
    o->status = -1;
    if (sig == SIGALRM)
      note(o, P_HANG, "no answer in %d s", CHILD_SECONDS);
    else if (sig)
      note(o, P_CRASH, "killed by signal %d (%s)", sig, strsignal(sig));
    else
      note(o, P_CRASH, "exited with code %d before reporting", code);
  }
  const char *report = strstr(err, "runtime error:");
  if (!report) report = strstr(err, "ERROR: AddressSanitizer");
  if (report) {
    const char *eol = strchr(report, '\n');
    note(o, P_SANITIZER, "%.*s", (int)(eol ? eol - report : 200), report);
  }
}

/* ---- generic mutations ------------------------------------------------------------------------ */

Mutation *gen_add(Gen *g, const char *field, const char *value, Tag tag, const char *needle) {
  if (g->n == g->cap) {
    g->cap = g->cap ? 2 * g->cap : 256;
    g->v = realloc(g->v, (size_t)g->cap * sizeof *g->v);
    if (!g->v) die("out of memory");
  }
  Mutation *m = &g->v[g->n++];
  memset(m, 0, sizeof *m);
  snprintf(m->field, sizeof m->field, "%s", field);
  snprintf(m->value, sizeof m->value, "%s", value);
  m->tag = tag;
  snprintf(m->needle, sizeof m->needle, "%s", needle ? needle : "");
  m->expect = -1;
  return m;
}

static Edit *add_edit(Edit *e, int *n, EditKind k, const char *name) {
  if (*n == MAX_EDITS) die("too many edits");
  Edit *x = &e[(*n)++];
  memset(x, 0, sizeof *x);
  x->k = k;
  snprintf(x->name, sizeof x->name, "%s", name ? name : "");
  return x;
}

Edit *mut_edit(Mutation *m, EditKind k, const char *name) { return add_edit(m->e, &m->ne, k, name); }
Edit *mut_equiv(Mutation *m, EditKind k, const char *name) { return add_edit(m->q, &m->nq, k, name); }

Edit *mut_set(Mutation *m, const char *field, uint64_t bits) {
  Edit *e = mut_edit(m, E_FIELD, field);
  e->bits = bits;
  return e;
}

static Mutation *gen_set(Gen *g, const Field *f, const char *value, uint64_t bits, Tag tag) {
  Mutation *m = gen_add(g, f->name, value, tag, NULL);
  mut_set(m, f->name, bits);
  return m;
}

typedef struct {
  int64_t v;
  const char *name;
} Named;

static const Named kHostile64[] = {
    {-1, "-1"}, {INT64_MIN, "INT64_MIN"}, {INT64_MAX, "INT64_MAX"}, {P2(31), "2^31"}, {P2(32), "2^32"},
    {HL_MAX_EXTENT, "2^48-1"}, {P2(48), "2^48"}, {P2(53) + 1, "2^53+1"}, {P2(61), "2^61"}, {P2(62), "2^62"}, {0, "0"}};

static int64_t extent_hi(const Field *f) { return f->hi ? f->hi : HL_MAX_EXTENT; }

static void gen_size(Gen *g, const Field *f) {
  const int64_t cur = (int64_t)ctl_value(g->ctl, f), hi = extent_hi(f);
  const int used = !f->buf || buf_find(g->ctl, f->buf);
  for (size_t i = 0; i < sizeof kHostile64 / sizeof *kHostile64; ++i) {
    const int64_t v = kHostile64[i].v;
    if (v == cur) continue;
    Tag t;
    unsigned ok = 0;
    if (v < 0 && !used) {
      t = T_MAY; /* the count of an absent buffer: the header bounds it only above */
    } else if (v < f->lo || v > HL_MAX_EXTENT) {
      t = T_FAIL;
    } else if (v > hi) { /* a documented bound below the extent: refused or not supported */
      t = T_FAIL;
      ok = OK(HL_STATUS_INVALID_VALUE) | OK(HL_STATUS_NOT_SUPPORTED);
    } else if (v == 0) {
      t = g->cs->query ? T_QUERY : T_MAY;
    } else if (g->cs->query) {
      t = T_QUERY;
    } else {
      continue; /* valid, and larger than the caller's buffers: the caller's error */
    }
    Mutation *m = gen_set(g, f, kHostile64[i].name, (uint64_t)v, t);
    m->ok = ok;
    m->expect = v == 0 ? -2 : -1; /* a query for more is at least the control's answer */
  }
}

static void gen_stride(Gen *g, const Field *f) {
  const Buf *b = buf_find(g->ctl, f->buf);
  const int64_t cur = (int64_t)ctl_value(g->ctl, f), cols = b ? b->cols : 0;
  const int packed = b && (cur == 0 || cur == cols);
  char name[32];
  for (size_t i = 0; i < sizeof kHostile64 / sizeof *kHostile64; ++i) {
    const int64_t v = kHostile64[i].v;
    if (v == cur) continue;
    Tag t = T_MAY;
    if (v > HL_MAX_EXTENT || (v < 0 && b)) /* the limit holds for any stride, used or not */
      t = T_FAIL;
    else if (v == 0 && packed)
      t = T_MATCH;
    else if (b && v > 0 && b->rows > 1)
      continue; /* valid, and beyond the caller's buffer */
    else if (b && v > 0)
      t = T_MATCH; /* one row: the stride is never used */
    gen_set(g, f, kHostile64[i].name, (uint64_t)v, t);
  }
  if (!b || g->cs->query) return;
  if (cur != cols) gen_set(g, f, "cols (packed)", (uint64_t)cols, packed ? T_MATCH : T_MAY);
  snprintf(name, sizeof name, "cols - 1 (%lld)", (long long)(cols - 1));
  if (cols > 1 && b->rows > 1) gen_set(g, f, name, (uint64_t)(cols - 1), T_FAIL);
}

static void gen_int(Gen *g, const Field *f) {
  static const Named vals[] = {{-1, "-1"}, {INT_MIN, "INT_MIN"}, {INT_MAX, "INT_MAX"}, {99, "99"}, {2, "2"}, {0, "0"}};
  const int cur = (int)ctl_value(g->ctl, f);
  for (size_t i = 0; i < sizeof vals / sizeof *vals; ++i) {
    const int v = (int)vals[i].v;
    if (v == cur) continue;
    Tag t = T_MAY;
    switch (f->kind) {
      case F_ENUM: /* 0 and 2 are enumerators; 0 is wrong where lo is 1 */
        if (v == 2 || (v == 0 && f->lo != 1)) continue;
        t = T_FAIL;
        break;
      case F_BOOL:
        t = v == 0 || v == 1 ? T_MAY : T_FAIL;
        break;
      case F_INT:
        t = v < f->lo || (f->hi && v > f->hi) ? T_FAIL : T_MAY;
        break;
      default:
        break;
    }
    if (g->cs->query && t == T_FAIL) t = T_MAY;
    gen_set(g, f, vals[i].name, (uint64_t)(uint32_t)v, t);
  }
  /* Enumerators wrong for the field: refused where the field is used (f->buf passed, if named). */
  const int bad[2] = {f->bad1, f->bad2}, used = !f->buf || buf_find(g->ctl, f->buf);
  for (int i = 0; i < 2; ++i) {
    char name[16];
    snprintf(name, sizeof name, "%d", bad[i]);
    if (f->kind == F_ENUM && bad[i] && bad[i] != cur)
      gen_set(g, f, name, (uint64_t)(uint32_t)bad[i], g->cs->query || !used ? T_MAY : T_FAIL);
  }
  if (f->kind == F_INT && f->hi && f->hi + 1 != INT_MAX) {
    char name[24];
    snprintf(name, sizeof name, "%lld", (long long)f->hi + 1);
    gen_set(g, f, name, (uint64_t)(uint32_t)(f->hi + 1), T_FAIL);
  }
}

static void gen_flags(Gen *g, const Field *f) {
  const unsigned cur = (unsigned)ctl_value(g->ctl, f), known = (unsigned)f->hi;
  unsigned top = 0;
  for (unsigned b = 1; b; b <<= 1)
    if (known & b) top = b;
  const unsigned unknown[] = {~0u, 1u << 31, top << 1};
  const char *const unames[] = {"all bits", "bit 31", "the next bit"};
  char name[32];
  for (int i = 0; i < 3; ++i)
    if (unknown[i] & ~known) gen_set(g, f, unames[i], cur | unknown[i], g->cs->query ? T_MAY : T_FAIL);
  for (unsigned b = 1; b && b <= known; b <<= 1) {
    if (!(known & b)) continue;
    snprintf(name, sizeof name, "bit 0x%x toggled", b);
    gen_set(g, f, name, cur ^ b, (f->lo & b) ? T_MATCH : T_MAY);
  }
}

/* Whether a float rule holds for the control: always, or while the control has f->term. */
static int rule_active(Gen *g, const Field *f) {
  if (!f->term) return 1;
  const Field *terms = field_find(g->cs, "terms");
  return terms && (ctl_value(g->ctl, terms) & f->term);
}

static void gen_float(Gen *g, const Field *f) {
  static const struct {
    double v;
    const char *name;
  } vals[] = {{NAN, "NaN"}, {INFINITY, "+inf"}, {-INFINITY, "-inf"}, {-1, "-1"}, {1e30, "1e30"}, {0, "0"}};
  const uint64_t raw = ctl_value(g->ctl, f);
  const double cur = f->kind == F_FLOAT ? bits_f32(raw) : bits_f64(raw);
  const int active = rule_active(g, f) && !g->cs->query;
  for (size_t i = 0; i < sizeof vals / sizeof *vals; ++i) {
    const double v = vals[i].v;
    if (v == cur) continue;
    Tag t = T_MAY;
    const int nan = isnan(v), neg = v < 0;
    if (v == 0) {
      if (!isnan(f->def) && cur == f->def)
        t = T_MATCH; /* 0 stands for the default the control spells out */
      else if (active && f->rule == FR_SET)
        t = T_FAIL;
    } else if (active) {
      switch (f->rule) {
        case FR_UNIT: case FR_OPEN01: case FR_BETA: t = T_FAIL; break;
        case FR_POS: case FR_DUAL: t = nan || neg ? T_FAIL : T_MAY; break;
        case FR_SET: t = nan || isinf(v) ? T_FAIL : T_MAY; break;
        case FR_MAY: break;
      }
    }
    gen_set(g, f, vals[i].name, f->kind == F_FLOAT ? f32_bits((float)v) : f64_bits(v), t);
  }
  if (cur == 0 && !isnan(f->def) && f->def != 0) { /* the default spelled out, where the control has 0 */
    char name[40];
    snprintf(name, sizeof name, "%g (what 0 stands for)", f->def);
    gen_set(g, f, name, f->kind == F_FLOAT ? f32_bits((float)f->def) : f64_bits(f->def), T_MATCH);
  }
}

/* Input and output buffers of the control, in declaration order. */
static int list_bufs(Call *c, int outputs, const Buf **out) {
  int n = 0;
  for (int i = 0; i < c->nbufs; ++i) {
    const Buf *b = &c->bufs[i];
    if (b->host || b->role == R_SCRATCH || (outputs ? !is_output(b) : b->role != R_IN)) continue;
    out[n++] = b;
  }
  return n;
}

static int in_list(const char *list, const char *name) {
  if (!list) return 0;
  const size_t n = strlen(name);
  for (const char *p = strstr(list, name); p; p = strstr(p + 1, name))
    if ((p == list || p[-1] == ' ') && (p[n] == 0 || p[n] == ' ' || p[n] == '=')) return 1;
  return 0;
}

/* out aliases in exactly, and that is documented (Case.inplace "out=in") with matching layouts. */
static int documented_inplace(const Case *cs, const Buf *out, const Buf *in) {
  char pair[2 * NAME_LEN + 2];
  snprintf(pair, sizeof pair, "%s=%s", out->name, in->name);
  return cs->inplace && strstr(cs->inplace, pair) && out->kind == in->kind && out->stride == in->stride &&
         out->rows == in->rows && out->cols == in->cols;
}

Mutation *gen_overlap(Gen *g, const char *field, const char *out, const char *over, int partial, Tag tag) {
  const Buf *b = buf_find(g->ctl, out), *t = buf_find(g->ctl, over);
  if (!b || !t) die("gen_overlap: no such buffer");
  char value[80], needle[100];
  snprintf(value, sizeof value, partial ? "inside %s (partial overlap)" : "= %s (exact alias)", t->name);
  snprintf(needle, sizeof needle, "%s|%s", field, t->name);
  for (int i = 0; i < g->n; ++i) /* a pair the generic choice made already */
    if (!strcmp(g->v[i].field, field) && !strcmp(g->v[i].value, value)) return &g->v[i];
  Mutation *m = gen_add(g, field, value, tag, needle);
  Edit *e = mut_edit(m, E_PLACE, b->name);
  e->a = PL_ALIAS;
  snprintf(e->other, sizeof e->other, "%s", t->name);
  /* partial: 8 bytes further on (every element and block word stays aligned) */
  const size_t step = 8;
  e->b = partial && t->bytes > step ? (int64_t)(step / elem_size(t->kind)) : 0;
  return m;
}

/* Output b over buffer t: in place where documented, else refused or right (the header forbids no
 * overlap in general; two outputs in one place are right only by chance). */
static void gen_alias(Gen *g, const Field *f, const Buf *b, const Buf *t, int partial) {
  Tag tag = !partial && documented_inplace(g->cs, b, t) ? T_MATCH : T_INPLACE;
  if (b->role == R_INOUT && !is_output(t)) tag = T_MAY; /* it would start from the input's values */
  gen_overlap(g, f->name, b->name, t->name, partial, tag);
}

static void gen_ptr(Gen *g, const Field *f) {
  Call *c = g->ctl;
  const Buf *b = buf_find(c, f->buf);
  if (!b) {
    const Buf *ins[MAX_BUFS];
    if (in_list(g->cs->forbid, f->name) && list_bufs(c, 0, ins)) {
      char value[64];
      snprintf(value, sizeof value, "%s (set)", ins[0]->name);
      Mutation *m = gen_add(g, f->name, value, T_FAIL, NULL);
      snprintf(mut_edit(m, E_PTR_TO, f->name)->other, NAME_LEN, "%s", ins[0]->name);
    }
    return;
  }
  gen_set(g, f, "NULL", 0, !b->optional ? T_FAIL : is_output(b) ? T_MATCH : T_MAY);
  if (g->cs->query) return;
  if (!b->host) {
    Mutation *m = gen_add(g, f->name, "misaligned by 1 byte", T_ALIGN, NULL);
    mut_edit(m, E_PLACE, b->name)->a = PL_MISALIGN;
  }
  if (!fz_cuda && b->bytes && b->role != R_SCRATCH && (!b->optional || is_output(b))) {
    Mutation *m = gen_add(g, f->name, "one element short, before a guard page", T_FAULT, NULL);
    mut_edit(m, E_PLACE, b->name)->a = PL_SHORT;
  }
  if (!is_output(b) || b->host) return;
  const Buf *ins[MAX_BUFS], *outs[MAX_BUFS];
  const int nin = list_bufs(c, 0, ins), nout = list_bufs(c, 1, outs);
  int idx = 0;
  while (idx < nout && outs[idx] != b) ++idx;
  if (nin) {
    gen_alias(g, f, b, ins[idx % nin], 0);
    gen_alias(g, f, b, ins[(idx + 1) % nin], 1);
  }
  for (int i = 0; i < nin; ++i) /* the documented in-place pairs, whatever their place */
    if (documented_inplace(g->cs, b, ins[i]) && ins[i] != ins[idx % nin]) gen_alias(g, f, b, ins[i], 0);
  if (nout > 1) {
    gen_alias(g, f, b, outs[(idx + 1) % nout], 0);
    gen_alias(g, f, b, outs[(idx + 1) % nout], 1);
  }
}

static void gen_bytes(Gen *g, const Field *f) {
  const Buf *b = buf_find(g->ctl, f->buf);
  if (!b) return;
  const size_t need = b->bytes;
  const struct {
    uint64_t v;
    const char *name;
    Tag tag;
  } vals[] = {{0, "0", T_FAIL}, {need - 1, "one byte short", T_FAIL}, {need / 2, "half", T_FAIL},
              {need + 8, "8 bytes more", T_MATCH}, /* far more claims memory where other buffers lie: */
              {(uint64_t)P2(32), "2^32", T_MAY}, {(uint64_t)P2(48), "2^48", T_MAY}, {(uint64_t)P2(62), "2^62", T_MAY},
              {(uint64_t)P2(62) + 1, "2^62+1", T_MAY}, {SIZE_MAX, "SIZE_MAX", T_MAY}};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; ++i) gen_set(g, f, vals[i].name, vals[i].v, vals[i].tag);
}

static void gen_workspace(Gen *g, const Field *f) {
  const size_t need = g->ctl->ws_need;
  const Buf *ws = buf_find(g->ctl, "workspace");
  const Tag more = (g->cs->flags & CASE_WS_CHUNKS) ? T_MAY : T_MATCH;
  const unsigned short_ws = OK(HL_STATUS_INSUFFICIENT_WORKSPACE) | OK(HL_STATUS_INVALID_VALUE);
  if (f->kind == F_WS_BYTES) {
    if (need) {
      gen_set(g, f, "0", 0, T_FAIL)->ok = short_ws;
      gen_set(g, f, "one byte short", need - 1, T_FAIL)->ok = short_ws;
      gen_set(g, f, "16 bytes more", need + 16, more);
    }
    gen_set(g, f, "2^62+1", (uint64_t)P2(62) + 1, T_MAY);
    gen_set(g, f, "SIZE_MAX", SIZE_MAX, T_MAY);
    return;
  }
  if (!need) { /* none needed ("NULL if 0"): one passed anyway must not be written */
    const Buf *ins[MAX_BUFS];
    if (list_bufs(g->ctl, 0, ins)) {
      Mutation *m = gen_add(g, f->name, "an input's memory (none needed)", T_MAY, NULL);
      snprintf(mut_edit(m, E_PTR_TO, f->name)->other, NAME_LEN, "%s", ins[0]->name);
    }
    return;
  }
  if (!ws) return;
  gen_set(g, f, "NULL", 0, T_FAIL)->ok = short_ws;
  for (int mis = 1; mis <= 8; mis += 7) { /* off by a byte, and 8-byte aligned only */
    Mutation *m = gen_add(g, f->name, mis == 1 ? "misaligned by 1 byte" : "8-byte aligned only", T_FAIL, NULL);
    m->ok = OK(HL_STATUS_MISALIGNED);
    Edit *e = mut_edit(m, E_PLACE, "workspace");
    e->a = PL_MISALIGN;
    e->b = mis;
  }
}

static void gen_struct_size(Gen *g, const Field *f) {
  const size_t size = g->cs->desc_size;
  const struct {
    size_t v, mem, tail;
    const char *name;
    Tag tag;
  } vals[] = {{0, 0, 0, "0", T_FAIL}, {1, 0, 0, "1", T_FAIL}, {7, 0, 0, "7", T_FAIL},
              {size - 1, 0, 0, "sizeof - 1", T_FAIL}, {size + 1, size + 1, size, "sizeof + 1, its tail byte set", T_FAIL},
              {size + 8, size + 8, 0, "sizeof + 8, tail zero", T_MATCH},
              {HL_MAX_STRUCT_SIZE, HL_MAX_STRUCT_SIZE, 0, "HL_MAX_STRUCT_SIZE, tail zero", T_MATCH},
              {HL_MAX_STRUCT_SIZE, HL_MAX_STRUCT_SIZE, HL_MAX_STRUCT_SIZE - 1, "HL_MAX_STRUCT_SIZE, last byte set", T_FAIL},
              {HL_MAX_STRUCT_SIZE + 1, HL_MAX_STRUCT_SIZE + 1, 0, "HL_MAX_STRUCT_SIZE + 1, tail zero", T_FAIL},
              {(size_t)1 << 20, 0, 0, "2^20", T_FAIL}, {SIZE_MAX, 0, 0, "SIZE_MAX", T_FAIL}};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; ++i) {
    Mutation *m = gen_set(g, f, vals[i].name, vals[i].v, vals[i].tag);
    Edit *e = mut_edit(m, E_TAIL, NULL);
    e->a = (int64_t)vals[i].mem;
    e->b = (int64_t)vals[i].tail;
    /* A later header's descriptor that uses a field this library lacks: valid, not supported here. */
    if (vals[i].tail) m->ok = OK(HL_STATUS_NOT_SUPPORTED);
  }
  for (const size_t *e = g->cs->earlier; e && *e; ++e) {
    char name[48];
    int zero = 1; /* the control sets no field after the earlier size (pointers: no buffer bound) */
    for (size_t j = *e; j < size; ++j) zero &= g->ctl->desc[j] == 0;
    for (int j = 0; j < g->cs->nfields; ++j) {
      const Field *p = &g->cs->fields[j];
      zero &= p->off < *e || p->kind != F_PTR || !buf_find(g->ctl, p->buf);
    }
    snprintf(name, sizeof name, "%zu (an earlier version's)", *e);
    gen_set(g, f, name, *e, zero && !(g->cs->flags & CASE_SCALARS_BY_SIZE) ? T_MATCH : T_MAY);
    snprintf(name, sizeof name, "%zu (between versions)", *e + 4);
    int listed = *e + 4 == size;
    for (const size_t *o = g->cs->earlier; *o; ++o) listed |= *o == *e + 4;
    if (!listed) gen_set(g, f, name, *e + 4, T_FAIL);
  }
}

static void gen_field(Gen *g, const Field *f) {
  switch (f->kind) {
    case F_STRUCT_SIZE: gen_struct_size(g, f); break;
    case F_SIZE: gen_size(g, f); break;
    case F_STRIDE: gen_stride(g, f); break;
    case F_I64: {
      const int64_t cur = (int64_t)ctl_value(g->ctl, f);
      for (size_t i = 0; i < sizeof kHostile64 / sizeof *kHostile64; ++i)
        if (kHostile64[i].v != cur) gen_set(g, f, kHostile64[i].name, (uint64_t)kHostile64[i].v, T_MAY);
      break;
    }
    case F_ENUM: case F_BOOL: case F_INT: case F_FREE: gen_int(g, f); break;
    case F_FLAGS: gen_flags(g, f); break;
    case F_FLOAT: case F_DOUBLE: gen_float(g, f); break;
    case F_PTR: gen_ptr(g, f); break;
    case F_BYTES: gen_bytes(g, f); break;
    case F_WS_PTR: case F_WS_BYTES: gen_workspace(g, f); break;
    case F_PLAN: gen_set(g, f, "NULL", 0, T_FAIL); break;
  }
}

static void gen_case(Gen *g, const Case *cs, Call *ctl) {
  memset(g, 0, sizeof *g);
  g->cs = cs;
  g->ctl = ctl;
  for (int i = 0; i < cs->nfields + cs->nparams; ++i)
    if (!cs->only || in_list(cs->only, case_field(cs, i)->name)) gen_field(g, case_field(cs, i));
  if (cs->desc_name) mut_edit(gen_add(g, cs->desc_name, "NULL", T_FAIL, NULL), E_DESC_NULL, NULL);
  if (cs->extra) cs->extra(g);
}

/* ---- the run ---------------------------------------------------------------------------------- */

typedef struct {
  const char *entry;
  int controls, mutations, refused, matched, faulted, findings;
} Tally;

static const char *tag_name(Tag t) {
  static const char *const n[] = {"control", "must fail", "must match", "fail or match", "fail or be right",
                                  "may succeed", "may succeed (finite)", "query", "must fault"};
  return n[t];
}

static int report(const Case *cs, const Mutation *m, const Outcome *o, const char *err, Tally *t) {
  if (!o->problems) return 0;
  ++t->findings;
  printf("FINDING %s [%s] %s = %s (%s): ", cs->entry, cs->label, m->field, m->value, tag_name(m->tag));
  int first = 1;
  for (int b = 0; b < (int)(sizeof problem_names / sizeof *problem_names); ++b)
    if (o->problems & (1 << b)) printf("%s%s", first ? "" : ", ", problem_names[b]), first = 0;
  if (o->detail[0]) printf(" (%s)", o->detail);
  if (o->status >= 0) printf("; %s", status_name(o->status));
  printf(" | \"%s\"\n", o->msg);
  if (err[0] && (fz_verbose || (o->problems & (P_CRASH | P_SANITIZER))))
    fprintf(stderr, "--- child stderr ---\n%.1500s\n--------------------\n", err);
  return 1;
}

static int selected(const Case *cs, const char *filter) {
  if (!filter || !*filter) return 1;
  char buf[256], hay[256];
  snprintf(hay, sizeof hay, "%s [%s] %s", cs->entry, cs->label, cs->family ? cs->family : "");
  snprintf(buf, sizeof buf, "%s", filter);
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ","))
    if (strstr(hay, tok)) return 1;
  return 0;
}

/* name is one of list's comma-separated names. */
static int listed(const char *list, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = list ? strstr(list, name) : NULL; p; p = strstr(p + 1, name))
    if ((p == list || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return 1;
  return 0;
}

static const char *option(int argc, char **argv, const char *flag, const char *env) {
  const size_t n = strlen(flag);
  for (int i = 1; i < argc; ++i)
    if (!strncmp(argv[i], flag, n) && argv[i][n] == '=') return argv[i] + n + 1;
  return getenv(env);
}

static int has_flag(int argc, char **argv, const char *flag) {
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], flag)) return 1;
  return 0;
}

static void usage(void) {
  puts("test_fuzz: the ABI fuzz harness (tests/c/test_fuzz.c)\n"
       "  --cuda, HL_FUZZ_BACKEND=cuda   the CUDA backend (in-process; exit 77 without a GPU)\n"
       "  --filter=A,B, HL_FUZZ_FILTER   cases whose entry point, [label] or family contains A or B\n"
       "  --field=F, HL_FUZZ_FIELD       mutations of fields whose name contains F\n"
       "  --skip=A,B, HL_FUZZ_SKIP       no mutations of the fields named A or B\n"
       "  --max=N, HL_FUZZ_MAX           at most N mutations a case, spread over its list (0: controls only)\n"
       "  -v, HL_FUZZ_VERBOSE=1          every mutation's outcome, and the children's stderr");
}

int fuzz_main(int argc, char **argv, const Case *const *cases, int ncases) {
  if (has_flag(argc, argv, "-h") || has_flag(argc, argv, "--help")) {
    usage();
    return 0;
  }
  const char *backend = getenv("HL_FUZZ_BACKEND"), *filter = option(argc, argv, "--filter", "HL_FUZZ_FILTER");
  const char *field = option(argc, argv, "--field", "HL_FUZZ_FIELD"), *max_s = option(argc, argv, "--max", "HL_FUZZ_MAX");
  const char *skip = option(argc, argv, "--skip", "HL_FUZZ_SKIP");
  fz_cuda = has_flag(argc, argv, "--cuda") || (backend && !strcmp(backend, "cuda"));
  fz_verbose = has_flag(argc, argv, "-v") || (getenv("HL_FUZZ_VERBOSE") && atoi(getenv("HL_FUZZ_VERBOSE")));
  const int max = max_s ? atoi(max_s) : -1;
  fz_page = sysconf(_SC_PAGESIZE);
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (fz_cuda) {
#if !HL_FUZZ_CUDA
    puts("test_fuzz: skipped: built without CUDA (HL_FUZZ_BACKEND=cuda)");
    return 77;
#endif
    if (!hl_backend_is_available(HL_BACKEND_CUDA)) {
      puts("test_fuzz: skipped: no CUDA device (HL_FUZZ_BACKEND=cuda)");
      return 77;
    }
    signal(SIGSEGV, on_crash);
    signal(SIGBUS, on_crash);
    signal(SIGABRT, on_crash);
  } else {
    /* CUDA does not survive fork(): the children must never touch it. With the devices hidden the
     * library's availability answer (cached once) is 0 before the first fork, so the CPU backend's
     * pointer checks make no CUDA call in a child. */
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    (void)hl_backend_is_available(HL_BACKEND_CUDA);
  }
  Tally tallies[64];
  int ntallies = 0, findings = 0, total = 0;
  char err[16384];
  for (int ci = 0; ci < ncases; ++ci) {
    const Case *cs = cases[ci];
    if (!selected(cs, filter) || (fz_cuda && (cs->flags & CASE_CPU_ONLY))) continue;
    Tally *t = NULL;
    for (int i = 0; i < ntallies; ++i)
      if (!strcmp(tallies[i].entry, cs->entry)) t = &tallies[i];
    if (!t) {
      t = &tallies[ntallies++];
      memset(t, 0, sizeof *t);
      t->entry = cs->entry;
    }
    Outcome o;
    Mutation control;
    memset(&control, 0, sizeof control);
    snprintf(control.field, sizeof control.field, "(control)");
    control.tag = T_CONTROL;
    int control_ok = 1;
    for (Placement pl = PL_END; pl <= PL_START; ++pl) {
      snprintf(control.value, sizeof control.value, pl == PL_END ? "buffers against the back guard page"
                                                                 : "buffers against the front guard page");
      isolated(cs, &control, pl, &o, err, sizeof err);
      ++t->controls;
      if (report(cs, &control, &o, err, t)) control_ok = 0;
    }
    if (!control_ok) {
      printf("SKIP %s [%s]: the control failed; its mutations are not run\n", cs->entry, cs->label);
      continue;
    }
    static Call ctl;
    memset(&ctl, 0, sizeof ctl);
    ctl.cs = cs;
    ctl.cuda = fz_cuda;
    ctl.backend = fz_cuda ? HL_BACKEND_CUDA : HL_BACKEND_CPU;
    cs->declare(&ctl); /* the control as the generator sees it (a CPU backend call makes no CUDA call) */
    if (cs->prepare) cs->prepare(&ctl);
    Gen g;
    gen_case(&g, cs, &ctl);
    call_free(&ctl);
    int n = 0;
    for (int i = 0; i < g.n; ++i)
      if ((!field || strstr(g.v[i].field, field)) && !listed(skip, g.v[i].field)) g.v[n++] = g.v[i];
    const int step = max > 0 && n > max ? (n + max - 1) / max : 1;
    for (int i = 0; i < n && max; i += step) {
      const Mutation *m = &g.v[i];
      isolated(cs, m, (i / step) % 2 ? PL_START : PL_END, &o, err, sizeof err);
      ++t->mutations;
      ++total;
      if (report(cs, m, &o, err, t)) continue;
      t->refused += m->tag == T_FAIL || ((m->tag != T_FAULT && m->tag != T_CONTROL) && o.status > 0);
      t->matched += (m->tag == T_MATCH || m->tag == T_ALIGN || m->tag == T_INPLACE) && o.status == 0;
      t->faulted += o.faulted;
      if (fz_verbose)
        printf("ok %s [%s] %s = %s (%s): %s%s%s\n", cs->entry, cs->label, m->field, m->value, tag_name(m->tag),
               o.faulted ? "faulted" : status_name(o.status), o.msg[0] ? ": " : "", o.msg);
    }
    free(g.v);
  }
  printf("\n%-44s %8s %9s %8s %8s %8s %8s\n", "entry point", "controls", "mutations", "refused", "matched", "faulted",
         "findings");
  for (int i = 0; i < ntallies; ++i) {
    const Tally *t = &tallies[i];
    printf("%-44s %8d %9d %8d %8d %8d %8d\n", t->entry, t->controls, t->mutations, t->refused, t->matched, t->faulted,
           t->findings);
    findings += t->findings;
  }
  printf("test_fuzz (%s backend): %d mutations, %d findings\n", fz_cuda ? "CUDA" : "CPU", total, findings);
  return findings ? 1 : 0;
}
