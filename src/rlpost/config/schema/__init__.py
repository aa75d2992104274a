"""Dataclass schemas for every config block. Torch-free leaves: they import only the stdlib."""
