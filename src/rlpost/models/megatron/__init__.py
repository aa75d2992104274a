"""Megatron-Core model layer: HF <-> Megatron conversion, GPTModel building, logprobs and one training step.

Importing this package does not import megatron.core; import the submodules that you need:
`cpu_compat` (the CPU/gloo compatibility layer), `convert` (HF <-> Megatron weights and configs),
`model` (build_gpt_model, forward_logprobs), `train_step` (DDP, optimizer, scheduler, one step).
"""
