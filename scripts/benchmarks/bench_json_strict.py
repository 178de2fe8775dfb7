"""How many sampled outputs of a nested JSON schema parse and validate, under the default
(strict) constraint or under given `structured_outputs` options.

SmolLM2 (the embedded default), 40 samples at temperature 1 (seeds 0-39) of the schema
`NESTED` (an object inside an object, an enum, bounded strings, an array), `max_tokens` 160,
each parsed and validated with `jsonschema`.

Usage: python -m scripts.benchmarks.bench_json_strict ['{"disable_additional_properties": false}']
"""

from __future__ import annotations

import json
import os
import sys
import time

import jsonschema

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.bench.structured import NESTED


def main() -> None:
    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(max_num_seqs=40, max_model_len=512)
    params = [SamplingParams(temperature=1.0, max_tokens=160, seed=i,
                             structured_outputs=StructuredOutputsParams(json=NESTED, **options))
              for i in range(40)]
    start = time.perf_counter()
    outs = llm.generate(["Describe a person as JSON:"] * 40, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), NESTED)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    print(f"options {options or 'default'}: {valid} / 40 valid in {seconds:.0f} s (load "
          f"average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
