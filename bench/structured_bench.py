"""What structured outputs cost: 32 requests held to a JSON schema against 32 free ones.

On the built-in model (or `--model`), `--num-requests` chat prompts asking for a person as
JSON run twice as one batch each: free (temperature 0, EOS ignored, so every request makes
`--max-tokens` tokens) and constrained by a schema (temperature 0; each ends when its JSON
is complete). The figure is output tokens per second of each run, the best of `--repeats`
alternating runs (a shared machine's noise only slows runs down), and their ratio (the goal
is constrained >= 0.8x free). The time spent computing and applying grammar masks is timed
inside the sampler and given per constrained token. The grammar is compiled (and the
vocabulary built) by a warm-up request first, and that compile time is printed on its own.

Full run: .venv/bin/python bench/structured_bench.py
Quick check: .venv/bin/python bench/structured_bench.py --num-requests 2 --max-tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import time

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.engine import sampler
from pagedkv.hub import DEFAULT_MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "languages", "employed"],
    "additionalProperties": False,
}


class MaskTimer:
    """Wraps the sampler's mask function: total seconds and rows masked."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self._real = sampler.apply_grammar_masks
        sampler.apply_grammar_masks = self

    def __call__(self, logits, rows, states) -> None:
        started = time.perf_counter()
        self._real(logits, rows, states)
        self.seconds += time.perf_counter() - started
        self.rows += len(rows)


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, list[str]]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    samples = [sample for output in outputs for sample in output.outputs]
    return seconds, sum(len(s.token_ids) for s in samples), [s.text for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model)
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} as a JSON object."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(args.num_requests)
    ]
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured_outputs=constraint
    )
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    run(llm, prompts[:1], SamplingParams(max_tokens=1, structured_outputs=constraint))
    print(f"warm-up (vocabulary + compile + 1 token): {time.perf_counter() - started:.2f} s")
    timer = MaskTimer()
    free_s = constrained_s = float("inf")
    for _ in range(args.repeats):
        seconds, free_tokens, _ = run(llm, prompts, free)
        free_s = min(free_s, seconds)
        seconds, constrained_tokens, texts = run(llm, prompts, constrained)
        constrained_s = min(constrained_s, seconds)
    parsed = sum(1 for text in texts if _parses(text))
    free_rate, constrained_rate = free_tokens / free_s, constrained_tokens / constrained_s
    print(f"free:        {free_tokens} tokens in {free_s:.2f} s = {free_rate:.1f} tokens/s")
    print(
        f"constrained: {constrained_tokens} tokens in {constrained_s:.2f} s = "
        f"{constrained_rate:.1f} tokens/s ({parsed}/{len(texts)} outputs parse)"
    )
    print(f"ratio: {constrained_rate / free_rate:.2f}x (goal >= 0.8x)")
    per_token = timer.seconds / max(timer.rows, 1)
    share = per_token * constrained_tokens / constrained_s
    print(
        f"masks: {timer.seconds * 1e3:.1f} ms for {timer.rows} constrained tokens = "
        f"{per_token * 1e6:.1f} us per token (about {share:.1%} of the best run)"
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
