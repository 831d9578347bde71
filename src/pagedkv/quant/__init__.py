"""Quantised weights: their one in-memory layout, the conversions into it, and its matmul."""
