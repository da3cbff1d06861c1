"""CE + a dense divergence with gradient (bf16 student and teacher logits) at N x V, ours alone:
the median of CUDA-event timings, one line a shape and divergence; "unaligned": the teacher's rows
at an odd stride (not 16-byte aligned: the kernels without bulk copies). Uses the Direct runner of
whichever bench/ is on PYTHONPATH, so the same script times an older tree (tree_ab.sh).
Usage: python3 distill_time.py 8192x128256 [...]"""
import sys

import torch
from bench_loss import Direct
from common import median_ms

for shape in sys.argv[1:]:
    N, V = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    wide = (torch.randn(N, V + 1, device="cuda") * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda")
    for name in ("fwd", "rev", "jsd"):
        for layout, u, stride in (("", wide[:, :V].contiguous(), V), (" unaligned", wide, V + 1)):
            run = Direct(x, y, ("ce", f"distill_{name}"), {"teacher_logits": u},
                         **({"jsd_beta": 0.5} if name == "jsd" else {}))
            run.args.teacher_stride = stride
            print(f"{shape} {name}{layout}: {median_ms(run, iters=30):.4f} ms", flush=True)
            del run
    del x, wide
    torch.cuda.empty_cache()
