"""Serving-memory simulation: workloads driven through `pagedkv.memory`, no model at all."""
