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

#endif
