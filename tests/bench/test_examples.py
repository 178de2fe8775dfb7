"""`scripts/examples/`: each worked example runs as written on the tiny random model
(`tiny_model_dir`), with the engine sizes of the other tiny-model tests."""

from __future__ import annotations

import numpy as np


def test_rl_update_weights(tiny_model_dir, capsys):
    from scripts.examples import rl_update_weights

    rl_update_weights.main(["--model", tiny_model_dir, "--rounds", "2"])
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("compiles 0" in line for line in rounds), out


def test_lora_adapters(tiny_model_dir, capsys):
    from scripts.examples import lora_adapters

    rows = lora_adapters.main(["--model", tiny_model_dir, "--max-tokens", "6",
                               "--attention-backend", "xla"])
    names = [name for name, _ in rows]
    per = len(lora_adapters.PROMPTS)
    assert names == ["base"] * per + ["sql"] * per + ["poems"] * per
    texts = {name: [t for n, t in rows if n == name] for name in ("base", "sql", "poems")}
    assert texts["sql"] != texts["base"] and texts["poems"] != texts["sql"]
    assert "compilations after warm-up: 0" in capsys.readouterr().out


def test_embeddings(tiny_model_dir):
    from scripts.examples import embeddings

    similarity = embeddings.main(["--model", tiny_model_dir, "--attention-backend", "xla"])
    n = len(embeddings.TEXTS)
    assert similarity.shape == (n, n)
    np.testing.assert_allclose(np.diag(similarity), 1.0, atol=1e-5)
    np.testing.assert_allclose(similarity, similarity.T, atol=1e-6)
