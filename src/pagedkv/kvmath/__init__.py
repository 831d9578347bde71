"""Torch-free KV arithmetic: bytes per token from a config, capacity planning, presets."""
