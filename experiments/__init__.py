"""Hydra entry points: thin wrappers that turn a composed config into harness calls."""
