"""DTensor / FSDP2 parallelism for HF causal LMs."""
