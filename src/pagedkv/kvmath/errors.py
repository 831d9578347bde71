"""The error a model config's fields raise, below every kvmath module that reads them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model config lacks a field KV sizing needs, or holds an impossible value."""
