"""A Hugging Face Llama training step (forward + backward) three ways in one run: stock transformers,
with headloss's one-line patch (integrations.transformers.apply_headloss: its RMSNorm and the fused
linear loss, the [tokens, vocab] logits never in memory) and with Liger's (when liger-kernel is
importable). Columns: median step time and peak device memory above the model's weights.

The model is small in layers and large in vocabulary, where the LM head dominates: 4 layers,
hidden 2048, vocabulary 128256 (Llama 3's), bf16 weights, batch x sequence tokens a step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import headloss  # noqa: E402
from common import header, median, timed_ms  # noqa: E402
from headloss.integrations.transformers import apply_headloss, remove_headloss  # noqa: E402


def make_model(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 256,
                      vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()


def measure(model, ids, labels, iters: int):
    """(median step ms, peak GiB above the weights) of loss.backward() steps."""
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return median([timed_ms(step) for _ in range(iters)]), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    model = make_model(args.layers, args.hidden, args.vocab)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    labels = ids.clone()
    labels[:, : args.seq // 8] = -100  # a prompt that is not trained on
    rows = [("stock transformers", *measure(model, ids, labels, args.iters))]
    for name, opts in (("headloss: apply_headloss(model)", {}),
                       ("headloss, uncapped workspace: max_workspace_bytes=None", {"max_workspace_bytes": None})):
        apply_headloss(model, **opts)
        rows.append((name, *measure(model, ids, labels, args.iters)))
        remove_headloss(model)
    try:  # Liger patches the classes: last, on a model of its own each time
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
        for name, opts in (("Liger, the same ops: RMSNorm + fused linear CE", dict(rope=False, swiglu=False)),
                           ("Liger, its default patch (+ RoPE, SwiGLU)", {})):
            del model
            torch.cuda.empty_cache()
            model = make_model(args.layers, args.hidden, args.vocab)
            _apply_liger_kernel_to_instance(model=model, **opts)
            rows.append((name, *measure(model, ids, labels, args.iters)))
    except Exception as e:  # noqa: BLE001
        print(f"# Liger unavailable: {type(e).__name__}: {e}", flush=True)
    import transformers
    lines = [header() + f"; headloss {headloss.version()}; transformers {transformers.__version__}; Llama with "
             f"{args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, bf16; {args.batch} x {args.seq} "
             "tokens a step (the first eighth of each sequence labelled -100); forward + backward", "",
             "| | step (ms) | vs stock | peak above the weights (GiB) |", "|---|---|---|---|"]
    lines += [f"| {name} | {t:.1f} | {rows[0][1] / t:.2f}x faster | {m:.2f} |" for name, t, m in rows]
    lines += ["", "headloss patches RMSNorm and the loss; its defaults cap the fused linear loss's workspace at "
              "256 MiB (uncapped: the plan's fast size). Liger's default patch also fuses RoPE and SwiGLU (its MLP "
              "recomputes the activation in backward instead of keeping it)."]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
