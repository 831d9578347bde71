"""Speculative decoding: draft a few tokens cheaply, verify them in the step's one forward pass.

`config.py` reads vLLM's `speculative_config`; `ngram.py` drafts by prompt lookup; `verify.py`
keeps the longest prefix of a sequence's drafts its own sampling would have produced;
`acceptance.py` stops drafting for a sequence while its drafts do not pay.
"""
