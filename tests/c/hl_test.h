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

/* expr must fail with `status` and a message containing `needle`. */
#define assert_fails(expr, status, needle)                                                \
  do {                                                                                    \
    hl_status_t st_ = (expr);                                                             \
    if (st_ != (status))                                                                  \
      fail_msg("%s -> %d, expected %d (%s)", #expr, (int)st_, (int)(status), hl_get_last_error()); \
    if (!strstr(hl_get_last_error(), (needle)))                                           \
      fail_msg("%s: message \"%s\" lacks \"%s\"", #expr, hl_get_last_error(), (needle));  \
  } while (0)

#endif
