"""Paged attention: the backend chosen once per device, the flat batch, the step plan."""
