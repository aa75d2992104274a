"""Environments: score responses. They know no trainer."""
