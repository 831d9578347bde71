"""`pagedkv bench`: engine throughput against transformers, on one workload, model and KV budget.

Three systems generate the same seeded workload greedily, with every request producing
exactly its requested number of tokens (ignore_eos), in alternating order over a few rounds:
- pagedkv: the `Engine`, paged KV blocks out of the budget, continuous batching;
- transformers `generate`: left-padded static batches in arrival order, as many requests per
  batch as the budget holds at the longest possible request (max prompt + max output): the
  contiguous-reservation baseline. A batch runs until its longest request is done; only each
  request's requested tokens count as useful output;
- transformers continuous batching (its paged cache and scheduler), sized to the same number
  of KV tokens and the same token budget per step.
Throughput is useful generated tokens per second of wall time, from the first request queued to
the last token out (model loading and warm-up excluded). pagedkv gets a fresh, warmed-up engine
per run, so no run finds an earlier round's prompts in its prefix cache; transformers' continuous
batching gets a fresh manager (and cache) per run as well. The figures that explain pagedkv's
side (peak concurrency, KV utilisation, preemptions, the share of step time outside the model's
forward pass) come from the engine's own counters and its runner's clocks.

The modules, bottom up: `workloads` (specs and seeded generation), `random_model` (the default
seeded random Llama), `results` (what a run produced), `transformers_baselines` (the two
baselines), `systems` (`BenchConfig`, the loaded systems, pagedkv's run), `report` (header,
tables, goals) and `main` (`run_benchmark`, the flags, `pagedkv bench` and
`bench/engine_bench.py`).
"""
