"""headloss.integrations.megatron against Megatron-core's own loss (megatron-core from PyPI; skipped
without it), tensor parallelism 2 on two CPU ranks (gloo, the CPU backend) and on two GPUs (NCCL)
where present:
- a GPTModel's compute_language_model_loss on Megatron's unfused (vocab_parallel_cross_entropy) and
  native fused paths against the switch, fp32 and bf16 logits: per-token losses [b, s] within 1e-6
  (1e-5 on GPUs), the gradient of sum g * loss for an upstream per-token g (0 where a loss mask
  would be) within 1e-6 of the largest for fp32 from the unfused path, a bf16 unit in the last
  place otherwise (the fused path rounds its gradient to bf16);
- z-loss through the options; Megatron's label_smoothing against Megatron at tp = 1;
- the fused output layer (apply_headloss(model, fused_output_layer=True)): a GPTModel's per-token
  losses and every parameter's gradient against the stock model's, fp32 (sequence parallelism is not
  covered: the local layer spec refuses it, and Transformer Engine's needs a GPU build);
- a GPTModel trains four steps with the switch off, on, and on with the fused output layer: the same
  loss curve (1e-5).
Megatron's model code runs on CPU ranks with two shims in the workers (tests only):
torch.cuda.current_device -> "cpu" (its global memory buffer) and a no-op RNG-tracker fork (no
dropout here)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import headloss  # noqa: E402
from spawn_ranks import run_ranks  # noqa: E402

S, B, V, H = 16, 2, 256, 64


def _megatron(device: str):
    """Megatron's parallel state for tp = the world, and a 2-layer GPTModel (local layer spec)."""
    import contextlib
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"
        mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    else:
        mrandom.model_parallel_cuda_manual_seed(1234)
    return parallel_state


def _gpt(device: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=torch.distributed.get_world_size(),
                            attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            masked_softmax_fusion=False, persist_layer_norm=False)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                    max_sequence_length=S).to(device)


def _inputs(rank, ranks, dtype, device):
    """This rank's logits shard [s, b, V / tp] of common logits, labels [b, s], upstream g [b, s]."""
    g = torch.Generator().manual_seed(5)
    full = (torch.randn(S, B, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    up = torch.randn(B, S, generator=g) * (torch.rand(B, S, generator=g) > 0.2)
    n = V // ranks
    return (full.to(device), full[..., rank * n:(rank + 1) * n].contiguous().to(device), labels.to(device),
            up.to(device))


def _loss_and_grad(model, logits, labels, up):
    x = logits.clone().requires_grad_(True)  # Megatron's fp32 paths overwrite their input
    loss = model.compute_language_model_loss(labels, x)
    (loss * up).sum().backward()
    return loss.detach(), x.grad


def _close(ours, theirs, tol, bf16):
    ours, theirs = ours.double(), theirs.double()
    if bf16:
        return bool(((ours - theirs).abs() <= 2 ** -7 * theirs.abs() + 1e-30).all())
    return float((ours - theirs).abs().max()) <= tol * float(theirs.abs().max())


def _loss_level(rank, ranks, device):
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as theirs_ce
    from headloss.integrations.megatron import apply_headloss, remove_headloss, vocab_parallel_cross_entropy
    model, tol = _gpt(device), 1e-6 if device == "cpu" else 1e-5
    for dtype in (torch.float32, torch.bfloat16):
        full, x, labels, up = _inputs(rank, ranks, dtype, device)
        for fused in (False, True):
            model.config.cross_entropy_loss_fusion, model.config.cross_entropy_fusion_impl = fused, "native"
            theirs = _loss_and_grad(model, x, labels, up)
            apply_headloss(model)
            ours = _loss_and_grad(model, x, labels, up)
            remove_headloss(model)
            what = f"rank {rank}, {dtype}, {'fused' if fused else 'unfused'}"
            assert ours[0].shape == (B, S) and ours[0].dtype == torch.float32, what
            assert _close(ours[0], theirs[0], tol, False), f"{what}: losses"
            assert ours[1].dtype == dtype, what
            assert _close(ours[1], theirs[1], tol, fused or dtype == torch.bfloat16), f"{what}: gradient"
    # z-loss through the options: Megatron's CE plus z_weight lse^2 of the whole row.
    full, x, labels, up = _inputs(rank, ranks, torch.float32, device)
    apply_headloss(model, terms=("ce", "z"), z_weight=1e-2)
    with_z = model.compute_language_model_loss(labels, x)
    remove_headloss(model)
    lse = torch.logsumexp(full.double(), -1).transpose(0, 1)
    assert _close(with_z, model.compute_language_model_loss(labels, x.clone()) + 1e-2 * lse ** 2, tol, False)
    # label smoothing: Megatron's alpha at tp = 1 (its tp > 1 means are per shard).
    single = [torch.distributed.new_group([r]) for r in range(ranks)][rank]
    ys = labels.transpose(0, 1).contiguous()
    ours = vocab_parallel_cross_entropy(x, ys, label_smoothing=0.1)
    assert _close(ours, theirs_ce(full.clone(), ys, label_smoothing=0.1, tp_group=single), tol, False)


def _batch(device):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, V, (B, S + 1), generator=g).to(device)
    mask = (torch.rand(B, S, generator=g) > 0.1).float().to(device)
    pos = torch.arange(S, device=device).expand(B, S)
    causal = torch.ones(B, 1, S, S, dtype=torch.bool, device=device).tril().logical_not()
    return ids, mask, pos, causal


def _fused_output_layer(rank, ranks, device):
    import headloss.integrations.megatron as switch
    calls, linear = [], switch.linear_token_loss
    switch.linear_token_loss = lambda *a, **k: calls.append(a[0].shape) or linear(*a, **k)
    ids, mask, pos, causal = _batch(device)
    up = torch.randn(B, S, generator=torch.Generator().manual_seed(3)).to(device) * mask
    tol = 1e-6 if device == "cpu" else 1e-5
    runs = []
    for fused in (False, True):
        model = _gpt(device)
        if fused:
            switch.apply_headloss(model, fused_output_layer=True)
        losses = model(ids[:, :-1], pos, causal, labels=ids[:, 1:])
        assert len(calls) == fused, calls  # hidden states [s, b, H], not logits
        calls.clear()
        (losses * up).sum().backward()
        runs.append((losses.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (stock, stock_g), (ours, ours_g) = runs
    assert ours.shape == (B, S) and _close(ours, stock, tol, False), f"rank {rank}: losses"
    for k, g in stock_g.items():
        assert _close(ours_g[k], g, 10 * tol, False), f"rank {rank}: {k}'s gradient"
    switch.linear_token_loss = linear


def _training(rank, ranks, device):
    from headloss.integrations.megatron import apply_headloss
    ids, mask, pos, causal = _batch(device)
    curves = []
    for switch in (None, {}, dict(fused_output_layer=True)):
        model = _gpt(device)
        if switch is not None:
            apply_headloss(model, **switch)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        curve = []
        for _ in range(4):
            opt.zero_grad()
            losses = model(ids[:, :-1], pos, causal, labels=ids[:, 1:])  # [b, s]
            loss = (losses * mask).sum() / mask.sum()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    stock, *ours = map(torch.tensor, curves)
    assert stock[-1] < stock[0], curves  # it trains
    assert all(torch.allclose(c, stock, rtol=1e-5) for c in ours), curves


def _both(rank, ranks, device):
    _megatron(device)
    _loss_level(rank, ranks, device)
    _fused_output_layer(rank, ranks, device)
    _training(rank, ranks, device)


def test_two_cpu_ranks():
    if torch.cuda.is_available():  # the current_device shim would send torch.compile to a GPU named "cpu"
        pytest.skip("a GPU machine: test_two_gpus runs the same on GPUs")
    run_ranks(_both, 2, "cpu")


def test_two_gpus():
    if not headloss.cuda_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    run_ranks(_both, 2, "cuda", backend="nccl")


def test_a_model_without_a_language_module_is_refused():
    from headloss.integrations.megatron import apply_headloss
    with pytest.raises(headloss.HeadlossError, match="no Megatron-core LanguageModule"):
        apply_headloss(torch.nn.Linear(2, 2))
