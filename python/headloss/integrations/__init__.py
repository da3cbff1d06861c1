"""One-line integrations with model libraries (each imports its library on demand):
headloss.integrations.transformers (Hugging Face causal LMs: RMSNorm and the LM-head loss),
headloss.integrations.megatron (Megatron-core's tensor-parallel language-model loss)."""
