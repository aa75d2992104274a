"""Rollout engines: vLLM (VllmGeneration) and transformers `generate` (HFGeneration) behind GenerationInterface."""
