"""headloss.integrations.torchtitan against torch.distributed.tensor.parallel.loss_parallel() with
F.cross_entropy on the same DTensor logits [4, 8, V] placed Shard(-1) on a mesh of two CPU ranks (gloo),
V even and uneven (67: shards of 34 and 33), -100 labels among them:
- fp32, reductions "mean", "sum" and "none" (an upstream per-token gradient): the loss within 1e-6 (1e-5
  on GPUs, NCCL) of
  the largest, a replicated DTensor; the logits' gradient within 1e-6, placed Shard(-1) as theirs;
- bf16 logits against loss_parallel on their fp32 copy (torchtitan's pred.float()): the loss within a
  bf16 rounding, the gradient within a bf16 unit in the last place; torchtitan's cross_entropy_loss
  (fp32 sum) within 1e-6;
- linear_cross_entropy, the lm_head weight [V, 16] placed Shard(0) (hidden a plain tensor and a
  replicated DTensor), against F.cross_entropy of hidden @ weight.T: the loss within 1e-6, hidden's
  gradient within 1e-6 of its largest, the weight's placed Shard(0) and within as much;
- a plain tensor (the whole vocabulary) against F.cross_entropy, and the refusals."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor", reason="torch.distributed.tensor (DTensor) is not available")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import headloss  # noqa: E402
from headloss.integrations.torchtitan import cross_entropy, cross_entropy_loss, linear_cross_entropy  # noqa: E402
from spawn_ranks import run_ranks  # noqa: E402

B, S = 4, 8


def _inputs(V, dtype, device="cpu"):
    g = torch.Generator().manual_seed(V)
    full = (torch.randn(B, S, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = -100
    labels[2, 5] = -100
    up = torch.randn(B, S, generator=g)
    return full.to(device), labels.to(device), up.to(device)


def _backward(loss, up, reduction):
    """loss.backward(), or of sum(up * loss) for per-token losses (up replicated on the mesh)."""
    from torch.distributed.tensor import DTensor, Replicate
    if reduction == "none":
        loss = (loss * DTensor.from_local(up, loss.device_mesh, [Replicate()])).sum()
    loss.backward()


def _theirs(d, labels, up, reduction, upcast):
    """loss_parallel's loss and the logits' gradient (a DTensor) on F.cross_entropy over [B S, V]."""
    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel():
        x = d.float() if upcast else d
        loss = F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction=reduction)
        loss = loss.view(B, S) if reduction == "none" else loss
        _backward(loss, up, reduction)
    return loss, d.grad


def _ours(d, labels, up, reduction):
    loss = cross_entropy(d, labels, reduction=reduction)
    _backward(loss, up, reduction)
    return loss, d.grad


def _max_err(a, b):
    return float((a.full_tensor().detach().double() - b.full_tensor().detach().double()).abs().max())


def _compare(rank, ranks, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh(device, (ranks,))
    tol = 1e-6 if device == "cpu" else 1e-5  # fp64 inside on the CPU backend, fp32 on a GPU

    def dt(full):
        return distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()

    for V in (64, 67):
        full, labels, up = _inputs(V, torch.float32, device)
        for reduction in ("mean", "sum", "none"):
            loss, grad = _ours(dt(full), labels, up, reduction)
            ref, ref_grad = _theirs(dt(full), labels, up, reduction, upcast=False)
            assert loss.placements == (Replicate(),) and loss.shape == ref.shape and loss.dtype == ref.dtype
            assert _max_err(loss, ref) <= tol * float(ref.full_tensor().detach().abs().max()), (V, reduction)
            assert grad.placements == ref_grad.placements == (Shard(2),)
            assert _max_err(grad, ref_grad) <= 1e-6, (V, reduction)
            if reduction == "none":
                assert float(loss.full_tensor().detach()[0, :3].abs().max()) == 0.0
                assert float(grad.full_tensor().detach()[0, :3].abs().max()) == 0.0

        full, labels, up = _inputs(V, torch.bfloat16, device)
        loss, grad = _ours(dt(full), labels, up, "mean")
        ref, ref_grad = _theirs(dt(full), labels, up, "mean", upcast=True)
        assert loss.dtype == grad.dtype == torch.bfloat16 and grad.placements == (Shard(2),)
        assert _max_err(loss, ref) <= 2 ** -8 * float(ref.full_tensor().detach().abs())
        ours_g, theirs_g = grad.full_tensor().detach().double(), ref_grad.full_tensor().detach().double()
        assert bool(((ours_g - theirs_g).abs() <= 2 ** -7 * theirs_g.abs() + 1e-30).all())

        # torchtitan's function: pred [T, V] placed Shard(1), the fp32 sum, no upcast copy.
        d = distribute_tensor(full.flatten(0, 1), mesh, [Shard(1)]).requires_grad_()
        loss = cross_entropy_loss(d, labels.flatten(), global_vocab_size=V)
        loss.backward()
        ref, ref_grad = _theirs(dt(full), labels, up, "sum", upcast=True)
        assert loss.dtype == torch.float32 and loss.placements == (Replicate(),)
        assert _max_err(loss, ref) <= tol * float(ref.full_tensor().detach().abs())
        theirs_g = ref_grad.full_tensor().detach().double().flatten(0, 1)
        assert bool(((d.grad.full_tensor().detach().double() - theirs_g).abs() <= 2 ** -7 * theirs_g.abs() + 1e-30).all())

    with pytest.raises(headloss.HeadlossValueError, match="Shard"):
        cross_entropy(distribute_tensor(full, mesh, [Replicate()]), labels)
    _linear(mesh, device)


def _linear(mesh, device):
    """linear_cross_entropy with the weight placed Shard(0), hidden plain or replicated."""
    tol = 1e-6 if device == "cpu" else 1e-5
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    for V in (64, 67):
        _, labels, up = _inputs(V, torch.float32, device)
        g = torch.Generator().manual_seed(1)
        h, w = torch.randn(B, S, 16, generator=g).to(device), torch.randn(V, 16, generator=g).to(device)
        for replicated in (False, True):
            for reduction in ("mean", "none"):
                hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
                ref = F.cross_entropy((hr @ wr.T).flatten(0, 1), labels.flatten(), reduction=reduction)
                ref = ref.view(B, S) if reduction == "none" else ref
                (ref * up if reduction == "none" else ref).sum().backward()
                hd = distribute_tensor(h, mesh, [Replicate()]) if replicated else h.clone()
                hd.requires_grad_()
                wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
                loss = linear_cross_entropy(hd, wd, labels, reduction=reduction)
                _backward(loss, up, reduction)
                what = (V, replicated, reduction)
                assert loss.placements == (Replicate(),) and loss.shape == ref.shape, what
                assert float((loss.full_tensor().detach() - ref.detach()).abs().max()) <= tol * float(ref.abs().max()), what
                gh = hd.grad.full_tensor() if replicated else hd.grad
                assert float((gh - hr.grad).abs().max()) <= tol * float(hr.grad.abs().max()), what
                assert wd.grad.placements == (Shard(0),), what
                assert float((wd.grad.full_tensor() - wr.grad).abs().max()) <= tol * float(wr.grad.abs().max()), what
    with pytest.raises(headloss.HeadlossValueError, match="Shard"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Replicate()]), labels)


def test_against_loss_parallel_on_two_cpu_ranks():
    run_ranks(_compare, 2)


def test_against_loss_parallel_on_two_gpus():
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    run_ranks(_compare, 2, "cuda", backend="nccl")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_plain_tensor_is_the_whole_vocabulary(reduction):
    full, labels, up = _inputs(50, torch.float32)
    x, ref_x = full.clone().requires_grad_(), full.clone().requires_grad_()
    loss = cross_entropy(x, labels, reduction=reduction)
    ref = F.cross_entropy(ref_x.flatten(0, 1), labels.flatten(), reduction=reduction)
    ref = ref.view(B, S) if reduction == "none" else ref
    assert loss.shape == ref.shape and torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    (loss * up).sum().backward()
    (ref * up).sum().backward()
    assert torch.allclose(x.grad, ref_x.grad, rtol=0, atol=1e-6)


def test_refusals():
    full, labels, _ = _inputs(50, torch.float32)
    with pytest.raises(headloss.HeadlossValueError, match="reduction"):
        cross_entropy(full, labels, reduction="batchmean")
    with pytest.raises(headloss.HeadlossValueError, match="without its mesh"):
        cross_entropy_loss(full.flatten(0, 1), labels.flatten(), global_vocab_size=100)
