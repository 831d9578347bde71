"""Speculative decoding: draft a few tokens cheaply, verify them in the step's one forward pass.

`config.py` reads vLLM's `speculative_config`; `drafter.py` is what proposes drafts, prompt
lookup (`ngram.py`) or a draft model (`draft_model.py`); `acceptance.py` stops drafting for a
sequence while its drafts do not pay; `metrics.py` counts drafts and kept tokens as vLLM does.
Verification is the sampler's (`engine/sampler.py`: a draft is kept where the row drew it),
the executor keeping each sequence's longest kept prefix (`engine/executor.py`).
"""
