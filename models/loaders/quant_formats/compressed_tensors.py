"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, llm-compressor's
output) read as they are: `pack-quantized` and `int-quantized`/`naive-quantized` integers
onto `q4`/`q8` (`int_groups`), `float-quantized` FP8 onto `fp8` (`fp8.compressed_tensors_fp8`),
`mxfp4-pack-quantized`/`nvfp4-pack-quantized` onto `mxfp4`/`nvfp4` (`fp4`).

Each `config_groups` entry is a scheme: `targets` ("Linear", module names, `re:` regexes),
`weights` args (num_bits, type int/float, symmetric, strategy, group_size, block_structure)
and a `format` (the group's, else the config's). `ignore` leaves modules float. A Linear
`<module>` of an integer scheme stores (N outputs, K inputs, G groups; q and z signed):

* pack-quantized: `weight_packed` int32[N, K * bits / 32] (value i of a word in bits
  [bits * i, bits * (i + 1)), stored as q + 2^(bits - 1)), `weight_shape` [N, K],
  `weight_scale` [N, G] (channel: [N, 1]) and, asymmetric, `weight_zero_point` stored the
  same way along N (int32[N * bits / 32, G]).
* int-quantized / naive-quantized: `weight` int8[N, K] holding q, and `weight_scale`.
* with `actorder` (pack-quantized groups): `weight_g_idx` i32[K], input k's group, in any
  order (read by `act_order`: K sorted by group, the permutation kept).

w = (q - z) * scale. Activations are computed in the model's float dtype whatever the
scheme's `input_activations` (W8A8 runs as W8A16 here; an `input_scale` is not read).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from models.config import ArchConfig
from models.loaders.checkpoint_quant import CheckpointFormat, register
from models.loaders.quant_formats.act_order import act_order_modules, group_rows, module_names
from models.loaders.quant_formats.fp4 import FP4_FORMATS, compressed_tensors_fp4
from models.loaders.quant_formats.fp8 import compressed_tensors_fp8
from models.loaders.quant_formats.gptq import read_field
from models.loaders.quant_formats.int_groups import check_shape, group_format, unpack_int32
from models.quant import QuantFormat, QuantPlan

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FORMATS = (*INT_FORMATS, "float-quantized", *FP4_FORMATS)
INT_STRATEGIES = ("tensor", "channel", "group")
FLOAT_SCALES = ("float16", "bfloat16", "float32")
# `actorder` values (compressed-tensors' ActivationOrdering; True was "group"): each may
# leave a `weight_g_idx` (input k in group g_idx[k]) that is read as it is (`act_order`).
ACTORDERS = ("group", "weight", "static", "dynamic", True)


def _matches(name: str, target: str, where: str) -> bool:
    """compressed-tensors' own matching: "Linear" (every module we quantize is one), an
    exact module name, or `re:` + a regex matched from the start of the name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == "Linear":
        return True
    if target[:1].isupper():  # a module class other than Linear (attention, MoE block, ...)
        raise ValueError(f"{where}: target {target!r} (a module class) is not supported "
                         "(supported: 'Linear', module names and 're:' patterns)")
    return target == name


def _int_reader(weights: dict, fmt_name: str, where: str):
    """The `q4`/`q8` format and reader of an integer scheme's `weights` args."""
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    symmetric = weights.get("symmetric", True) is not False
    if strategy not in INT_STRATEGIES:
        raise ValueError(f"{where}.strategy {strategy!r} is not supported for integer weights "
                         f"(supported: {', '.join(INT_STRATEGIES)})")
    if strategy == "tensor" and not symmetric:
        raise ValueError(f"{where}: asymmetric weights with strategy 'tensor' are not supported")
    group = int(weights.get("group_size") or 0) if strategy == "group" else -1
    if strategy == "group" and group <= 0:
        raise ValueError(f"{where}.group_size {weights.get('group_size')!r} must be positive "
                         "for strategy 'group'")
    if not isinstance(bits, int):
        raise ValueError(f"{where}.num_bits {bits!r} must be an integer")
    fmt = group_format(bits, group, symmetric, f"{where} (num_bits={bits}, strategy={strategy!r})")
    actorder = weights.get("actorder")
    if actorder not in (None, False, *ACTORDERS):
        raise ValueError(f"{where}.actorder {actorder!r} is not supported (supported: "
                         "'group', 'weight', 'static', 'dynamic', or none)")
    offset = 1 << (bits - 1)

    def reader(source, name: str, fmt: QuantFormat = fmt) -> dict[str, np.ndarray]:
        if not name.endswith(".weight"):
            raise KeyError(name)
        base = name[:-len(".weight")]
        if fmt_name == "pack-quantized":
            words = read_field(source, base, "weight_packed")
            shape = read_field(source, base, "weight_shape").reshape(-1).tolist()
            if len(shape) != 2 or words.dtype != np.int32 or words.ndim != 2:
                raise ValueError(f"quantized tensor {base!r}: weight_packed {words.dtype}"
                                 f"{list(words.shape)} and weight_shape {shape} must be "
                                 "int32[N, K * num_bits / 32] and [N, K]")
            n, k = (int(v) for v in shape)
            check_shape(words, (n, -(-k * bits // 32)), base, "weight_packed (for weight_shape)")
            codes = unpack_int32(words, bits, axis=1)[:, :k]  # q + offset, u8[N, K]
        else:
            q = read_field(source, base, "weight")
            if q.dtype != np.int8 or q.ndim != 2:
                raise ValueError(f"quantized tensor {base!r}: weight must be int8[N, K] "
                                 f"({fmt_name}), got {q.dtype}{list(q.shape)}")
            n, k = q.shape
            codes = (q.astype(np.int16) + offset).astype(np.uint8)
        groups = k // group if strategy == "group" else 1
        if strategy == "group" and k % group:
            raise ValueError(f"quantized tensor {base!r}: group_size {group} does not divide "
                             f"its {k} input features")
        scales = read_field(source, base, "weight_scale")
        if strategy == "tensor" and scales.size == 1:
            scales = np.broadcast_to(scales.reshape(1, 1), (n, 1))
        check_shape(scales, (n, groups), base, "weight_scale")
        if scales.dtype.name not in FLOAT_SCALES:
            raise ValueError(f"quantized tensor {base!r}: weight_scale must be float, got "
                             f"{scales.dtype}")
        if symmetric:
            zero_points = np.full((n, groups), offset, np.int32)
        elif fmt_name == "pack-quantized":
            zp = read_field(source, base, "weight_zero_point")
            check_shape(zp, (-(-n * bits // 32), groups), base, "weight_zero_point")
            zero_points = unpack_int32(zp, bits, axis=0)[:n].astype(np.int32)
        else:  # int8 zero points [N, G] as they are (q4 only: 8-bit asymmetric is refused)
            zp = read_field(source, base, "weight_zero_point")
            check_shape(zp, (n, groups), base, "weight_zero_point")
            zero_points = zp.astype(np.int32) + offset
        try:
            g_idx = np.asarray(source.get(f"{base}.weight_g_idx"))
        except KeyError:
            g_idx = None
        return group_rows(fmt, codes, scales, zero_points, g_idx, base, "weight_g_idx")

    return fmt, reader


def _scheme(group: dict, default_format, where: str):
    """(format, reader) of one config group."""
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ValueError(f"{where}.weights must be the scheme's weight quantization args")
    weights = group["weights"]
    fmt_name = group.get("format") or default_format
    if fmt_name == "naive-quantized" and weights.get("type") == "float":
        fmt_name = "float-quantized"
    if fmt_name not in FORMATS:
        raise ValueError(f"{where}.format {fmt_name!r} is not supported (supported: "
                         f"{', '.join(FORMATS)})")
    if fmt_name == "float-quantized":
        return compressed_tensors_fp8(weights, f"{where}.weights")
    if fmt_name in FP4_FORMATS:
        return compressed_tensors_fp4(fmt_name, weights, f"{where}.weights")
    if weights.get("type", "int") != "int":
        raise ValueError(f"{where}.weights.type {weights.get('type')!r} is not supported for "
                         f"format {fmt_name!r} (supported: int)")
    return _int_reader(weights, fmt_name, f"{where}.weights")


def _refuse_extras(qc: dict, where: str) -> None:
    """Fields that change the weights beyond quantization, which are not served."""
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(field):
            raise ValueError(f"{where}.{field} is not supported (a checkpoint with "
                             f"{field.split('_')[0]} settings)")


@register("compressed-tensors")
def compressed_tensors_format(qc: dict, path: str, cfg: ArchConfig) -> CheckpointFormat:
    """The compressed-tensors format of `qc` (`config_groups`, `ignore`, `format`).

    Raises:
        ValueError: An unsupported format (MXFP6, MXFP8, ...), strategy, bit width or
            target; a module quantized in some layers only or by different schemes in
            different layers; a quantized LM head or router; sparsity, transforms or a
            KV-cache scheme. The message names the field.
    """
    where = f"{path}: quantization_config"
    _refuse_extras(qc, where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups must name at least one scheme")
    ignore = qc.get("ignore") or []
    default_format = qc.get("format")
    schemes = {key: _scheme(g, default_format, f"{where}.config_groups.{key}")
               for key, g in groups.items()}

    def group_of(name: str):  # the first group whose targets match (None: float)
        if any(_matches(name, t, f"{where}.ignore") for t in ignore):
            return None
        for key, g in groups.items():
            if any(_matches(name, t, f"{where}.config_groups.{key}.targets")
                   for t in g.get("targets") or []):
                return key
        return None

    formats, readers, ordered = [], {}, []
    for module, names in module_names(cfg).items():
        keys = {group_of(name) for name in names}
        if len(keys) > 1:
            raise ValueError(f"{where}: {module!r} is quantized by groups "
                             f"{sorted(map(str, keys))} in different layers; one scheme per "
                             "module for all layers is supported")
        key = keys.pop()
        if key is None:
            continue
        if module in ("lm_head", "router"):
            raise ValueError(f"{where}.config_groups.{key} quantizes {names[0]!r} (a "
                             "quantized LM head or MoE router is not supported: add it to "
                             "ignore)")
        fmt, reader = schemes[key]
        formats.append((module, fmt))
        readers[module] = reader
        if groups[key]["weights"].get("actorder") not in (None, False) and fmt.block:
            ordered.append(module)
    if not formats:
        raise ValueError(f"{where}: no config_groups target matches a decoder Linear")
    # actorder: the modules whose weight_g_idx is out of order somewhere keep a permutation.
    permuted = act_order_modules(path, cfg, ordered, "weight_g_idx") if ordered else set()
    formats = [(m, dataclasses.replace(f, act_order=True) if m in permuted else f)
               for m, f in formats]
    for module, fmt in formats:
        if fmt.act_order:
            readers[module] = functools.partial(readers[module], fmt=fmt)
    plan = QuantPlan(tuple(formats), "compressed-tensors")

    def read(source, name: str) -> dict[str, np.ndarray]:
        parts = name.removesuffix(".weight").split(".")
        module = ("experts." if "experts" in parts else "") + parts[-1]
        if module not in readers:
            raise KeyError(name)
        return readers[module](source, name)

    return CheckpointFormat("compressed-tensors", plan, read)
