"""The GGUF tokenizer equals transformers' and, like the weights, loads without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE_DIR = os.environ.get("JAXSERVE_TEST_CACHE", os.path.join(ROOT, ".jax_cache"))
TEXTS = [
    "Once upon a time",
    "def f(x):\n    return x**2  # 😀 日本語",
    "<|im_start|>user\nhi<|im_end|>",
    "  leading spaces\t\ttabs and naïve café",
]


def test_gguf_tokenizer_equals_transformers(smollm2_path, smollm2_tokenizer):
    from transformers import AutoTokenizer

    directory, name = os.path.split(smollm2_path)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok = smollm2_tokenizer
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids,
                                                                       skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token, tok.bos_token, tok.pad_token, tok.unk_token) == \
        (ref.eos_token, ref.bos_token, ref.pad_token, ref.unk_token)
    assert len(tok) == len(ref)


def test_default_model_generates_without_torch(smollm2_path):
    """Serving never needs torch: block it and run load + tokenize + greedy generate."""
    # NOTE: the serving tests' engine sizes and the suite's compilation cache: the steps it
    # runs come from the cache, not compiled again in a fresh process.
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # import torch now fails; transformers sees no torch
        from jaxserve import LLM, SamplingParams
        llm = LLM(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                  num_kv_blocks=64, warmup=False, compilation_cache_dir={CACHE_DIR!r})
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        print(repr(out[0].outputs[0].text))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == repr(", the city of Nova Haven")
