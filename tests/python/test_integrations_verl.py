"""headloss.integrations.verl: the drop-in for verl's linear_cross_entropy.

verl's own kernel is Triton on CUDA only, and importing verl pulls Ray, tensordict and transformers,
so on the CPU the outputs and gradients are checked against fp64 PyTorch autograd of the math of
verl's torch path (log_softmax of logits / temperature gathered at the labels, entropy_from_logits)
and patch() against stand-in verl modules; test_against_verl_kernel compares with verl's kernel
itself where verl, Triton and a GPU are there (skipped otherwise). Skips without torch."""
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import headloss  # noqa: E402
from headloss import HeadlossValueError  # noqa: E402
from headloss.integrations import verl as hl_verl  # noqa: E402

B, T, H, V = 2, 11, 128, 301  # verl's kernel needs H % 128 == 0
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def inputs(dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).to(dev, dtype)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 2).to(dev, dtype)
    y = torch.randint(0, V, (B, T), generator=g).to(dev)
    return x.requires_grad_(), w.requires_grad_(), y


def reference(x, w, y, temperature):
    """verl's torch path in fp64: (logprobs, entropy) [tokens] of the flattened rows."""
    z = (x.reshape(-1, H).double() @ w.double().T) / temperature
    logp = torch.log_softmax(z, -1).gather(-1, y.reshape(-1, 1))[:, 0]
    p = torch.softmax(z, -1)
    return logp, torch.logsumexp(z, -1) - (p * z).sum(-1)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-30))


def grads_of(x, w, outs, up):
    x.grad = w.grad = None
    sum((o * u).sum() for o, u in zip(outs, up)).backward()
    return x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dev, dtype):
    """[B, T, H] hidden and [B, T] labels give flat fp32 [B * T] outputs, hidden's gradient in its
    shape and dtype; the values and gradients are the fp64 reference's."""
    if dev == "cuda" and not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU")
    x, w, y = inputs(dev, dtype)
    logp, ent = hl_verl.linear_cross_entropy(x, w, y, 0.7)
    assert logp.shape == ent.shape == (B * T,) and logp.dtype == ent.dtype == torch.float32
    up = torch.randn(2, B * T, generator=torch.Generator().manual_seed(1)).to(dev)
    gx, gw = grads_of(x, w, (logp, ent), up)
    assert gx.shape == x.shape and gx.dtype == gw.dtype == dtype
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref = reference(xd, wd, y, 0.7)
    for got, want in zip((logp, ent), ref):
        assert rel(got.detach(), want.detach()) < TOL[dtype]
    rx, rw = grads_of(xd, wd, ref, up.double())
    assert rel(gx, rx) < 2 * TOL[dtype] and rel(gw, rw) < 2 * TOL[dtype]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    """logprobs reduced to a 0-d tensor over every token (verl's mean divides by the tokens); the
    entropy stays per token; the gradient flows through the reduction."""
    x, w, y = inputs("cpu", torch.float32, 2)
    logp, ent = hl_verl.linear_cross_entropy(x, w, y, 1.0, reduction)
    per_token, _ = hl_verl.linear_cross_entropy(x, w, y)
    assert logp.shape == () and ent.shape == (B * T,)
    assert torch.allclose(logp, getattr(per_token, reduction)())
    gx, gw = grads_of(x, w, (logp,), (torch.tensor(1.0),))
    rx, rw = grads_of(x, w, (getattr(per_token, reduction)(),), (torch.tensor(1.0),))
    assert torch.allclose(gx, rx) and torch.allclose(gw, rw)
    with pytest.raises(HeadlossValueError, match="reduction"):
        hl_verl.linear_cross_entropy(x, w, y, 1.0, "avg")


@pytest.fixture
def fake_verl(monkeypatch):
    """Stand-ins for verl's kernel module and for a module that imported its function once (as
    Megatron's fused forward does); the stock function records its calls."""
    calls = []

    def stock(*args):
        calls.append(args)
        return "verl's"

    kernel = types.ModuleType(hl_verl._KERNEL)
    kernel.linear_cross_entropy = stock
    user = types.ModuleType("verl.models.mcore.model_forward_fused")
    user.linear_cross_entropy = stock
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, kernel.__name__, kernel)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    yield types.SimpleNamespace(stock=stock, kernel=kernel, user=user, calls=calls)
    hl_verl.unpatch()


def test_patch_and_unpatch(fake_verl, monkeypatch):
    """patch() swaps the function wherever verl's is held, twice is harmless, a call with a
    process group of several ranks goes to verl's; unpatch() restores verl's everywhere."""
    hl_verl.patch()
    hl_verl.patch()
    assert fake_verl.kernel.linear_cross_entropy is hl_verl.linear_cross_entropy
    assert fake_verl.user.linear_cross_entropy is hl_verl.linear_cross_entropy
    x, w, y = inputs("cpu", torch.float32)
    assert fake_verl.user.linear_cross_entropy(x, w, y)[1].shape == (B * T,)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    assert fake_verl.kernel.linear_cross_entropy(x, w, y, 1.0, "none", "group") == "verl's"
    assert fake_verl.calls == [(x, w, y, 1.0, "none", "group")]
    hl_verl.unpatch()
    assert fake_verl.kernel.linear_cross_entropy is fake_verl.stock
    assert fake_verl.user.linear_cross_entropy is fake_verl.stock
    with pytest.raises(NotImplementedError, match="patch"):
        hl_verl.linear_cross_entropy(x, w, y, 1.0, "none", "group")


def test_against_verl_kernel():
    """verl's own Triton kernel on the GPU (bf16): the outputs and both gradients."""
    if not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU")
    stock = pytest.importorskip(hl_verl._KERNEL, reason="verl (with its dependencies) is not installed")
    x, w, y = inputs("cuda", torch.bfloat16, 3)
    up = torch.randn(2, B * T, generator=torch.Generator().manual_seed(4)).cuda()
    ours = hl_verl.linear_cross_entropy(x, w, y, 0.9)
    theirs = stock.linear_cross_entropy(x, w, y, 0.9)
    for a, b in zip(ours, theirs):
        assert rel(a.detach(), b.detach().double()) < TOL[torch.bfloat16]
    for a, b in zip(grads_of(x, w, ours, up), grads_of(x, w, theirs, up)):
        assert rel(a, b.double()) < 2 * TOL[torch.bfloat16]
