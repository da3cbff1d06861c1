"""One-line integrations with model libraries (each imports its library on demand):
headloss.integrations.transformers (Hugging Face causal LMs: RMSNorm and the LM-head loss),
headloss.integrations.liger (Liger-Kernel's fused linear cross-entropy module and function)."""
