"""Per-token losses with a per-token backward (headloss.torch_token_loss) against PyTorch in fp64:
CE with label smoothing, z-loss and the entropy bonus per token, ignored rows (loss 0, gradient 0),
the gradient of sum_t g_t loss_t for a random upstream g. Whole, and sharded over two ranks
(gloo on the CPU backend; NCCL where there are two GPUs), equal shards by default and uneven ones
given. Losses within 1e-6 (1e-5 on a GPU), gradients within as much of the largest (fp32 logits) or
half a bf16 unit in the last place (bf16 logits: g times the gradient formed in fp32, rounded once)."""
import pytest

torch = pytest.importorskip("torch")

import headloss  # noqa: E402
from headloss.torch_token_loss import linear_token_loss, token_loss  # noqa: E402
from spawn_ranks import run_ranks  # noqa: E402

S, B, V, H = 7, 3, 300, 24
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
        assert ((grad.double() - want).abs() <= 2 ** -8 * want.abs() * (1 + 1e-3) + 1e-30).all()
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
    """Every case, equal and uneven shards, logits and the fused linear form, on this rank (one
    spawn: a process costs seconds)."""
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
                h, w = linear_inputs(dtype)
                hs, ws = h.to(device).requires_grad_(True), w[lo:hi].to(device).requires_grad_(True)
                # uneven: the least workspace (chunks; the logits formed again in the backward);
                # even: the default, which on a GPU holds these rows' logits from the forward on
                cap = dict(max_workspace_bytes=0) if uneven else {}
                loss = linear_token_loss(hs, ws, y.to(device), group=dist.group.WORLD, **shard, **cap, **OPTS[case])
                (loss * up.to(device)).sum().backward(retain_graph=True)
                check_linear(loss, hs.grad, ws.grad, h, w, y, up, OPTS[case], dtype, device, slice(lo, hi))
                first = hs.grad.clone(), ws.grad.clone()
                hs.grad = ws.grad = None
                (loss * up.to(device)).sum().backward()  # the kept logits were overwritten: formed again
                assert torch.equal(first[0], hs.grad) and torch.equal(first[1], ws.grad)


def test_two_cpu_ranks():
    run_ranks(_sharded, 2, "cpu", (torch.float32, torch.bfloat16))


def test_two_gpus():
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    run_ranks(_sharded, 2, "cuda", (torch.float32, torch.bfloat16), backend="nccl")


def linear_inputs(dtype, device="cpu"):
    """hidden [S, B, H] and weight [V, H] whose logits are about as large as inputs()'."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(S, B, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 3 / H ** 0.5).to(dtype)
    return h.to(device), w.to(device)


def check_linear(loss, gh, gw, h, w, y, up, opts, dtype, device, rows=slice(None)):
    """Against the fp64 logits h w^T: losses 1e-6 (1e-5 on a GPU); fp32 gradients as much of the
    largest, bf16 ones 2 % of it (the logits themselves are rounded to bf16 between the products)."""
    hd, wd = h.double().cpu(), w.double().cpu()
    ref, z = reference(hd @ wd.T, y.cpu(), opts)
    tol = 1e-6 if device == "cpu" else 1e-5
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    lt = tol if dtype == torch.float32 and device == "cpu" else 2e-2
    assert torch.allclose(loss.cpu().double(), ref.detach(), rtol=lt, atol=lt)
    (ref * up.cpu().double()).sum().backward()
    dz = z.grad.reshape(-1, V)
    gt = tol if dtype == torch.float32 else 2e-2
    for got, want in ((gh, (dz @ wd).view(h.shape)), (gw, (dz.T @ hd.reshape(-1, H))[rows])):
        assert got.dtype == dtype
        assert (got.cpu().double() - want).abs().max() <= gt * want.abs().max()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(OPTS))
def test_linear_whole_vocabulary(case, dtype, device):
    _, y, up = inputs(dtype, device)
    h, w = linear_inputs(dtype, device)
    hs, ws = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = linear_token_loss(hs, ws, y, max_workspace_bytes=0, **OPTS[case])  # the least: chunks of rows
    (loss * up).sum().backward()
    check_linear(loss, hs.grad, ws.grad, h, w, y, up, OPTS[case], dtype, device)


def test_backward_twice_and_no_grad_option():
    """The backward forms the gradient from the kept logits: retain_graph gives it again, bit for
    bit; a forward with no gradient wanted forms none."""
    x, y, up = inputs(torch.float32)
    xs = x.requires_grad_(True)
    loss = (token_loss(xs, y) * up).sum()
    loss.backward(retain_graph=True)
    first = xs.grad.clone()
    xs.grad = None
    loss.backward()
    assert torch.equal(first, xs.grad)
    with torch.no_grad():
        assert torch.equal(token_loss(xs, y), token_loss(x.detach(), y))
    with pytest.raises(headloss.HeadlossError, match="no grad option"):
        token_loss(xs, y, grad=None)
