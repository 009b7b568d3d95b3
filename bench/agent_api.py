"""What the agent API costs, as JSON, on the default model in this process (no daemon: the
numbers are the engine's, not HTTP's):

- constrained decoding: the time per decode step with a grammar's mask (a JSON schema and a
  forced tool call) against the same steps without one — the overhead is the mask (llguidance)
  plus applying it to the logits, reported as a fraction of a decode step (goal ≤ 10 %);
- embeddings: inputs per second and tokens per second for short and longer inputs.

Medians of interleaved runs: plain and constrained steps alternate, so machine noise hits both.

    python bench/agent_api.py [--steps 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    from kiln.native.constrain import Constraint, json_schema_grammar, lark_grammar
    from kiln.native.generate import embed
    from kiln.native.model import load_model
    from kiln.native.models.library import resolve_model
    from kiln.native.tool_calls import call_grammar

    model = load_model(resolve_model("default"))
    tok = model.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
    grammars = {"json_schema": json_schema_grammar(schema),
                "tool_call": lark_grammar(call_grammar("generic", [tool], False, {}))}
    prompt = tok.encode("<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n")

    # a decode step: forward of one token; the mask's cost is measured on the same logits
    cache = model.new_cache(len(prompt) + args.steps * args.runs + 8)
    logits = model.forward(prompt, cache)
    step_s, mask_s = [], {k: [] for k in grammars}
    for _ in range(args.runs):
        constraints = {k: Constraint(g, tok) for k, g in grammars.items()}
        for i in range(args.steps):
            t = time.perf_counter()
            logits = model.forward([int(np.argmax(logits))], cache)
            step_s.append(time.perf_counter() - t)
            for k, c in constraints.items():
                if c.done:
                    constraints[k] = c = Constraint(grammars[k], tok)
                t = time.perf_counter()
                masked = c.apply(logits)
                mask_s[k].append(time.perf_counter() - t)
                c.accept(int(np.argmax(masked)))
    step = statistics.median(step_s)
    out = {"model": model.path.stem, "decode_step_ms": round(step * 1e3, 3)}
    for k, xs in mask_s.items():
        m = statistics.median(xs)
        out[f"{k}_mask_ms"] = round(m * 1e3, 3)
        out[f"{k}_overhead_of_a_step"] = round(m / step, 4)

    texts = {"short": "The cat sat on the mat.",
             "long": " ".join(["Kiln runs language models on a laptop and never falls over."] * 20)}
    for name, text in texts.items():
        ids = tok.encode(text, special=False)
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            embed(model, ids)
            times.append(time.perf_counter() - t)
        m = statistics.median(times)
        out[f"embed_{name}_tokens"] = len(ids)
        out[f"embed_{name}_per_s"] = round(1 / m, 1)
        out[f"embed_{name}_tok_s"] = round(len(ids) / m, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
