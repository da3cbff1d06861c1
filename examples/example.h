/* What every example shares: a check of each headloss call that prints the status and the
 * library's message, then exits. */
#ifndef HEADLOSS_EXAMPLE_H_
#define HEADLOSS_EXAMPLE_H_

#include <stdio.h>
#include <stdlib.h>

#include "headloss.h"

#define CHECK_HL(call)                                                                          \
  do {                                                                                          \
    hl_status_t s_ = (call);                                                                    \
    if (s_ != HL_STATUS_SUCCESS) {                                                              \
      fprintf(stderr, "%s failed: %s\n  %s\n", #call, hl_get_error_string(s_), hl_get_last_error()); \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#endif
