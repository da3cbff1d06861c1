"""pytest plugin: fla's own tests with headloss.fla_backend enabled, counting per test the
chunk_bwd_dqkwg calls headloss took and those it left to fla (with the reason).
On the GPU machine, from a copy of fla's tests/ (not in this repository), with fla-core installed:
  PYTHONPATH=<repo>/bench/experiments:<repo>/python:$PYTHONPATH \\
    python3 -m pytest -p fla_dropin tests/ops/test_gdn.py -k chunk
FLA_DROPIN_ONE_CONFIG=1 gives every Triton autotuner its first config alone: fla's tests compile
each kernel once instead of autotuning it (on the H100, two of fla's GDN tests took 150 s otherwise).
"""
import collections
import os

import headloss.fla_backend as fb

_calls = collections.defaultdict(collections.Counter)  # test -> "headloss" / reason refused -> calls
_test = ["(collection)"]


def pytest_configure(config):
    if os.environ.get("FLA_DROPIN_ONE_CONFIG") == "1":
        import triton.runtime.autotuner as at
        init = at.Autotuner.__init__

        def first_config(self, fn, arg_names, configs, *args, **kwargs):
            init(self, fn, arg_names, configs[:1], *args, **kwargs)

        at.Autotuner.__init__ = first_config
    takes = fb.takes

    def counting(*args, **kwargs):
        ok, why = takes(*args, **kwargs)
        _calls[_test[0]]["headloss" if ok else f"fla: {why}"] += 1
        return ok, why

    fb.takes = counting  # the backend's verifier looks it up at each call
    fb.enable()


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    w = terminalreporter.write_line
    total = collections.Counter()
    for test, c in sorted(_calls.items()):
        total.update(c)
        w(f"fla_dropin {test}: " + ", ".join(f"{k} x{n}" for k, n in sorted(c.items())))
    w("fla_dropin total chunk_bwd_dqkwg calls: " + ", ".join(f"{k} x{n}" for k, n in sorted(total.items())))
