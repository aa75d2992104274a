"""Data: datasets, prompt processing, collate, sequence packing."""
