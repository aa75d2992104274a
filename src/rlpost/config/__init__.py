"""Config system: dataclass schemas, ConfigStore registration, composition and validation.

Nothing in this package imports torch, vLLM or megatron: validation is instant and happens before
anything heavy starts.
"""
