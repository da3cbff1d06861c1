"""One-line integrations with model libraries (each imports its library on demand):
headloss.integrations.transformers (Hugging Face causal LMs: RMSNorm and the LM-head loss),
headloss.integrations.verl (verl's fused linear_cross_entropy: per-token log-probs and entropy),
headloss.integrations.megatron (Megatron-core's tensor-parallel language-model loss),
headloss.integrations.torchtitan (DTensor loss_parallel's cross entropy and torchtitan's loss),
headloss.integrations.liger (Liger-Kernel's fused linear cross-entropy module and function),
headloss.integrations.trl (TRL's DPO, KTO, CPO and ORPO trainers on the preference loss)."""
