"""Which requests run each step, and in what order (the scheduler and its policy)."""
