"""Runs a test's worker on simulated ranks, one process each (spawn start method), with
torch.distributed initialised: gloo on CPU ranks (the CPU backend, as CI runs it), NCCL with one GPU a
rank. worker(rank, ranks, *args) must be a module-level function of an importable module; an
exception on any rank fails the caller with that rank's message."""
import os
import sys
import tempfile
import traceback
from pathlib import Path


def _entry(rank, ranks, init, errors, backend, worker, args):
    try:
        import torch
        import torch.distributed as dist
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=ranks, **kw)
        worker(rank, ranks, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001  (reported by the parent)
        Path(errors, f"rank{rank}").write_text(traceback.format_exc())
        raise
    # Every rank is done: leave without tearing the group down, which in gloo (torch 2.11) aborts
    # now and then ("terminate called without an active exception") after a DTensor test.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, ranks: int, *args, backend: str = "gloo", timeout: float = 300) -> None:
    import torch.multiprocessing as mp
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, ranks, f"file://{tmp}/init", tmp, backend, worker, args))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:  # a rank stuck in a collective whose peer died
            if p.is_alive():
                p.kill()
        msgs = [f.read_text() for f in sorted(Path(tmp).glob("rank*"))]
        assert not msgs, "\n".join(msgs)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
