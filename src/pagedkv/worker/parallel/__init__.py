"""Tensor parallelism's processes: rank 0 (the engine's) and the workers that mirror it.

One scheduler and one memory manager run on rank 0. Each step rank 0 broadcasts the plain-data
`SchedulerOutput`, and every rank runs the same memory plan on its shard of the KV cache and
the same forward pass on its shard of the weights (`parallel/` in the package root splits the
layers). `ranks.py` is rank 0's side, `worker.py` every other rank's, `link.py` the process
group and store they share.
"""
