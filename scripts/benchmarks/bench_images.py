"""Images through the engine: the vision encoder's images per second at batch 1, and the time to
the first token of an image prompt with and without an encoder cache hit.

Two random Gemma 3 checkpoints built here (transformers' `Gemma3ForConditionalGeneration`, the
embedded SmolLM2 tokenizer with Gemma 3's image tokens, a 2-layer text model of width 64):
"tiny", the tests' tower (32 x 32 images, 8 x 8 patches of 4 pooled to 16 tokens), and
"so400m", a tower of SigLIP-so400m's widths (1152 hidden, 4304 MLP, 16 heads, 896 x 896 images
in 14 x 14 patches: 4096 patch tokens pooled to 256, as Gemma 3 4B-27B) with `--vision-layers`
of its 27 layers, so a whole tower costs about 27x the per-layer figure printed.

Encoder: `VisionTower.encode` of one preprocessed image (the engine's call: a dense softmax
attention), against transformers' `get_image_features` on the same weights (torch, 2 threads,
its default `sdpa` attention: a fused CPU kernel), interleaved per round.
Time to first token: `LLM.generate` of `max_tokens=1` (wall, with the image's preprocessing),
three forms interleaved, the order reversed every other round after two unrecorded rounds,
each prompt's text new so no page is shared unless stated:
  "new image": an image not seen before (encoded);
  "seen image": the image of an earlier prompt after other text (an encoder cache hit, the
      whole prompt computed);
  "same prompt": an earlier prompt and image again (its pages from the prefix cache: the
      image is not looked up at all).
The load average (1 min) is printed beside every round.

Usage: python -m scripts.benchmarks.bench_images [--towers tiny,so400m] [--rounds 5]
       [--vision-layers 1] [--encodes 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>"}
# name: (vision config, image size, tokens per image)
TOWERS = {
    "tiny": (dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, patch_size=4),
             32, 16),
    "so400m": (dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16,
                    patch_size=14), 896, 256),
}


def build(path: str, tower: str, layers: int):
    """Saves a random Gemma 3 with `tower`'s vision widths under `path`; returns the
    transformers model."""
    import torch
    import transformers

    from models.default_model import default_model_path
    from models.loaders import load_tokenizer

    tok = copy.deepcopy(load_tokenizer(default_model_path()))
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    for name, text in IMAGE_TOKENS.items():
        setattr(tok, name, text)
        setattr(tok, name + "_id", tok.convert_tokens_to_ids(text))
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in IMAGE_TOKENS.items()}
    vision, size, tokens = TOWERS[tower]
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, sliding_window=512, max_position_embeddings=1024,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(vision, num_hidden_layers=layers, image_size=size),
        mm_tokens_per_image=tokens, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"])
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size}).save_pretrained(path)
    return hf


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (300 + seed % 7, 400, 3), dtype=np.uint8))


def bench_encoder(llm, hf, rounds: int, encodes: int) -> list[tuple[float, float, float]]:
    """(load, jaxserve images/s, transformers images/s) per round, batch 1."""
    import jax
    import torch

    tower = llm.engine.worker.vision
    inputs = llm.engine.inputs.images.processor(picture(0))
    pixels = torch.from_numpy(np.asarray(inputs.pixel_values))[None]
    jax.block_until_ready(tower.encode(inputs))  # compile
    with torch.no_grad():
        for _ in range(3):  # torch's first calls pick their kernels
            hf.model.get_image_features(pixel_values=pixels)
    rows = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(encodes):
            jax.block_until_ready(tower.encode(inputs))
        ours = encodes / (time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(encodes):
                hf.model.get_image_features(pixel_values=pixels)
        theirs = encodes / (time.perf_counter() - t)
        rows.append((os.getloadavg()[0], ours, theirs))
    return rows


FORMS = ("new image", "seen image", "same prompt")


def bench_first_token(llm, rounds: int) -> list[tuple[float, dict[str, float]]]:
    """(load, {form: seconds}) per round; rounds 0 and 1 (compiles: the first prefix hit is
    a new step shape) are left out."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    seen, count = picture(1), [0]

    def prompt(form: str) -> dict:
        count[0] += 1
        if form == "same prompt":
            return {"prompt": "Say what is in<start_of_image> please.",
                    "multi_modal_data": {"image": seen}}
        image = picture(1000 + count[0]) if form == "new image" else seen
        return {"prompt": f"Request {count[0]}: say what is in<start_of_image> please.",
                "multi_modal_data": {"image": image}}

    rows = []
    for r in range(rounds + 2):
        times = {}
        for form in (FORMS if r % 2 else FORMS[::-1]):
            p = prompt(form)
            t = time.perf_counter()
            llm.generate([p], params, use_tqdm=False)
            times[form] = time.perf_counter() - t
        if r > 1:
            rows.append((os.getloadavg()[0], times))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--towers", default="tiny,so400m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vision-layers", type=int, default=1)
    ap.add_argument("--encodes", type=int, default=5, help="encodes timed per round")
    args = ap.parse_args()
    import torch

    from jaxserve import LLM

    torch.set_num_threads(2)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for name in args.towers.split(","):
        with tempfile.TemporaryDirectory() as path:
            hf = build(path, name, args.vision_layers)
            tokens = TOWERS[name][2]
            llm = LLM(path, warmup=False, max_model_len=1024, max_num_seqs=4,
                      max_num_batched_tokens=max(64, 2 * tokens), num_kv_blocks=256)
            encodes = args.encodes if name != "tiny" else 20 * args.encodes
            print(f"\n{name} ({args.vision_layers if name != 'tiny' else 2} vision layers, "
                  f"{tokens} tokens an image)")
            print("| round | load | jaxserve images/s | transformers images/s | ratio |")
            enc = bench_encoder(llm, hf, args.rounds, encodes)
            for i, (load, ours, theirs) in enumerate(enc, 1):
                print(f"| {i} | {load:.2f} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")
            med = [statistics.median(x[k] for x in enc) for k in (1, 2)]
            print(f"| median | | {med[0]:.2f} | {med[1]:.2f} | {med[0] / med[1]:.2f} |")
            print("| round | load | " + " | ".join(f"{f} ms" for f in FORMS) + " |")
            ttft = bench_first_token(llm, args.rounds)
            for i, (load, times) in enumerate(ttft, 1):
                print(f"| {i} | {load:.2f} | "
                      + " | ".join(f"{1000 * times[f]:.1f}" for f in FORMS) + " |")
            print("| median | | " + " | ".join(
                f"{1000 * statistics.median(t[f] for _, t in ttft):.1f}" for f in FORMS) + " |")
            m = llm.get_metrics()
            print("encoder cache: " + ", ".join(
                f"{k.split(':')[1]}={m[k]:g}" for k in m if "mm_cache" in k or "encoder_" in k))
            del llm, hf


if __name__ == "__main__":
    main()
