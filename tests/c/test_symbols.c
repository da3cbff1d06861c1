/* The shared library exports hl_*, gdn_* and rmsnorm_* and nothing else. */
#include <stdlib.h>

#include "hl_test.h"

static void only_public_prefixes_are_exported(void **state) {
  (void)state;
  FILE *p = popen("nm -D --defined-only " HL_LIBRARY_PATH, "r");
  if (!p) skip();
  char line[512];
  int checked = 0, public_fns = 0;
  while (fgets(line, sizeof line, p)) {
    char addr[64], type[8], name[400];
    if (sscanf(line, "%63s %7s %399s", addr, type, name) != 3) continue;
    if (type[0] == 'A') continue; /* version-script nodes such as HEADLOSS_0 */
    ++checked;
    const int ok = !strncmp(name, "hl_", 3) || !strncmp(name, "gdn_", 4) || !strncmp(name, "rmsnorm_", 8);
    if (!ok) fail_msg("unexpected exported symbol: %s", name);
    public_fns += !strcmp(name, "rmsnorm_fwd") || !strcmp(name, "hl_get_version");
  }
  const int rc = pclose(p);
  if (rc != 0 && checked == 0) skip(); /* no nm on this machine */
  assert_int_equal(public_fns, 2);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(only_public_prefixes_are_exported)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
