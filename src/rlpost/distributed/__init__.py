"""Distributed data plumbing: BatchedDataDict, sharding and micro-batching."""
