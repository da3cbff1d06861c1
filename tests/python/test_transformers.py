"""headloss.integrations.transformers against the stock Hugging Face models (transformers 5.17 on
the GPU machine): each RMSNorm kind alone, then tiny random-config causal LMs of every supported
type, stock and patched from the same weights, one training step: the loss and every parameter's
gradient (fp32: equal to 1e-4; bf16: as close to an fp32 run as the stock bf16 model is, or within
bf16 rounding), -100 labels and num_items_in_batch included; the eval / no-label path and
remove_headloss; and on the GPU the peak memory of a step against the stock model's. CPU tensors
run the CPU backend. Skips without torch or transformers (CI installs neither)."""
import copy
import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import headloss  # noqa: E402
from headloss.integrations.transformers import NORMS, apply_headloss, remove_headloss  # noqa: E402

# model type -> config overrides: small soft-cap / logit scaling so that they change the loss.
MODELS = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "olmo2": {},
          "gemma": {"head_dim": 16}, "gemma2": {"head_dim": 16, "final_logit_softcapping": 2.0},
          "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 2.0}, "granite": {"logits_scaling": 4.0}}
# The module each norm class lives in (transformers.models.<m>.modeling_<m>).
NORM_MODULES = {name: name[: -len("RMSNorm")].lower().replace("moe", "_moe").replace("next", "_next")
                for name in NORMS}


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() and headloss.cuda_available():
        out.append("cuda")
    return out


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param not in devices():
        pytest.skip("no GPU, or the library's CUDA backend is unavailable")
    return request.param


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.mark.parametrize("name", sorted(NORMS))
def test_each_norm_matches_its_hf_module(name, device):
    try:
        mod = importlib.import_module(f"transformers.models.{NORM_MODULES[name]}.modeling_{NORM_MODULES[name]}")
    except ImportError:
        pytest.skip(f"{name}: not in this transformers version")
    cls = getattr(mod, name)
    torch.manual_seed(len(name))
    kinds = [{}] + ([{"with_scale": False}] if name == "Gemma3nRMSNorm" else [])
    for dtype in ([torch.float32] + ([torch.bfloat16] if device == "cuda" else [])):
        for kw in kinds:
            stock = cls(64, eps=1e-6, **kw).to(device)
            if getattr(stock, "weight", None) is not None:
                with torch.no_grad():
                    stock.weight.copy_(torch.randn(64) * 0.5 + (0 if NORMS[name][1] else 1))
            stock = stock.to(dtype)
            ours = apply_headloss(torch.nn.Sequential(copy.deepcopy(stock)), loss=False)
            x = (torch.randn(3, 5, 64, device=device) * 3).to(dtype)
            dy = torch.randn(3, 5, 64, device=device).to(dtype)
            got = []
            for m in (stock, ours):
                xi = x.clone().requires_grad_()
                y = m(xi)
                y.backward(dy.to(y.dtype))
                w = getattr(m, "weight", None) if m is stock else getattr(m[0], "weight", None)
                got.append((y, xi.grad, None if w is None else w.grad))
            what = f"{name} {dtype} {kw}"
            assert got[0][0].dtype == got[1][0].dtype, what
            tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: a rounding here and there
            for a, b in zip(got[1], got[0]):
                if b is not None:
                    assert rel(a, b) <= tol, (what, rel(a, b))


def tiny(model_type, vocab, device, dtype, layers=2, hidden=64, seed=0):
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, **MODELS[model_type])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norm weights away from their init (Gemma's start at 0)
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(device=device, dtype=dtype).train()


def batch(vocab, device, b=3, t=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < 0.2] = -100  # masked tokens
    labels[0, :7] = -100                                  # a masked prompt
    return ids.to(device), labels.to(device)


def step(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, float(out.loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_training_step_matches_stock(model_type, device):
    vocab = 512
    ids, labels = batch(vocab, device)
    kws = [{}, {"num_items_in_batch": torch.tensor(int((labels[:, 1:] >= 0).sum()) + 5, device=device)}]
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        stock = tiny(model_type, vocab, device, dtype)
        ours = apply_headloss(copy.deepcopy(stock))
        ref = copy.deepcopy(stock).float()  # the same (rounded) weights, in fp32
        for kw in kws:
            what = f"{model_type} {dtype} {list(kw)}"
            out_o, loss_o, g_o = step(ours, ids, labels, **kw)
            _, loss_s, g_s = step(stock, ids, labels, **kw)
            assert out_o.logits is None, what  # a training step with labels skips the logits
            if dtype == torch.float32:
                assert abs(loss_o - loss_s) <= 1e-5 * abs(loss_s), (what, loss_o, loss_s)
                for n in g_s:
                    assert rel(g_o[n], g_s[n]) <= 1e-4, (what, n, rel(g_o[n], g_s[n]))
                continue
            _, loss_r, g_r = step(ref, ids, labels, **kw)
            assert abs(loss_o - loss_r) <= max(2 * abs(loss_s - loss_r), 4e-3 * abs(loss_r)), (
                what, loss_o, loss_s, loss_r)
            for n in g_r:
                e_o, e_s = rel(g_o[n].float(), g_r[n]), rel(g_s[n].float(), g_r[n])
                assert e_o <= max(2 * e_s, 8e-3), (what, n, e_o, e_s)


def test_eval_and_remove(device):
    vocab = 512
    ids, labels = batch(vocab, device)
    stock = tiny("gemma2", vocab, device, torch.float32).eval()
    ours = apply_headloss(copy.deepcopy(stock)).eval()
    assert apply_headloss(ours) is ours  # twice: no second layer of patches
    with torch.no_grad():
        a, b = stock(input_ids=ids, labels=labels), ours(input_ids=ids, labels=labels)
        assert rel(b.logits, a.logits) <= 1e-5 and abs(float(b.loss) - float(a.loss)) <= 1e-5 * float(a.loss)
        t = ours(input_ids=ids, return_dict=False)
        assert isinstance(t, tuple) and rel(t[0], a.logits) <= 1e-5
        remove_headloss(ours)
        assert not any("forward" in m.__dict__ for m in ours.modules())
        assert torch.equal(ours(input_ids=ids).logits, stock(input_ids=ids).logits)
    with pytest.raises(ValueError, match="loss=False swaps the norms alone"):
        apply_headloss(ours.model)  # the decoder alone has no LM head


def test_peak_memory_below_stock():
    if "cuda" not in devices():
        pytest.skip("no GPU, or the library's CUDA backend is unavailable")
    vocab, device = 32000, "cuda"
    ids, labels = batch(vocab, device, b=4, t=1024)
    peaks, losses = [], []
    for patch in (False, True):
        model = tiny("llama", vocab, device, torch.bfloat16, hidden=256)
        if patch:
            apply_headloss(model)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        losses.append(float(loss.detach()))
        del model, loss
    print(f"peak memory of a step, llama {vocab} vocab, 4096 tokens: stock {peaks[0] / 2**20:.0f} MiB, "
          f"headloss {peaks[1] / 2**20:.0f} MiB; loss {losses[0]:.5f} / {losses[1]:.5f}")
    assert abs(losses[1] - losses[0]) <= 4e-3 * losses[0], losses
    assert peaks[1] < 0.75 * peaks[0], peaks
