"""CE + gradient (bf16, the loss plan's fast path) at N x V, ours alone: the median of CUDA-event
timings, one line a shape. Uses the Direct runner of whichever bench/ is on PYTHONPATH, so the same
script times an older tree (tree_ab.sh). Usage: python3 ce_time.py 8192x128256 [65536x32000 ...]"""
import sys

import torch
from bench_loss import Direct
from common import median_ms

for shape in sys.argv[1:]:
    N, V = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    run = Direct(logits, labels, ("ce",))
    print(f"{shape}: {median_ms(run, iters=100):.4f} ms", flush=True)
    del run, logits
    torch.cuda.empty_cache()
