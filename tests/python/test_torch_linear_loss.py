"""headloss.torch_ops.linear_loss (the fused linear form as a torch custom op) and
headloss.torch_loss.LinearLossFunction: loss, metrics and the gradients w.r.t. hidden and weight
against the fp64 reference of matmul + loss (test_linear_loss.reference_linear), finite
differences, which gradients are formed for each requires_grad combination, incoming gradients
other than 1, torch.compile(fullgraph=True), the workspace policy, autocast. CPU tensors run on the
CPU backend; CUDA tensors on the GPU (skipped without one)."""
import types
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import headloss  # noqa: E402
from headloss import torch_ops  # noqa: E402
from headloss.loss import SCALARS, LinearLossPlan  # noqa: E402
from headloss.torch_loss import LinearLossFunction, linear_workspace  # noqa: E402
from headloss.torch_ops import LinearLoss, LMHeadLinearLoss, linear_loss  # noqa: E402
from test_linear_loss import check, make, reference_linear  # noqa: E402

DEVICES = ["cpu", "cuda"]
PER_ROW = ("labels", "weights", "advantages", "old_logprobs", "ref_logprobs")


def _device(name):
    if name == "cuda" and not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU (PyTorch CUDA and the library's CUDA backend are both needed)")
    return torch.device(name)


def to_torch(x: np.ndarray, dev, requires_grad=False):
    if x.dtype.name == "bfloat16":  # torch cannot read ml_dtypes arrays: go through int16
        t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dev).requires_grad_(requires_grad)


def np64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def split(inp, dev, grads=(True, True)):
    """(hidden, weight, labels, keyword inputs) as torch tensors on dev."""
    t = {k: to_torch(v, dev) for k, v in inp.items()}
    x = t.pop("hidden").requires_grad_(grads[0])
    w = t.pop("weight").requires_grad_(grads[1])
    return x, w, t.pop("labels", None), t


def want_of(inp, terms, opts, scale=1.0, dev="cpu"):
    """The reference's (scalars, no tokens, grad_hidden, grad_weight), gradients times scale; dev:
    the backend that ran (CUDA stores 16-bit logits between the products)."""
    rsc, _, rgh, rgw = reference_linear(inp, terms, opts, torch.device(dev).type)
    return rsc, {}, scale * rgh, scale * rgw


def got_of(loss, metrics, x, w):
    sc = {k: float(v) for k, v in metrics.items()}
    assert float(loss.detach()) == sc["loss"]
    return (sc, {}, None if x.grad is None else np64(x.grad), None if w.grad is None else np64(w.grad))


def be_of(dev):
    return types.SimpleNamespace(name=dev.type)


CASES = ["ce", "ce_smooth_weights_cap", "z", "distill_fwd", "grpo_kl", "all", "gspo_all", "mis_seq_mean",
         "sparse_rl", "jsd_ce"]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_against_reference(dev, dtype, case):
    """Loss, every metric and both gradients (incoming gradient 1) against fp64 matmul + loss."""
    dev = _device(dev)
    rng = np.random.default_rng(zlib.crc32(f"torch-lin-{case}-{dtype}".encode()))
    terms, opts, inp = make(rng, 23, 40, 173, dtype, case)
    x, w, y, kw = split(inp, dev)
    loss, metrics = linear_loss(x, w, y, terms=terms, **kw, **opts)
    assert set(metrics) == set(SCALARS) and not any(m.requires_grad for m in metrics.values())
    assert loss.requires_grad and loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    check(be_of(dev), got_of(loss, metrics, x, w), want_of(inp, terms, opts, dev=dev), dtype)


@pytest.mark.parametrize("dev", DEVICES)
def test_fused_teacher_and_f32_grad_weight(dev):
    """Distillation from a teacher of its own (teacher_hidden / teacher_weight, no gradient), and
    grad_weight summed in fp32 then cast to the weight's dtype for autograd."""
    dev = _device(dev)
    rng = np.random.default_rng(3)
    terms, opts, inp = make(rng, 19, 32, 151, "bfloat16", "all", Ht=24)
    x, w, y, kw = split(inp, dev)
    kw["teacher_hidden"].requires_grad_()  # a teacher is not differentiated, even when it could be
    loss, metrics = linear_loss(x, w, y, terms=terms, grad_weight_dtype="float32", **kw, **opts)
    loss.backward()
    assert w.grad.dtype == torch.bfloat16 and kw["teacher_hidden"].grad is None
    check(be_of(dev), got_of(loss, metrics, x, w), want_of(inp, terms, opts, dev=dev), "bfloat16")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True), (False, False), "no_grad"])
def test_requires_grad_combinations(dev, grads, monkeypatch):
    """The plan forms exactly the gradients autograd needs (none under no_grad, or when neither
    input requires grad), and those it forms are right."""
    dev = _device(dev)
    rng = np.random.default_rng(zlib.crc32(str(grads).encode()))
    terms, opts, inp = make(rng, 17, 24, 97, "float32", "ce_smooth_weights_cap")
    x, w, y, kw = split(inp, dev, grads if grads != "no_grad" else (True, True))
    modes = []
    real = torch_ops.run_linear

    def spy(plan, *a):
        modes.append((plan.desc.grad_hidden_mode, plan.desc.grad_weight_mode))
        return real(plan, *a)

    monkeypatch.setattr(torch_ops, "run_linear", spy)
    if grads == "no_grad":
        with torch.no_grad():
            loss, metrics = linear_loss(x, w, y, terms=terms, **kw, **opts)
        grads = (False, False)
    else:
        loss, metrics = linear_loss(x, w, y, terms=terms, **kw, **opts)
    assert modes == [(int(grads[0]), int(grads[1]))]
    assert loss.requires_grad == any(grads)
    if any(grads):
        loss.backward()
    sc, _, gh, gw = got_of(loss, metrics, x, w)
    assert (gh is not None, gw is not None) == grads
    rsc, _, rgh, rgw = want_of(inp, terms, opts, dev=dev)
    check(be_of(dev), (sc, {}, gh, gw), (rsc, {}, rgh if grads[0] else None, rgw if grads[1] else None),
          "float32")


@pytest.mark.parametrize("dev", DEVICES)
def test_incoming_gradient(dev):
    """The saved gradients are scaled by the incoming one, a constant or a tensor computed on the
    device (loss * loss: 2 loss); a second backward through the graph is refused, not scaled twice."""
    dev = _device(dev)
    rng = np.random.default_rng(7)
    terms, opts, inp = make(rng, 21, 32, 131, "float32", "all")
    rsc = want_of(inp, terms, opts, dev=dev)[0]
    for f, scale in ((lambda l: 2.5 * l, 2.5), (lambda l: l * l, 2 * rsc["loss"]), (lambda l: -l / 3, -1 / 3)):
        x, w, y, kw = split(inp, dev)
        loss, metrics = linear_loss(x, w, y, terms=terms, **kw, **opts)
        f(loss).backward()
        check(be_of(dev), got_of(loss, metrics, x, w), want_of(inp, terms, opts, scale, dev), "float32")
    x, w, y, kw = split(inp, dev)
    loss, _ = linear_loss(x, w, y, terms=terms, **kw, **opts)
    (3.0 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_finite_differences():
    """d loss / d hidden and d loss / d weight against central differences of the op's own loss,
    every coordinate of a tiny case (fp32 inputs, fp64 arithmetic inside)."""
    g = torch.Generator().manual_seed(11)
    N, H, V = 5, 6, 11
    x = torch.randn(N, H, generator=g, requires_grad=True)
    w = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    y = torch.tensor([3, -100, 10, 0, 7])
    opts = dict(terms=("ce", "z", "entropy"), z_weight=0.1, entropy_weight=-0.2, label_smoothing=0.1,
                softcap=4.0)
    loss, _ = linear_loss(x, w, y, **opts)
    loss.backward()
    h = 2.0 ** -7
    for leaf in (x, w):
        fd = torch.zeros_like(leaf)
        flat = leaf.detach().view(-1)
        for i in range(flat.numel()):
            vals = []
            for step in (h, -h):
                p = flat.clone()
                p[i] += step
                args = (p.view_as(x), w.detach()) if leaf is x else (x.detach(), p.view_as(w))
                with torch.no_grad():
                    vals.append(float(linear_loss(*args, y, **opts)[0]))
            fd.view(-1)[i] = (vals[0] - vals[1]) / (2 * h)
        err = (leaf.grad - fd).norm() / fd.norm()
        assert err < 2e-3, f"relative error {err:.3g} against finite differences"


@pytest.mark.parametrize("dev", DEVICES)
def test_leading_dims_and_shifted_views(dev):
    """hidden [B, T, H] sliced for next-token prediction (hidden[:, :-1], labels[:, 1:]: neither
    collapses into rows without a copy) and a column slice of a wider weight (row stride > H)."""
    dev = _device(dev)
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 3, 9, 16, 77
    hs = torch.randn(B, T, H, generator=g).to(dev).requires_grad_()
    wide = torch.randn(V, H + 8, generator=g).to(dev).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    ids[0, 4] = -100
    loss, _ = linear_loss(hs[:, :-1], wide[:, :H], ids[:, 1:], terms=("ce", "z"), z_weight=1e-3)
    loss.backward()
    inp = {"hidden": np64(hs[:, :-1]).reshape(-1, H).astype(np.float32),
           "weight": np64(wide[:, :H]).astype(np.float32), "labels": ids[:, 1:].reshape(-1).cpu().numpy()}
    rsc, _, rgh, rgw = want_of(inp, ("ce", "z"), {"z_weight": 1e-3}, dev=dev)
    assert hs.grad.shape == hs.shape and float(hs.grad[:, -1].abs().max()) == 0
    sc = dict.fromkeys(SCALARS, 0.0)
    sc["loss"] = float(loss.detach())
    check(be_of(dev), (sc, {}, np64(hs.grad[:, :-1]).reshape(-1, H), np64(wide.grad[:, :H])),
          ({"loss": rsc["loss"]}, {}, rgh, rgw), "float32")
    assert float(wide.grad[:, H:].abs().max()) == 0


def test_dtypes_and_autocast():
    """hidden and weight must share a dtype, except under autocast, where both run in autocast's
    dtype (as F.linear would) and the gradients come back in the inputs' own dtypes."""
    rng = np.random.default_rng(2)
    terms, opts, inp = make(rng, 12, 16, 61, "float32", "ce")
    x, w, y, _ = split(inp, "cpu")
    with pytest.raises(TypeError, match="weight is torch.bfloat16 but hidden is torch.float32"):
        linear_loss(x, w.to(torch.bfloat16), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, metrics = linear_loss(x, w, y, terms=terms)
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    bf = {k: (v.astype(np.float32).astype(headloss_bf16()) if k in ("hidden", "weight") else v)
          for k, v in inp.items()}
    check(be_of(torch.device("cpu")), got_of(loss, metrics, x, w), want_of(bf, terms, opts), "bfloat16")


def headloss_bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def test_module_and_linear():
    """LinearLoss / LMHeadLinearLoss hold the options; the weight may be given as the nn.Linear."""
    assert LMHeadLinearLoss is LinearLoss
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(16, 50, bias=False)
    x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (2, 6), generator=g)
    m = LinearLoss(terms=("ce", "z"), z_weight=1e-3, grad_weight_dtype="float32")
    assert "z_weight=0.001" in repr(m)
    loss, metrics = m(x, head, y)
    loss.backward()
    gx, gw = x.grad.clone(), head.weight.grad.clone()
    x.grad = head.weight.grad = None
    loss2, _ = linear_loss(x, head.weight, y, terms=("ce", "z"), z_weight=1e-3)
    loss2.backward()
    assert float(loss.detach()) == float(loss2.detach())
    assert torch.allclose(gx, x.grad, rtol=1e-6, atol=0) and torch.allclose(gw, head.weight.grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="has a bias"):
        m(x, torch.nn.Linear(16, 50), y)


def test_errors_carry_the_library_message():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(20, 8)
    with pytest.raises(headloss.HeadlossError, match="labels"):
        linear_loss(x, w, torch.tensor([0, 1, 2, 99]))
    with pytest.raises(TypeError, match="unexpected keyword|zz_weight"):
        linear_loss(x, w, torch.tensor([0, 1, 2, 3]), zz_weight=1.0)


def test_plan_cache():
    """One plan per configuration: new data of the same shapes makes none."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (6,), generator=g)
    linear_loss(x, w, y, terms=("ce",), label_smoothing=0.25)
    n = torch_ops._linear_plan.cache_info().misses
    for i in range(3):
        linear_loss(x * (i + 2), w, y, terms=("ce",), label_smoothing=0.25)[0].backward()
    assert torch_ops._linear_plan.cache_info().misses == n
    linear_loss(x, w.requires_grad_(), y, terms=("ce",), label_smoothing=0.25)
    assert torch_ops._linear_plan.cache_info().misses == n + 1  # now with grad_weight


class _StubPlan:
    def __init__(self, lo, hi):
        self.sizes = (lo, hi)

    def workspace_sizes(self, rows):
        return self.sizes

    def workspace(self, like, rows, nbytes):
        return nbytes


@pytest.mark.parametrize("lo, hi, cap, want", [
    (100, 1000, None, 1000), (100, 1000, 500, 500), (100, 1000, 10, 100), (100, 1000, 5000, 1000),
    (100, 100, 0, 100), (0, 0, None, None), (0, 0, 64, None)])
def test_workspace_policy(lo, hi, cap, want):
    """fast_bytes by default, capped by max_workspace_bytes, never below min_bytes; none if 0."""
    assert linear_workspace(_StubPlan(lo, hi), None, 7, cap) == want


def test_opcheck():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=g), torch.randn(20, 8, generator=g)
    y = torch.tensor([1, 2, -100, 4, 19])
    opts = torch_ops._options_json(torch_ops._options_key(("ce", "z"), {"grad_weight_dtype": torch.float32}))
    for need in ((True, True), (True, False), (False, False)):
        args = (x, w, y, *(None,) * 11, opts, 0.0, *need, None)  # 11 optional inputs
        torch.library.opcheck(torch.ops.headloss.linear_loss.default, args,
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dev", DEVICES)
def test_compile_fullgraph(dev):
    """torch.compile(fullgraph=True) keeps headloss::linear_loss as one call in the graph, and the
    compiled step's loss and gradients are the eager ones."""
    dev = _device(dev)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    norm = torch_ops.RMSNorm(64, eps=1e-5).to(dev)
    head = torch.nn.Linear(64, 300, bias=False).to(dev)
    h = torch.randn(2, 8, 64, generator=g).to(dev).requires_grad_()
    labels = torch.randint(0, 300, (2, 8), generator=g).to(dev)

    def step(h, labels):
        y = norm(h)
        loss, metrics = linear_loss(y, head.weight, labels, terms=("ce", "z"), z_weight=1e-3,
                                    grad_weight_dtype="float32")
        return loss, metrics["accuracy"]

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(step, backend=record, fullgraph=True)(h, labels)
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = (torch.ops.headloss.linear_loss, torch.ops.headloss.linear_loss.default)
    assert sum(c in ops for c in calls) == 1, calls
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    loss_c, acc_c = compiled(h, labels)
    loss_c.backward()
    gc = [h.grad.clone(), norm.weight.grad.clone(), head.weight.grad.clone()]
    for t in (h, norm.weight, head.weight):
        t.grad = None
    loss_e, acc_e = step(h, labels)
    loss_e.backward()
    assert float(loss_c.detach()) == pytest.approx(float(loss_e.detach()), rel=1e-6) and float(acc_c) == float(acc_e)
    for a, b in zip(gc, [h.grad, norm.weight.grad, head.weight.grad]):
        assert ((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_loss_function_own_plan(dev):
    """LinearLossFunction with a plan of one's own (here fp32 gradients for bf16 inputs)."""
    dev = _device(dev)
    rng = np.random.default_rng(8)
    terms, opts, inp = make(rng, 15, 24, 89, "bfloat16", "grpo_kl")
    x, w, y, kw = split(inp, dev)
    plan = LinearLossPlan(89, 24, torch.bfloat16, device=dev.type, terms=terms, grad_hidden_dtype="float32",
                          grad_weight_dtype="float32", **opts)
    from headloss.torch_loss import LINEAR_INPUTS
    loss, scalars = LinearLossFunction.apply(x, w, y, plan, None, None, *(kw.get(k) for k in LINEAR_INPUTS))
    (0.5 * loss).backward()
    assert x.grad.dtype == torch.bfloat16 and not scalars.requires_grad
    check(be_of(dev), (dict(zip(SCALARS, np64(scalars))), {}, np64(x.grad), np64(w.grad)),
          want_of(inp, terms, opts, 0.5, dev), "bfloat16")


def test_fused_lm_head_loss_incoming_gradient():
    """torch_loss.FusedLMHeadLoss (the logits form's autograd.Function) scales its saved gradient
    in place too (no host synchronisation to test for 1)."""
    from headloss.torch_loss import FusedLMHeadLoss
    g = torch.Generator().manual_seed(12)
    z = torch.randn(9, 40, generator=g, requires_grad=True)
    y = torch.randint(0, 40, (9,), generator=g)
    loss, _ = FusedLMHeadLoss(terms=("ce",))(z, y)
    (-1.5 * loss).backward(retain_graph=True)
    ref = torch.nn.functional.cross_entropy(z.detach().requires_grad_(), y)
    zr = ref.detach()
    assert abs(float(loss.detach()) - float(zr)) < 1e-5
    zz = z.detach().requires_grad_()
    (-1.5 * torch.nn.functional.cross_entropy(zz, y)).backward()
    assert ((z.grad - zz.grad).norm() / zz.grad.norm()) < 1e-5
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_cuda_workspace_cap():
    """CUDA: a capped workspace (down to the plan's minimum: chunks of few rows) gives the
    reference's result too; the cap is honoured (the workspace passed is the capped size)."""
    dev = _device("cuda")
    rng = np.random.default_rng(13)
    terms, opts, inp = make(rng, 300, 128, 4099, "bfloat16", "all")
    plan = LinearLossPlan(4099, 128, torch.bfloat16, device="cuda", terms=terms, **opts)
    lo, hi = plan.workspace_sizes(300)
    assert 0 < lo < hi
    want = want_of(inp, terms, opts, dev=dev)
    for cap in (None, lo, (lo + hi) // 2):
        x, w, y, kw = split(inp, dev)
        loss, metrics = linear_loss(x, w, y, terms=terms, max_workspace_bytes=cap,
                                    grad_weight_dtype="float32", **kw, **opts)
        loss.backward()
        check(be_of(dev), got_of(loss, metrics, x, w), want, "bfloat16")
    ws = linear_workspace(plan, x, 300, lo)
    assert ws.numel() * ws.element_size() == (lo + 15) // 16 * 16


def test_cuda_second_device():
    """A tensor on a GPU other than the current one: the plan is made and run on the tensor's."""
    _device("cuda")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(14)
    terms, opts, inp = make(rng, 33, 64, 500, "bfloat16", "ce")
    x, w, y, kw = split(inp, torch.device("cuda:1"))
    with torch.cuda.device(0):
        loss, metrics = linear_loss(x, w, y, terms=terms, **opts)
        loss.backward()
    check(be_of(torch.device("cuda")), got_of(loss, metrics, x, w), want_of(inp, terms, opts, dev="cuda"), "bfloat16")


@pytest.mark.parametrize("form", ["custom op", "autograd.Function", "logits"])
def test_cuda_peak_memory_is_the_gradients(form):
    """CUDA: forward + backward through the PyTorch front ends holds the gradients once (autograd
    adopts the buffers formed in the forward as .grad, no copy) plus the workspace: the peak above
    the inputs is at most grad_hidden + grad_weight + the workspace (the logits form: its gradient)
    and a little (labels, scalars)."""
    _device("cuda")
    N, H, V, cap = 2048, 1024, 32000, 16 << 20
    g = torch.Generator(device="cuda").manual_seed(15)
    x = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.03).bfloat16().requires_grad_(True)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    z = (x.detach() @ w.detach().T).requires_grad_(True) if form == "logits" else None
    plan = LinearLossPlan(V, H, torch.bfloat16, device="cuda")
    ws = max(plan.workspace_sizes(N)[0], min(plan.workspace_bytes(N), cap))
    grads = z.numel() * 2 if form == "logits" else (x.numel() + w.numel()) * 2 + ws
    run = {"custom op": lambda: linear_loss(x, w, y, max_workspace_bytes=cap)[0],
           "autograd.Function": lambda: LinearLossFunction.apply(x, w, y, plan, None, cap)[0],
           "logits": lambda: torch_ops.lm_head_loss(z, y)[0]}[form]
    run().backward()  # warm-up: plans made, libraries loaded
    x.grad = w.grad = None
    if z is not None:
        z.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= grads + (4 << 20), f"{form}: peak {extra / 2**20:.1f} MiB above the inputs, bound {grads / 2**20:.1f}"
    kept = torch.cuda.memory_allocated() - base  # the .grad tensors alone remain
    assert kept <= grads - (0 if form == "logits" else ws) + (1 << 20)
