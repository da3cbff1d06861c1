"""headloss.integrations.liger: Liger's fused linear cross-entropy (module and function) on headloss,
against an fp64 PyTorch reference of Liger 0.8.5's semantics (its loss, z_loss, token accuracy,
predicted tokens and the gradients w.r.t. input, weight and bias) for every reduction and option,
in fp32, fp16 and bf16, with ragged row counts and ignored rows; the refusals; and, where a GPU
and liger_kernel are both present, against Liger itself."""
import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import headloss  # noqa: E402
from headloss import HeadlossError  # noqa: E402
from headloss.integrations import liger as hl_liger  # noqa: E402

V, H, IGNORE = 37, 24, -100
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def inputs(rows, dtype, device="cpu", seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (rows,), generator=g)
    y[::4] = IGNORE
    cw = torch.rand(V, generator=g) + 0.5
    return [t if t is None else t.to(device) for t in (x, w, b, y, cw)]


def reference(x, w, y, b=None, ce_weight=None, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
              softcap=None, use_token_scaling=False, upstream=None):
    """Liger's outputs in fp64 from the same (rounded) inputs, and the gradients of its loss
    (times `upstream` per token with reduction "none")."""
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    bd = None if b is None else b.detach().double().requires_grad_()
    z = xd @ wd.T + (0 if bd is None else bd)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = y != IGNORE
    ys = torch.where(valid, y, 0)
    lse = z.logsumexp(-1)
    zy = z.gather(1, ys[:, None])[:, 0]
    ce = (1 - label_smoothing) * (lse - zy) + label_smoothing * (lse - z.mean(-1))
    cw = torch.ones(V, dtype=torch.float64) if ce_weight is None else ce_weight.double()
    ce = ce * cw[ys]
    zl = lse_square_scale * lse * lse
    if use_token_scaling:
        s = (zy - lse).exp().detach()
        ce, zl = ce * s, zl * s
    ce, zl = torch.where(valid, ce, 0.0), torch.where(valid, zl, 0.0)
    n = valid.sum()
    if reduction == "mean":
        loss = ce.sum() / (cw[ys] * valid).sum() + zl.sum() / n
        z_loss = zl.sum() / n
    elif reduction == "sum":
        loss, z_loss = ce.sum() + zl.sum(), zl.sum()
    else:
        loss, z_loss = ce + zl, zl
    top = torch.where(valid, z.argmax(-1), -1)
    acc = ((top == y) & valid).double()
    accuracy = acc if reduction == "none" else acc.sum() / n
    (loss if reduction != "none" else (loss * upstream.double()).sum()).backward()
    grads = (xd.grad, wd.grad, None if bd is None else bd.grad)
    return loss.detach(), z_loss.detach(), accuracy, top, grads


def close(got, want, tol, what):
    got, want = got.double().cpu(), want.double().cpu()
    scale = max(want.abs().max().item(), 1e-3)
    err = (got - want).abs().max().item() / scale
    assert err <= tol, f"{what}: max error {err:.2e} of {scale:.2e} > {tol:.0e}"


OPTIONS = [dict(), dict(lse_square_scale=1e-2), dict(label_smoothing=0.1), dict(softcap=5.0),
           dict(use_token_scaling=True), dict(use_token_scaling=True, lse_square_scale=1e-3),
           dict(ce_weight=True), dict(ce_weight=True, use_token_scaling=True), dict(bias=False)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "ce")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_against_reference(reduction, opts, dtype):
    opts = dict(opts)
    use_bias = opts.pop("bias", True)
    x, w, b, y, cw = inputs(13, dtype, bias=use_bias)  # 13: ragged against any chunking
    cw = cw if opts.pop("ce_weight", False) else None
    leaves = [t.clone().requires_grad_() for t in (x, w)] + [None if b is None else b.clone().requires_grad_()]
    up = torch.linspace(-1.0, 2.0, x.shape[0])
    out = hl_liger.liger_fused_linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], cw, IGNORE,
                                                    reduction=reduction, return_z_loss=True,
                                                    return_token_accuracy=True, return_predicted_tokens=True,
                                                    **opts)
    (out.loss if reduction != "none" else (out.loss * up).sum()).backward()
    loss, z_loss, acc, top, grads = reference(x, w, y, b, cw, reduction=reduction, upstream=up, **opts)
    tol = TOL[dtype]
    close(out.loss, loss, 1e-5 if dtype == torch.float32 else 1e-4, "loss")
    close(out.z_loss, z_loss, tol, "z_loss")
    close(out.token_accuracy, acc, 1e-6, "token_accuracy")
    assert torch.equal(out.predicted_tokens, top), "predicted_tokens"
    for name, leaf, want in zip(("input", "weight", "bias"), leaves, grads):
        if leaf is not None:
            assert leaf.grad.dtype == leaf.dtype
            close(leaf.grad, want, tol, f"grad {name}")


def test_module_and_plain_loss():
    x, w, b, y, _ = inputs(9, torch.float32)
    x.requires_grad_()
    loss_fn = hl_liger.LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-3)
    loss = loss_fn(w, x, y, b)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    loss.backward()
    want, _, _, _, (gx, _, _) = reference(x, w, y, b, lse_square_scale=1e-3)
    close(loss, want, 1e-5, "loss")
    close(x.grad, gx, 1e-5, "grad input")


def test_incoming_gradient_and_accum_dtype():
    x, w, b, y, _ = inputs(11, torch.bfloat16)
    w.requires_grad_(), b.requires_grad_()
    loss = hl_liger.liger_fused_linear_cross_entropy(x, w, y, b, accum_dtype=torch.float32)
    (3 * loss).backward()
    _, _, _, _, (_, gw, gb) = reference(x, w, y, b)
    close(w.grad, 3 * gw, TOL[torch.bfloat16], "grad weight")
    close(b.grad, 3 * gb, TOL[torch.bfloat16], "grad bias")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(ce_weight=True, label_smoothing=0.1), "ce_weight with label_smoothing"),
    (dict(ce_weight=True, lse_square_scale=1e-4), "ce_weight with label_smoothing or lse_square_scale"),
    (dict(reduction="batchmean"), "reduction is 'batchmean'"),
    (dict(accum_dtype=torch.float64), "accum_dtype is torch.float64"),
    (dict(label_smoothing=1.0), "label_smoothing"),
])
def test_refusals(kwargs, needle):
    x, w, b, y, cw = inputs(5, torch.float32)
    if kwargs.pop("ce_weight", False):
        kwargs["ce_weight"] = cw
    with pytest.raises(HeadlossError, match=needle):
        hl_liger.liger_fused_linear_cross_entropy(x, w, y, b, **kwargs)


def test_token_scaling_needs_only_ce_and_z():
    with pytest.raises(HeadlossError, match="HL_LOSS_TOKEN_SCALING"):
        headloss.LinearLossPlan(V, H, "float32", terms=("ce", "entropy"), entropy_weight=-1e-3, token_scaling=True)


def _liger_on_gpu():
    if not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU (PyTorch CUDA and the library's CUDA backend are both needed)")
    return pytest.importorskip("liger_kernel.transformers.functional", reason="liger_kernel is not installed")


@pytest.mark.parametrize("reduction, opts", list(itertools.product(
    ["mean", "sum", "none"], [dict(), dict(lse_square_scale=1e-4, use_token_scaling=True), dict(ce_weight=True),
                              dict(label_smoothing=0.1, softcap=30.0)])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_against_liger(reduction, opts, dtype):
    lf = _liger_on_gpu()
    opts = dict(opts)
    x, w, b, y, cw = inputs(1000, dtype, "cuda")
    cw = cw if opts.pop("ce_weight", False) else None
    outs, grads = [], []
    for fn in (lf.liger_fused_linear_cross_entropy, hl_liger.liger_fused_linear_cross_entropy):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*leaves[:2], y, leaves[2], cw, IGNORE, reduction=reduction, return_z_loss=True,
                 return_token_accuracy=True, return_predicted_tokens=True, **opts)
        (out.loss.float().sum()).backward()
        outs.append(out)
        grads.append([t.grad for t in leaves])
    tol = TOL[dtype] * 3
    close(outs[1].loss, outs[0].loss, tol, "loss")
    close(outs[1].z_loss, outs[0].z_loss, tol, "z_loss")
    close(outs[1].token_accuracy, outs[0].token_accuracy, 0.01, "token_accuracy")
    assert (outs[1].predicted_tokens == outs[0].predicted_tokens).float().mean() > 0.99
    for name, g1, g0 in zip(("input", "weight", "bias"), grads[1], grads[0]):
        close(g1, g0, tol, f"grad {name}")


def test_apply_liger():
    """apply_liger puts the drop-ins into Liger's modules (remove_liger takes them out); ImportError
    where Liger is not installed."""
    try:
        import liger_kernel.transformers as lt
        import liger_kernel.transformers.functional as lf
    except ImportError:
        with pytest.raises(ImportError):
            hl_liger.apply_liger()
        return
    theirs = lt.LigerFusedLinearCrossEntropyLoss, lf.liger_fused_linear_cross_entropy
    hl_liger.apply_liger()
    try:
        assert lt.LigerFusedLinearCrossEntropyLoss is hl_liger.LigerFusedLinearCrossEntropyLoss
        assert lf.liger_fused_linear_cross_entropy is hl_liger.liger_fused_linear_cross_entropy
    finally:
        hl_liger.remove_liger()
    assert (lt.LigerFusedLinearCrossEntropyLoss, lf.liger_fused_linear_cross_entropy) == theirs
