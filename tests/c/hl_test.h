/* Shared bits for the cmocka tests: the cmocka includes and status assertions that print the
 * library's message when they fail. */
#ifndef HL_TEST_H_
#define HL_TEST_H_

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "headloss.h"

#define assert_ok(expr)                                                                   \
  do {                                                                                    \
    hl_status_t st_ = (expr);                                                             \
    if (st_ != HL_STATUS_SUCCESS) fail_msg("%s -> %d: %s", #expr, (int)st_, hl_get_last_error()); \
  } while (0)

/* The message of a failed call `expr` ("hl_x(...)"): it starts with the entry point's name and
 * ": " (headloss.h's contract) and contains `needle`. */
static inline void hl_check_message(const char *expr, const char *needle) {
  const char *msg = hl_get_last_error(), *paren = strchr(expr, '(');
  const size_t n = paren ? (size_t)(paren - expr) : 0;
  if (!n || strncmp(msg, expr, n) != 0 || strncmp(msg + n, ": ", 2) != 0)
    fail_msg("%s: message \"%s\" does not start with the entry point's name", expr, msg);
  if (!strstr(msg, needle)) fail_msg("%s: message \"%s\" lacks \"%s\"", expr, msg, needle);
}

/* expr, a call of an entry point, must fail with `status` and a message as hl_check_message's. */
#define assert_fails(expr, status, needle)                                                \
  do {                                                                                    \
    hl_status_t st_ = (expr);                                                             \
    if (st_ != (status))                                                                  \
      fail_msg("%s -> %d, expected %d (%s)", #expr, (int)st_, (int)(status), hl_get_last_error()); \
    hl_check_message(#expr, (needle));                                                    \
  } while (0)

/* A descriptor's size or stride (int64) or enumeration (int), by byte offset. */
typedef struct {
  size_t at, width;
  const char *name;
} HlField;
#define HL_FIELD(T, f) {offsetof(T, f), sizeof(((T *)0)->f), #f}

/* The field set to v; an enumeration as its integer, whatever value its C type would let through. */
static inline void hl_set_field(void *desc, HlField f, int64_t v) {
  const int i = (int)v;
  memcpy((char *)desc + f.at, f.width == sizeof v ? (const void *)&v : (const void *)&i, f.width);
}

/* A size query's answer (st, *bytes preset to 7) with field f set to the bad value v: refused
 * naming f, nothing written. */
static inline void hl_check_query_refused(const char *fn, hl_status_t st, size_t bytes, HlField f, int64_t v) {
  if (st != HL_STATUS_INVALID_VALUE || bytes != 7 || !strstr(hl_get_last_error(), f.name))
    fail_msg("%s with %s = %lld -> %d, %zu bytes (%s)", fn, f.name, (long long)v, (int)st, bytes,
             hl_get_last_error());
}

/* For each field and each value out of its range (sizes past HL_MAX_EXTENT or negative, enum
 * values outside their type): call(ctx, field, value), a call of the entry point `fn` with that
 * field set, must fail INVALID_VALUE naming the field; untouched(ctx) then checks its outputs. */
static inline void hl_check_bad_fields(const char *fn, const HlField *fields, size_t n, void *ctx,
                                       hl_status_t (*call)(void *, HlField, int64_t), int (*untouched)(void *)) {
  static const int64_t sizes[] = {INT64_MAX, (int64_t)1 << 48, (int64_t)1 << 61, -1, INT64_MIN};
  static const int64_t enums[] = {99, -1};
  char expr[128];
  snprintf(expr, sizeof expr, "%s()", fn);
  for (size_t i = 0; i < n; ++i) {
    const int is_size = fields[i].width == sizeof(int64_t);
    for (size_t v = 0; v < (is_size ? 5u : 2u); ++v) {
      const int64_t value = is_size ? sizes[v] : enums[v];
      const hl_status_t st = call(ctx, fields[i], value);
      if (st != HL_STATUS_INVALID_VALUE)
        fail_msg("%s with %s = %lld -> %d (%s)", fn, fields[i].name, (long long)value, (int)st, hl_get_last_error());
      hl_check_message(expr, fields[i].name);
      if (!untouched(ctx)) fail_msg("%s with %s = %lld wrote an output", fn, fields[i].name, (long long)value);
    }
  }
}

#endif
