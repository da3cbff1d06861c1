"""Per-token losses with a per-token backward (headloss.torch_token_loss) against PyTorch in fp64:
CE with label smoothing, z-loss and the entropy bonus per token, ignored rows (loss 0, gradient 0),
the gradient of sum_t g_t loss_t for a random upstream g. Whole, and sharded over two ranks
(gloo on the CPU backend; NCCL where there are two GPUs), equal shards by default and uneven ones
given. Losses within 1e-6 (1e-5 on a GPU), gradients within as much of the largest (fp32 logits) or a
bf16 unit in the last place (bf16 logits: rounded twice, the gradient, then its product with g)."""
import pytest

torch = pytest.importorskip("torch")

import headloss  # noqa: E402
from headloss.torch_token_loss import token_loss  # noqa: E402
from spawn_ranks import run_ranks  # noqa: E402

S, B, V = 7, 3, 300
OPTS = {"ce": {}, "ce_z_entropy": dict(terms=("ce", "z", "entropy"), z_weight=1e-2, entropy_weight=-0.1,
                                       label_smoothing=0.1)}


def inputs(dtype, device="cpu"):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(S, B, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (S, B), generator=g)
    y[2, 1] = y[5, 0] = -100
    up = torch.randn(S, B, generator=g)
    up[0, 0] = 0.0
    return x.to(device), y.to(device), up.to(device)


def reference(x, y, opts):
    """Per-token losses and d(sum g loss)/dx in fp64 from the whole logits."""
    z = x.double().detach().requires_grad_(True)
    flat, lab = z.reshape(-1, V), y.reshape(-1)
    keep = lab >= 0
    ce = torch.nn.functional.cross_entropy(flat, lab.clamp(min=0), reduction="none",
                                           label_smoothing=opts.get("label_smoothing", 0.0))
    lse = torch.logsumexp(flat, -1)
    loss = ce
    if "z" in opts.get("terms", ()):
        loss = loss + opts["z_weight"] * lse ** 2
    if "entropy" in opts.get("terms", ()):
        p = torch.softmax(flat, -1)
        loss = loss + opts["entropy_weight"] * (lse - (p * flat).sum(-1))
    return torch.where(keep, loss, torch.zeros_like(loss)).view(y.shape), z


def check(loss, grad, ref, z, up, dtype, device, cols=slice(None)):
    """tol: 1e-6 on the CPU backend (fp64 inside), 1e-5 on a GPU (fp32, another merge order)."""
    tol = 1e-6 if device == "cpu" else 1e-5
    (ref * up.double()).sum().backward()
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert torch.allclose(loss.double(), ref.detach(), rtol=tol, atol=tol)
    want = z.grad[..., cols]
    if dtype == torch.float32:
        assert (grad.double() - want).abs().max() <= tol * want.abs().max()
    else:
        assert grad.dtype == dtype
        assert ((grad.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all()
    assert (grad[2, 1] == 0).all() and (grad[0, 0] == 0).all()


def devices():
    return ["cpu"] + (["cuda"] if headloss.cuda_available() and torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(OPTS))
def test_whole_vocabulary(case, dtype, device):
    x, y, up = inputs(dtype, device)
    xs = x.clone().requires_grad_(True)
    loss = token_loss(xs, y, **OPTS[case])
    (loss * up).sum().backward()
    ref, z = reference(x.cpu(), y.cpu(), OPTS[case])
    check(loss.cpu(), xs.grad.cpu(), ref, z, up.cpu(), dtype, device)


def _sharded(rank, ranks, device, dtypes):
    """Every case, equal and uneven shards, on this rank (one spawn: a process costs seconds)."""
    import torch.distributed as dist
    for case in OPTS:
        for dtype in dtypes:
            for uneven in (False, True):
                x, y, up = inputs(dtype)
                cut = 101 if uneven else V // 2
                lo, hi = (0, cut) if rank == 0 else (cut, V)
                xs = x[..., lo:hi].contiguous().to(device).requires_grad_(True)
                shard = dict(vocab_start=lo, vocab_global=V) if uneven else {}
                loss = token_loss(xs, y.to(device), group=dist.group.WORLD, **shard, **OPTS[case])
                (loss * up.to(device)).sum().backward()
                ref, z = reference(x, y, OPTS[case])
                check(loss.cpu(), xs.grad.cpu(), ref, z, up, dtype, device, slice(lo, hi))


def test_two_cpu_ranks():
    run_ranks(_sharded, 2, "cpu", (torch.float32, torch.bfloat16))


def test_two_gpus():
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    run_ranks(_sharded, 2, "cuda", (torch.float32, torch.bfloat16), backend="nccl")


def test_the_gradient_is_handed_over_once():
    x, y, _ = inputs(torch.float32)
    xs = x.requires_grad_(True)
    loss = token_loss(xs, y).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    with pytest.raises(headloss.HeadlossError, match="always writes its gradient"):
        token_loss(xs, y, grad=None)
