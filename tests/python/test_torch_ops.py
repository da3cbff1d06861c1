"""The PyTorch custom ops (headloss.torch_ops): forward and autograd against plain-PyTorch
references (CPU tensors run on the CPU backend; CUDA tensors on the GPU), the torch.library op
checks, and torch.compile (aot_eager on the CPU, inductor on the GPU)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import headloss  # noqa: E402
from headloss.torch_ops import LMHeadLoss, RMSNorm, lm_head_loss, rmsnorm  # noqa: E402

EPS = 1e-5
DEVICES = ["cpu", "cuda"]


def _device(name):
    if name == "cuda" and not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU (PyTorch CUDA and the library's CUDA backend are both needed)")
    return torch.device(name)


def ref_rmsnorm(x, w, r=None, offset=0.0):
    s = x if r is None else x + r
    sf = s.float()
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)
    if w is not None:
        y = y * (offset + w.float())
    return y, s


def _leaves(dev, dtype, shape=(3, 5, 96), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dev, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dev, dtype).requires_grad_()
    r = torch.randn(shape, generator=g).to(dev, dtype).requires_grad_()
    return x, w, r


def _grads(fn, leaves):
    for t in leaves:
        t.grad = None
    fn().backward()
    return [t.grad.float().clone() for t in leaves]


def _close(a, b, tol):
    a, b = a.float(), b.float()
    err = (a - b).norm() / b.norm().clamp_min(1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_autograd(dev, dtype, fused):
    dev, dt = _device(dev), getattr(torch, dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    x, w, r = _leaves(dev, dt)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dev)

    def ours():
        if fused:
            y, s = rmsnorm(x, w, eps=EPS, residual=r)
            return (y.float() * dy).sum() + s.float().sin().sum()
        return (rmsnorm(x, w, eps=EPS).float() * dy).sum()

    def theirs():
        y, s = ref_rmsnorm(x, w, r if fused else None)
        return (y * dy).sum() + (s.float().sin().sum() if fused else 0)

    leaves = [x, w, r] if fused else [x, w]
    for a, b in zip(_grads(ours, leaves), _grads(theirs, leaves)):
        _close(a, b, tol)
    with torch.no_grad():
        _close(rmsnorm(x, w, eps=EPS), ref_rmsnorm(x, w)[0], tol)


def test_rmsnorm_expanded_grad_and_no_weight():
    x = torch.randn(4, 33, requires_grad=True)
    rmsnorm(x, None, eps=EPS).sum().backward()  # dy arrives expanded (stride 0)
    g = x.grad.clone()
    x.grad = None
    ref_rmsnorm(x, None)[0].sum().backward()
    _close(g, x.grad, 1e-5)


def test_rmsnorm_module_gemma():
    m = RMSNorm(64, eps=EPS, offset=1.0, cast="gemma")
    assert torch.count_nonzero(m.weight) == 0 and "gemma" in repr(m)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 7, 64)
    _close(m(x), ref_rmsnorm(x, m.weight.detach(), offset=1.0)[0], 1e-5)
    y, s = m(x, residual=x)
    _close(s, 2 * x, 0)
    assert RMSNorm(8, elementwise_affine=False).weight is None


def test_rmsnorm_opcheck():
    x, w, r = (t.detach() for t in _leaves("cpu", torch.float32, (4, 32)))
    for args in [(x, w, None, EPS, 0.0, 0, None, True), (x, w, r, EPS, 0.0, 1, torch.float16, False),
                 (x, None, None, EPS, 0.0, 2, None, True)]:
        torch.library.opcheck(torch.ops.headloss.rmsnorm_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    rstd = torch.rand(4) + 0.5
    torch.library.opcheck(torch.ops.headloss.rmsnorm_bwd.default,
                          (torch.randn(4, 32), x, w, rstd, None, EPS, 0.0, 0),
                          test_utils=("test_schema", "test_faketensor"))


def ref_loss(z, labels, z_weight):
    lse = torch.logsumexp(z.float(), -1)
    ce = lse - z.float().gather(-1, labels[:, None])[:, 0]
    return ce.mean() + z_weight * (lse * lse).mean()


@pytest.mark.parametrize("dev", DEVICES)
def test_loss_autograd(dev):
    dev = _device(dev)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(16, 300, generator=g).to(dev).requires_grad_()
    labels = torch.randint(0, 300, (16,), generator=g).to(dev)
    loss, metrics = lm_head_loss(z, labels, terms=("ce", "z"), z_weight=1e-2)
    assert set(metrics) >= {"ce", "z", "accuracy", "lse_mean"} and not metrics["ce"].requires_grad
    (2.5 * loss).backward()
    ours = z.grad.clone()
    z.grad = None
    ref = ref_loss(z, labels, 1e-2)
    (2.5 * ref).backward()
    _close(loss.detach(), ref.detach(), 1e-5)
    _close(ours, z.grad, 1e-5)
    with torch.no_grad():  # no gradient asked for: the plan runs without one
        _close(LMHeadLoss(terms=("ce",))(z, labels)[0], ref_loss(z, labels, 0.0), 1e-5)
    # The gradient buffer is scaled in place and handed over: a second backward is refused, not
    # scaled twice.
    loss, _ = lm_head_loss(z, labels, terms=("ce",))
    (3.0 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ["sparse_rl", "jsd_ce"])
def test_loss_distill_autograd(dev, case):
    """A sparse teacher (ids and log-probs [2, 8, k]: leading dimensions flattened like the
    logits') and dense JSD through the custom op: loss and .grad against the fp64 reference."""
    from test_loss import build, rel, run_ref
    dev = _device(dev)
    terms, opts, inp = build(np.random.default_rng(4), 16, 300, "float32", case)
    want_sc, _, want_grad = run_ref(inp, terms, opts, grad_scale=1.5)
    t = {k: torch.from_numpy(v).to(dev) for k, v in inp.items()}
    z = t.pop("logits").view(2, 8, 300).requires_grad_()
    t = {k: v.view(2, 8, *v.shape[1:]) for k, v in t.items()}
    loss, metrics = lm_head_loss(z, t.pop("labels"), terms=terms, **t, **opts)
    (1.5 * loss).backward()
    assert abs(loss.item() - want_sc["loss"]) < 1e-4 * (1 + abs(want_sc["loss"]))
    assert abs(metrics["distill"].item() - want_sc["distill"]) < 1e-4
    assert rel(z.grad.reshape(16, 300).cpu().numpy().astype(np.float64), want_grad) < 1e-4


def test_loss_error_path():
    z = torch.randn(4, 10, requires_grad=True)
    with pytest.raises(headloss.HeadlossError, match="labels"):
        lm_head_loss(z, torch.tensor([0, 1, 2, 99]))


@pytest.mark.parametrize("dev", DEVICES)
def test_compile(dev):
    dev = _device(dev)
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    norm = RMSNorm(128, eps=EPS).to(dev)
    head = torch.nn.Linear(128, 200, bias=False).to(dev)

    def step(h, labels):
        y, s = norm(h, residual=h)
        loss, metrics = lm_head_loss(head(y), labels, terms=("ce", "z"), z_weight=1e-3)
        return loss, metrics["accuracy"]

    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 8, 128, generator=g).to(dev).requires_grad_()
    labels = torch.randint(0, 200, (16,), generator=g).to(dev)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    loss_c, _ = compiled(h.view(16, 128), labels)
    loss_c.backward()
    gc = [h.grad.clone(), norm.weight.grad.clone(), head.weight.grad.clone()]
    for t in (h, norm.weight, head.weight):
        t.grad = None
    loss_e, _ = step(h.view(16, 128), labels)
    loss_e.backward()
    _close(loss_c.detach(), loss_e.detach(), 1e-5)
    for a, b in zip(gc, [h.grad, norm.weight.grad, head.weight.grad]):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("dev", DEVICES)
def test_loss_sequence_options(dev):
    """lm_head_loss with GSPO and a rollout correction (rollout_logprobs, cu_seqlens: the custom
    op's new inputs) against the fp64 reference, under torch.compile too."""
    from test_loss import build, rel, run_ref
    dev = _device(dev)
    terms, opts, inp = build(np.random.default_rng(12), 24, 300, "float32", "gspo_all")
    want_sc, _, want_grad = run_ref(inp, terms, opts)
    t = {k: torch.from_numpy(v).to(dev) for k, v in inp.items()}
    z = t.pop("logits").requires_grad_()

    def step(z, t):
        loss, metrics = lm_head_loss(z, t["labels"], terms=terms, **{k: v for k, v in t.items() if k != "labels"},
                                     **opts)
        return loss, metrics["rollout_corrected"]

    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    for fn in (step, torch.compile(step, backend=backend, fullgraph=True)):
        z.grad = None
        loss, corrected = fn(z, t)
        loss.backward()
        assert abs(loss.item() - want_sc["loss"]) < 1e-4 * (1 + abs(want_sc["loss"]))
        assert abs(corrected.item() - want_sc["rollout_corrected"]) < 1e-6
        assert rel(z.grad.cpu().numpy().astype(np.float64), want_grad) < 1e-4
