"""Tensor ops shared by the training workers and the losses: vocab-parallel logprobs, the packed-sequence
loss wrapper and the `LossFunction` protocol. Imports only config, data and distributed."""
