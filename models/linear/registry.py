"""The method registry: every per-platform choice a model's code must not make itself.

A model is loaded as a `QuantPlan` (how the checkpoint stores each weight) and a
`ServingChoice` (the attention backend, and the serving forms asked for). From those,
`choose_methods` picks, once, the `Methods` the decoder is built with: each linear layer's
method (`FloatLinear`, `QuantLinear`, `Fp8Linear` or `Fp4Linear` with the Pallas or XLA
kernel, the `cpu` backend's `PanelLinear`; `LoRALinear` around the targets when adapters
are served), the embedding's, the routed experts' (and how their grouped matmul runs), and
the attention kernels (`pallas_kernels.AttentionOps`). `serving_params` and
`standard_params` move a params tree between the standard layout (what checkpoints and
`update_weights` hold) and the serving form those methods read. Nothing under `models/`
outside this package names a backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models.config import LAYER_MATMULS, ArchConfig, layer_matmul_shapes
from models.deepseek_config import MLA_MATMULS
from models.linear import panels as panel_methods
from models.linear.base import STACKS, EmbedMethod, LinearMethod
from models.linear.dense import FloatEmbed, FloatLinear, QuantEmbed, QuantLinear
from models.linear.fp4 import Fp4Linear
from models.linear.fp8 import Fp8Linear, infer_fp8_format
from models.linear.lora import LoRALinear, scan_slices_lora
from models.linear.panels import PanelEmbed, PanelLinear
from models.lora import served_targets
from models.quant import FP4_BLOCKS, NO_QUANT, PERM, QuantFormat, QuantPlan, kind_of
from pallas_kernels import AttentionOps, resolve_backend
from pallas_kernels.rank_split import AttentionRanks
from pallas_kernels.tuning import tuned

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def platform() -> str:
    """The JAX platform the model serves on ("cpu", "gpu", "tpu")."""
    return jax.default_backend()


def grouped_impl() -> str:
    """How a mixture of experts' grouped matmul runs here (`models.moe.GROUPED_IMPLS`):
    XLA's `ragged_dot` (grouped GEMMs on GPU and TPU) or, on the CPU, where XLA expands
    `ragged_dot` into a matmul of every row with every group, the expert loop."""
    return "loop" if platform() == "cpu" else "ragged_dot"


@dataclasses.dataclass(frozen=True)
class ServingChoice:
    """What a model's methods are chosen from, beside its plan and dtype.

    Attributes:
        backend: The attention backend ("auto" resolves per platform:
            `pallas_kernels.resolve_backend`).
        panels: Serve the layer matmuls and the LM head from the `cpu` backend's packed
            panels (`models.linear.panels`; `can_panel` says where they serve).
        whole_experts: A mixture of experts' routed stacks read whole from `STACKS` at
            the layer index (one device: XLA:CPU would copy every expert of a layer out of
            the scan's slices), instead of sliced per layer.
        batch_invariant: Every token's logits bit for bit independent of what shares its
            step: matmuls in fixed row tiles, attention per token in fixed key blocks.
        lora_impl: How adapters' updates are computed (`models.linear.lora.LORA_IMPLS`,
            resolved), or None: no adapters served.
        attention_ranks: Data-parallel attention's ranks (`pallas_kernels.rank_split`,
            set by the runner from its layout); None: one step attends every request.

    Raises:
        ValueError: An unknown backend, or "cpu" where its kernel does not build.
    """

    backend: str = "auto"
    panels: bool = False
    whole_experts: bool = False
    batch_invariant: bool = False
    lora_impl: str | None = None
    attention_ranks: AttentionRanks | None = None

    def __post_init__(self):
        object.__setattr__(self, "backend", resolve_backend(self.backend))


@dataclasses.dataclass(frozen=True)
class Methods:
    """The methods a decoder is built with (hashable: a static part of the module tree).

    Attributes:
        attention: The KV write and attention kernels.
        linears: (module name, method) of the modules not served by `default`.
        default: The method of every other linear layer (routers, gates: float).
        embedding: The token embedding's method (and the tied LM head's).
        experts: (projection, method) of a mixture of experts' routed stacks.
        grouped: The experts' grouped matmul (`models.moe.GROUPED_IMPLS`).
        whole_experts: See `ServingChoice.whole_experts`.
        lora_whole: The LoRA slot stacks are read whole at the layer (the scan broadcasts
            them) rather than sliced.
        kv_dtype: The dtype of KV pages under `kv_cache_dtype="auto"`.
    """

    attention: AttentionOps
    linears: tuple[tuple[str, LinearMethod], ...]
    default: LinearMethod
    embedding: EmbedMethod
    experts: tuple[tuple[str, LinearMethod], ...]
    grouped: str
    whole_experts: bool
    lora_whole: bool
    kv_dtype: Any

    def linear(self, name: str) -> LinearMethod:
        """The method of linear module `name` ("q_proj", "lm_head", "gate", ...)."""
        return dict(self.linears).get(name, self.default)

    def expert(self, projection: str) -> LinearMethod:
        """The method of the routed experts' stack `projection` ("gate_proj", ...)."""
        return dict(self.experts)[projection]

    @property
    def backend(self) -> str:
        """The attention backend the methods were chosen for."""
        return self.attention.backend

    @property
    def batch_invariant(self) -> bool:
        """Whether they compute batch-invariantly (norms then sum in a fixed order too)."""
        return self.attention.batch_invariant

    @property
    def form(self) -> tuple:
        """Where the weights live for these methods (which are read whole from `STACKS`):
        two `Methods` of the same form read the same params tree."""
        return (tuple(name for name, m in self.linears if m.stacked),
                self.embedding.stacked, self.whole_experts)


def stored_method(leaves) -> LinearMethod:
    """The method whose standard leaves `leaves` (their names, or a dict of them: a float
    kernel, or a quantized weight's codes) are, for what needs only their layout
    (partitioning, references); a q8 weight's block is read from its scales' shape when the
    leaves are arrays."""
    kind = kind_of(leaves)
    if kind is None:
        return FloatLinear()
    if kind == "fp8":  # its blocks read off the scales' shape (or a default: layout only)
        arrays = isinstance(leaves, dict) and hasattr(leaves["block_scales"], "shape")
        return Fp8Linear(infer_fp8_format(leaves) if arrays else QuantFormat("fp8", 0, block_n=0))
    if kind in FP4_BLOCKS:  # the kind fixes the block
        return Fp4Linear(QuantFormat(kind, FP4_BLOCKS[kind]))
    block = 32
    if isinstance(leaves, dict) and hasattr(leaves["scales"], "shape"):
        k = leaves["qweight"].shape[-2] * (2 if kind == "q4" else 1)
        block = k // leaves["scales"].shape[-2]
    return QuantLinear(QuantFormat(kind, block, act_order=PERM in leaves))


def can_panel(cfg: ArchConfig, plan: QuantPlan, dtype, backend: str,
              one_device: bool = True) -> bool:
    """Whether a model serves from packed panels: the `cpu` backend, float32 compute on
    one device, a dense model (not a mixture of experts: its experts are grouped matmuls;
    nor a linear-attention hybrid, whose mixer stacks are read at their own indices),
    every quantized layer matmul in a format the quantized kernel reads, and the kernels
    built here."""
    if resolve_backend(backend) != "cpu" or jnp.dtype(dtype) != jnp.float32 or not one_device:
        return False
    if (cfg.is_moe or cfg.has_linear_attention
            or (plan and not panel_methods.plan_supported(plan, cfg))):
        return False
    return panel_methods.kernels_available(bool(plan))


def keeps_gguf_blocks(cfg: ArchConfig, plan: QuantPlan, dtype, choice: ServingChoice,
                      one_device: bool) -> bool:
    """Whether a GGUF file's blocks (`plan`, its own) are best served as they are here:
    on the CPU, where the `cpu` backend's quantized kernel multiplies them in place
    (`can_panel`); XLA's CPU matmuls convert int8/4-bit codes far slower than they read
    float32, so elsewhere on the CPU the file is dequantized (BENCHMARKS.md,
    "Quantized matmuls read in place")."""
    return platform() == "cpu" and can_panel(cfg, plan, dtype, choice.backend, one_device)


def _quant_kernel(backend: str) -> str:
    """`quant_matmul`'s implementation on `backend`: Pallas where attention is Pallas."""
    return "pallas" if backend == "pallas" else "xla"


def _linear(plan: QuantPlan, name: str, dtype, backend: str, row_tile: int) -> LinearMethod:
    fmt = plan.get(name)
    if fmt is None:
        return FloatLinear(jnp.dtype(dtype), row_tile)
    if fmt.kind == "fp8":
        return Fp8Linear(fmt, jnp.dtype(dtype), _quant_kernel(backend), row_tile)
    if fmt.kind in FP4_BLOCKS:
        return Fp4Linear(fmt, jnp.dtype(dtype), _quant_kernel(backend), row_tile)
    return QuantLinear(fmt, jnp.dtype(dtype), _quant_kernel(backend), row_tile)


def choose_methods(cfg: ArchConfig, plan: QuantPlan = NO_QUANT, dtype=jnp.float32,
                   choice: ServingChoice | None = None) -> Methods:
    """The methods a model of `cfg`, stored as `plan`, serves with under `choice`
    (default: the plain methods of the platform's default backend).

    Raises:
        ValueError: `choice.panels` for a model that cannot serve from panels (`can_panel`).
    """
    choice = choice or ServingChoice()
    backend, dtype = choice.backend, jnp.dtype(dtype)
    row_tile = tuned("batch_invariant")["row_tile"] if choice.batch_invariant else 0
    if choice.panels and not can_panel(cfg, plan, dtype, backend):
        raise ValueError("packing the weights into panels needs the 'cpu' backend with "
                         "float32, unquantized or q8/q4/fp8/FP4 weights of a dense model on "
                         "one device and the CPU matmul kernels (got "
                         f"backend {backend!r}, dtype {dtype.name}, quantization "
                         f"{plan.to_dict() or None}, {cfg.architecture})")
    head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    names = (*(name for _, name in LAYER_MATMULS), "lm_head")
    mla = MLA_MATMULS if cfg.is_mla else ()
    linears = {name: _linear(plan, name, dtype, backend, row_tile) for name in (*names, *mla)}
    if choice.panels:
        linears.update({name: PanelLinear(plan.get(name)) for name in names
                        if name != "lm_head" or head == "lm_head"})
    for _, name in served_targets(cfg) if choice.lora_impl else ():
        linears[name] = LoRALinear(linears[name], choice.lora_impl)
    fmt = plan.get("embed_tokens")
    if choice.panels and head == "embed_tokens":
        embedding: EmbedMethod = PanelEmbed(fmt)
    elif fmt is None:
        embedding = FloatEmbed(dtype, row_tile)
    else:
        embedding = QuantEmbed(fmt, dtype, _quant_kernel(backend), row_tile)
    experts = tuple((proj, _linear(plan, f"experts.{proj}", dtype, "xla", 0))
                    for proj in EXPERT_PROJECTIONS)
    kv_dtype = jnp.dtype(jnp.float16 if plan.name == "gguf" and backend == "cpu" else dtype)
    return Methods(
        attention=AttentionOps(backend, choice.batch_invariant, choice.attention_ranks),
        linears=tuple(sorted(linears.items())), default=FloatLinear(dtype),
        embedding=embedding, experts=experts,
        grouped=grouped_impl(),
        whole_experts=choice.whole_experts and cfg.is_moe and not cfg.is_mixed,
        lora_whole=choice.lora_impl is not None and not scan_slices_lora(choice.lora_impl),
        kv_dtype=kv_dtype)


def _copy(tree: dict) -> dict:
    return jax.tree_util.tree_map(lambda x: x, tree)  # new dicts, the same leaves


def serving_params(params: dict, methods: Methods) -> dict:
    """The serving form of a standard params tree (new dicts; the input is left as it was):
    the variables {"params": ..., STACKS: ...} when some weight is read from `STACKS`
    (panels, whole experts), else the tree itself."""
    stacks: dict = {}
    rest = _copy(params)
    for parent, name in LAYER_MATMULS:
        method = methods.linear(name)
        if method.stacked:
            leaf = rest["layers"][parent][name]
            std = {k: leaf.pop(k) for k in list(leaf) if k != "bias"}
            stacks.setdefault("layers", {}).setdefault(parent, {})[name] = \
                method.to_serving(std, stacked=True)
            if not leaf:  # no bias left either
                del rest["layers"][parent][name]
                if not rest["layers"][parent]:
                    del rest["layers"][parent]
    if "lm_head" in rest and methods.linear("lm_head").stacked:
        stacks["lm_head"] = methods.linear("lm_head").to_serving(rest.pop("lm_head"), False)
    elif "lm_head" not in rest and methods.embedding.stacked:
        stacks["embed_tokens"] = methods.embedding.to_serving(rest.pop("embed_tokens"))
    if methods.whole_experts and "experts" in rest.get("layers", {}).get("mlp", {}):
        experts = rest["layers"]["mlp"].pop("experts")
        stacks.setdefault("layers", {}).setdefault("mlp", {})["experts"] = experts
    return {"params": rest, STACKS: stacks} if stacks else rest


def _panel_method(leaves: dict, fmt: QuantFormat | None = None) -> PanelLinear:
    """The panel method whose serving form `leaves` are: with the stored format `fmt`
    when known (an fp8 weight's column blocks, which its panels widen to one scale per
    column), else the leaves' kind (q8/q4 groups are read off the leaves' shapes; an fp8
    weight comes back with a scale per column: the same values)."""
    kind = kind_of(leaves)
    if kind is None:
        return PanelLinear()
    if fmt is not None and fmt.kind == kind:
        return PanelLinear(fmt)
    if kind in FP4_BLOCKS:  # the kind fixes the block
        return PanelLinear(QuantFormat(kind, FP4_BLOCKS[kind]))
    return PanelLinear(QuantFormat(kind, block_n=1 if kind == "fp8" else 0,
                                   act_order=PERM in leaves))


def standard_params(params: dict, cfg: ArchConfig, plan: QuantPlan = NO_QUANT) -> dict:
    """The standard params tree of any serving form (`serving_params`' inverse; a
    standard tree is returned as it is). Each weight's method is read off its leaves and
    `plan` (the model's `quant`: an fp8 weight's column blocks), so a
    checkpoint writer needs no `Methods`."""
    if "params" not in params:
        return params
    rest, stacks = _copy(params["params"]), params.get(STACKS, {})
    layers = stacks.get("layers", {})
    for (parent, name), (_, n) in layer_matmul_shapes(cfg).items():
        if name in layers.get(parent, {}):
            leaves = layers[parent][name]
            std = _panel_method(leaves, plan.get(name)).to_standard(leaves, n, stacked=True)
            rest["layers"].setdefault(parent, {}).setdefault(name, {}).update(std)
    if "experts" in layers.get("mlp", {}):
        rest["layers"]["mlp"]["experts"] = layers["mlp"]["experts"]
    if "lm_head" in stacks:
        rest["lm_head"] = _panel_method(stacks["lm_head"], plan.get("lm_head")).to_standard(
            stacks["lm_head"], cfg.vocab_size, stacked=False)
    if "embed_tokens" in stacks:
        table = stacks["embed_tokens"]
        rest["embed_tokens"] = PanelEmbed(_panel_method(
            table, plan.get("embed_tokens")).fmt).to_standard(
            table, cfg.vocab_size)
    return rest


def serving_form(model, **changes):
    """`model` (a `models.model.Model`) with its `ServingChoice` fields changed and its
    params moved into the form the new methods read (the same model when nothing changes;
    params are not copied when their form stays).

    Raises:
        ValueError: A choice the model cannot serve with (`choose_methods`), or an
            unknown backend.
    """
    choice = dataclasses.replace(model.serving, **changes)
    if choice == model.serving:
        return model
    new = dataclasses.replace(model, serving=choice)
    if model.params is not None and new.methods.form != model.methods.form:
        new.params = serving_params(standard_params(model.params, model.cfg, model.quant),
                                    new.methods)
    return new
