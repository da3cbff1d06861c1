"""headloss.torch_tokens: per-token log-probs, entropies and log-sum-exps as torch custom ops with a
backward, against fp64 PyTorch autograd of log_softmax (both forms, every dtype, a temperature, a
soft cap, ignored rows, outputs left unused), no_grad forwards, and torch.compile(fullgraph=True)
keeping each op whole. CPU tensors run on the CPU backend; CUDA tensors on the GPU (skipped
without one)."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import headloss  # noqa: E402
from headloss import HeadlossValueError  # noqa: E402
from headloss.torch_tokens import linear_token_logprobs, token_logprobs  # noqa: E402

N, H, V = 29, 32, 301
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _device(name):
    if name == "cuda" and not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU (PyTorch CUDA and the library's CUDA backend are both needed)")
    return torch.device(name)


def reference(z, labels, temperature=1.0, softcap=None):
    """(logp, entropy, lse) of fp64 logits z, by autograd-able PyTorch ops."""
    z = z / temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lp = torch.log_softmax(z, -1)
    valid = labels >= 0
    logp = torch.where(valid, lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    return logp, -(lp.exp() * lp).sum(-1), torch.logsumexp(z, -1)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-30))


def inputs(dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dev, dtype)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 2).to(dev, dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[::4] = -100
    up = [torch.randn(N, generator=g).to(dev) for _ in range(3)]
    return x, w, y.to(dev), up


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1,)])
def test_linear_matches_autograd(dev, dtype, used):
    """grad_hidden and grad_weight against fp64 autograd through X W^T (the reference logits
    rounded to dtype on CUDA, as its 16-bit path stores them between the products); outputs not
    used by the loss give no gradient."""
    dev = _device(dev)
    x, w, y, up = inputs(dev, dtype)
    x.requires_grad_(), w.requires_grad_()
    out = linear_token_logprobs(x, w, y, temperature=0.8)
    sum(out[i].mul(up[i]).sum() for i in used).backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = xd @ wd.T
    if dev.type == "cuda" and dtype != torch.float32:
        z = z + (z.detach().to(dtype).double() - z.detach())  # the stored rounding, no gradient
    ref = reference(z, y, 0.8)
    for got, want in zip(out, ref):
        assert rel(got.detach(), want.detach()) < TOL[dtype]
    sum(ref[i].mul(up[i].double()).sum() for i in used).backward()
    assert rel(x.grad, xd.grad) < 2 * TOL[dtype]
    assert rel(w.grad, wd.grad) < 2 * TOL[dtype]


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_matches_autograd(dev, dtype):
    dev = _device(dev)
    x, w, y, up = inputs(dev, dtype, 1)
    z = (x @ w.T).detach().reshape(N, V).requires_grad_()
    out = token_logprobs(z.reshape(1, N, V), y.reshape(1, N), temperature=1.3, softcap=6.0)
    assert out.logp.shape == (1, N)
    sum(t.reshape(N).mul(u).sum() for t, u in zip(out, up)).backward()
    zd = z.detach().double().requires_grad_()
    ref = reference(zd, y, 1.3, 6.0)
    sum(t.mul(u.double()).sum() for t, u in zip(ref, up)).backward()
    for got, want in zip(out, ref):
        assert rel(got.detach().reshape(N), want.detach()) < 1e-5
    assert rel(z.grad, zd.grad) < TOL[dtype]


def test_no_grad_and_no_labels():
    """Under no_grad the forward alone (the old / reference log-probs call); without labels logp
    is 0 and only entropy and lse have gradients."""
    x, w, y, up = inputs("cpu", torch.float32)
    with torch.no_grad():
        out = linear_token_logprobs(x, w, y)
    assert out.logp.grad_fn is None and not out.logp.requires_grad
    ref = reference(x.double() @ w.double().T, y)
    assert rel(out.logp, ref[0]) < 1e-6
    x.requires_grad_()
    out = linear_token_logprobs(x, w)
    assert float(out.logp.detach().abs().max()) == 0.0
    (out.logp.sum() + out.entropy.sum()).backward()
    xd = x.detach().double().requires_grad_()
    reference(xd @ w.double().T, torch.full((N,), -1))[1].sum().backward()
    assert rel(x.grad, xd.grad) < 1e-5


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_compile_fullgraph(dev):
    """torch.compile(fullgraph=True) keeps headloss::linear_token_logprobs as one call, and the
    compiled step's outputs and gradients are the eager ones."""
    dev = _device(dev)
    torch._dynamo.reset()
    x, w, y, up = inputs(dev, torch.float32, 2)
    x.requires_grad_(), w.requires_grad_()

    def step(x, w, y):
        logp, ent, _ = linear_token_logprobs(x, w, y, temperature=0.9)
        return (logp * up[0]).sum() - 0.01 * ent.mean()

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(step, backend=record, fullgraph=True)(x, w, y)
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = (torch.ops.headloss.linear_token_logprobs, torch.ops.headloss.linear_token_logprobs.default)
    assert sum(c in ops for c in calls) == 1, calls
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    loss_c = torch.compile(step, backend=backend, fullgraph=True)(x, w, y)
    loss_c.backward()
    gc = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    loss_e = step(x, w, y)
    loss_e.backward()
    assert torch.allclose(loss_c, loss_e)
    assert torch.allclose(gc[0], x.grad) and torch.allclose(gc[1], w.grad)


def test_bad_input():
    x, w, y, _ = inputs("cpu", torch.float32)
    with pytest.raises(HeadlossValueError, match="temperature is 0"):
        token_logprobs(x @ w.T, y, temperature=0)
    with pytest.raises(HeadlossValueError, match="labels"):
        linear_token_logprobs(x, w, y[:-1])
