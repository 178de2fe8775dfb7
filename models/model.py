"""A loaded model: architecture config, Flax decoder, parameters, and its source."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.decoder import Decoder
from models.gated_deltanet import HybridCache, state_bytes_per_slot, state_shapes
from models.gemma4_heads import broadcast_heads, global_heads_init
from models.hybrid import broadcast_mixers, hybrid_init
from models.kv_groups import KVGroupLayout, single_group
from models.linear import Methods, ServingChoice, choose_methods, forward_context
from models.lora import COLLECTION as LORA
from models.mixed import broadcast_mlp, mixed_init
from models.moe_parallel import ExpertSharding
from models.quant import NO_QUANT, QuantPlan, quantize_params
from pallas_kernels import AttentionMetadata, kv_pages_shape
from pallas_kernels.metadata import latent_pages_shape

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_INIT_CHOICE = ServingChoice("xla")  # init makes the standard leaves, whatever serves them


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    """Maps "float32"/"bfloat16" (or the dtype itself) to a JAX dtype; ValueError otherwise."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"unsupported dtype {jnp.dtype(dtype).name}; choose one of "
                         f"{', '.join(DTYPES)}")
    return jnp.dtype(dtype)


def pool_shape(cfg: ArchConfig, num_slots: int, num_pages: int, page_size: int
               ) -> tuple[int, ...]:
    """The page pool's shape for `cfg`: K and V per head (`kv_pages_shape`), or one latent
    row per token with multi-head latent attention (`latent_pages_shape`, `models.mla`)."""
    if cfg.is_mla:
        return latent_pages_shape(num_slots, num_pages, page_size, cfg.latent_dim)
    heads, head_dim = cfg.kv_pool_heads
    return kv_pages_shape(num_slots, heads, num_pages, page_size, head_dim)


def _init_fn(cfg: ArchConfig, dtype, quant: QuantPlan = NO_QUANT):
    """A function of an RNG key that initialises every parameter (LM head included)."""
    if cfg.is_mixed:  # two MLP stacks of their own (`models.mixed`)
        return mixed_init(cfg, lambda c: _init_fn(c, dtype, quant))
    if cfg.has_global_heads:  # two attention stacks of their own (`models.gemma4_heads`)
        return global_heads_init(cfg, lambda c: _init_fn(c, dtype, quant))
    # NOTE: the standard layout's methods (XLA's; the attention is never traced in init).
    dtype = parse_dtype(dtype)
    module = Decoder(cfg, dtype, choose_methods(cfg, quant, dtype, _INIT_CHOICE))

    def forward_and_logits(mdl, input_ids, positions, kv_pages, md):
        # NOTE: compute_logits must run too: a setup-defined lm_head only gets params when
        # it is called.
        kv_pages, hidden = mdl(input_ids, positions, kv_pages, md)
        return kv_pages, mdl.compute_logits(hidden)

    def init(key):
        # NOTE: the dummy inputs are made inside, so under `eval_shape` nothing is ever
        # placed on a device (`abstract_params` runs under a transfer guard too).
        md = AttentionMetadata(slot_mapping=jnp.zeros(1, jnp.int32),
                               block_tables=jnp.zeros((1, 1), jnp.int32),
                               kv_lens=jnp.ones(1, jnp.int32),
                               cu_q_lens=jnp.arange(2, dtype=jnp.int32))
        kv = jnp.zeros(pool_shape(cfg, cfg.num_layers, 2, 1), dtype)
        return module.init(key, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), kv, md,
                           method=forward_and_logits)["params"]

    # A hybrid's init makes both token mixers in every layer; each stack keeps its layers.
    return hybrid_init(cfg, init) if cfg.has_linear_attention else init


def abstract_params(cfg: ArchConfig, dtype, quant: QuantPlan = NO_QUANT) -> dict:
    """The params tree as `jax.ShapeDtypeStruct`s, without allocating anything (a tree of
    the caller's own: the traced one is kept per (cfg, dtype, quant))."""
    return jax.tree.map(lambda leaf: leaf, _abstract_params(cfg, parse_dtype(dtype), quant))


@functools.lru_cache(maxsize=16)
def _abstract_params(cfg: ArchConfig, dtype: jnp.dtype, quant: QuantPlan) -> dict:
    # NOTE: a trace of the whole model's init (a large part of a second): each load and
    # each `update_weights` asks for it, an engine built twice in a process (tests, a
    # training loop's evaluations) once per model kind.
    return jax.eval_shape(lambda: _init_fn(cfg, dtype, quant)(jax.random.key(0)))


def random_params(cfg: ArchConfig, dtype="float32", seed: int = 0,
                  quant: QuantPlan = NO_QUANT) -> dict:
    """Randomly initialised params (Flax default initialisers), for tests and benchmarks;
    with a `quant` plan, the random float weights quantized by it."""
    params = jax.jit(_init_fn(cfg, dtype))(jax.random.key(seed))
    return jax.device_put(quantize_params(params, quant)) if quant else params


def variables(params: dict) -> dict:
    """The Flax variables of a `Model.params`: the "params" collection's tree, or already
    the variables dict (a serving form with `STACKS`); a mixed mixture of
    experts' MLP stacks moved to the collection the layer scan broadcasts
    (`models.mixed.broadcast_mlp`), and so a linear-attention hybrid's mixer stacks
    (`models.hybrid.broadcast_mixers`) and the attention stacks of a model with global
    heads (`models.gemma4_heads.broadcast_heads`)."""
    tree = params if "params" in params else {"params": params}
    return broadcast_heads(broadcast_mixers(broadcast_mlp(tree)))


@dataclasses.dataclass
class Model:
    """A decoder with its weights.

    Attributes:
        cfg: Architecture config.
        params: Parameter tree (see `abstract_params` for its structure), or, in a
            serving form that reads weights from `models.linear.STACKS` (panels, whole
            experts: `models.linear.serving_params`), the whole variables dict
            {collection: tree}.
        dtype: Parameter/activation dtype.
        source: Where the weights came from (path), for logs and errors.
        quant: How the standard layout stores each weight (`models.quant`).
        serving: What the methods are chosen from (`models.linear.ServingChoice`: the
            attention kernels, the serving forms, batch invariance, LoRA); None: the
            platform's defaults, no serving form. `params` must be in the form it asks for
            (`models.linear.serving_form` moves them).
        kv_layout: Its KV cache groups (`models.kv_groups`): with several, the pool holds
            `kv_layout.num_slots` layers per page and each step carries a block table per
            group. None: one group (the pool holds every layer, slot = layer; with
            linear-attention layers, every full-attention layer: `ArchConfig.attention_layers`).
        expert_sharding: How the device mesh splits the routed experts of a mixture of
            experts (`models.moe_parallel`; set by the runner from its tensor-parallel
            layout). None: one device, or the experts replicated.
        checkpoint_bytes: Bytes of the weight tensors in the files it was read from (a
            safetensors directory's, set by `models.loaders.load_model`); 0 where not
            measured (GGUF files, orbax checkpoints, models built in memory).

    Raises:
        ValueError: A `kv_layout` that does not fit the model (`check_kv_layout`; several
            groups with linear-attention layers), or a serving choice it cannot be served
            with (`models.linear.choose_methods`).
    """

    cfg: ArchConfig
    params: dict
    dtype: jnp.dtype = jnp.float32
    source: str = ""
    quant: QuantPlan = NO_QUANT
    serving: ServingChoice | None = None
    kv_layout: KVGroupLayout | None = None
    expert_sharding: ExpertSharding | None = None
    checkpoint_bytes: int = 0

    def __post_init__(self):
        self.serving = self.serving or ServingChoice()
        if self.kv_layout is not None:
            check_kv_layout(self.kv_layout, self.cfg)
            if self.kv_layout.is_hybrid and self.cfg.has_linear_attention:
                raise ValueError(f"kv_layout has {self.kv_layout.num_groups} KV cache groups; "
                                 "a model with linear-attention layers keeps one")
        self.methods: Methods = choose_methods(self.cfg, self.quant, self.dtype, self.serving)
        self.module = Decoder(self.cfg, self.dtype, self.methods,
                              self.kv_layout if self.is_hybrid else None, self.expert_sharding)

    @property
    def kv_groups(self) -> KVGroupLayout:
        """The KV cache layout the model serves with (one group when none was given; its
        layers are the full-attention ones)."""
        return self.kv_layout or single_group(len(self.cfg.attention_layers))

    @property
    def kv_dtype(self) -> jnp.dtype:
        """The dtype of KV pages under `kv_cache_dtype="auto"` (`Methods.kv_dtype`: the
        model dtype, or llama.cpp's float16 for a GGUF file's blocks served on the CPU)."""
        return self.methods.kv_dtype

    @property
    def is_hybrid(self) -> bool:
        """Whether steps carry a block table per KV cache group (several groups)."""
        return self.kv_layout is not None and self.kv_layout.is_hybrid

    def forward(self, params, input_ids, positions, kv_pages, md: AttentionMetadata,
                lora: dict | None = None, lora_slots: jax.Array | None = None,
                routing: bool = False, aux_layers: tuple[int, ...] = (),
                mm_embeds: tuple | None = None, rope_positions: jax.Array | None = None):
        """Pure forward (jit-able): returns (kv_pages, hidden[num_tokens, hidden_size]);
        `kv_pages` is the page pool, or with linear-attention layers a
        `models.gated_deltanet.HybridCache` (pages and state pools; `md.state_slots` each
        request's slot), returned updated;
        with `routing`, (kv_pages, hidden, i32[num_tokens, num_layers, top_k]): each
        token's routed experts per layer, the router's heaviest first (-1 on a mixed
        model's dense layers). `routing` is static: without it the program is unchanged.
        With `aux_layers` (static), [num_tokens, n, hidden_size] the residual stream
        entering each of those layers (an EAGLE-3 head's inputs) comes after hidden.

        `lora` (the adapter slots' stacks, `models.lora.COLLECTION`'s tree) and
        `lora_slots` (i32[num_tokens], each token's slot, -1 none) add every token's LoRA
        update; None: the base model alone. The step's real tokens (`md.num_real_tokens`;
        the rest is padding) and the slots reach the linear methods through the forward
        context (`models.linear.context`).

        `mm_embeds` (rows [N, hidden], i32[num_tokens] each token's row or -1): the rows
        that stand in for image placeholders' embeddings (`Decoder.__call__`);
        `rope_positions` (i32[3, num_tokens]) a multimodal rotary's position rows.

        Raises:
            ValueError: Adapter stacks for a model not served with LoRA
                (`ServingChoice.lora_impl` None: no method would read them), or
                `routing` on a model without a mixture of experts.
        """
        if routing and not self.cfg.is_moe:
            raise ValueError(f"routed experts were asked of {self.source or 'a model'}, "
                             "which has no mixture-of-experts layers")
        var = variables(params)
        if lora is not None:
            if self.serving.lora_impl is None:
                raise ValueError("Model.forward got LoRA stacks, but the model is not served "
                                 "with adapters: set ServingChoice.lora_impl "
                                 "(models.linear.serving_form(model, lora_impl=...))")
            var = {**var, LORA: lora}
        with forward_context(real_rows=md.num_real_tokens,
                             lora_slots=None if lora is None else lora_slots):
            module = self.module
            if routing or aux_layers:
                module = module.clone(capture_routing=routing, aux_layers=tuple(aux_layers))
            return module.apply(var, input_ids, positions, kv_pages, md, mm_embeds,
                                rope_positions)

    def compute_logits(self, params, hidden):
        """Pure LM head (jit-able): f32[num_rows, vocab_size]."""
        return self.module.apply(variables(params), hidden, method=Decoder.compute_logits)

    @property
    def weight_bytes(self) -> int:
        """Bytes the parameters occupy (codes, scales and dense leaves together)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.params))

    def weights_report(self) -> str:
        """The served weight format and its device bytes, beside the checkpoint's weight
        tensors' bytes where they were measured: "gptq: 3.21 MiB on the device, 3.05 MiB
        in the checkpoint (x1.05)" (the startup log's and `jaxserve verify`'s line)."""
        report = f"{self.quant.name}: {self.weight_bytes / 2**20:.2f} MiB on the device"
        if self.checkpoint_bytes:
            report += (f", {self.checkpoint_bytes / 2**20:.2f} MiB in the checkpoint "
                       f"(x{self.weight_bytes / self.checkpoint_bytes:.2f})")
        return report

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layers keep a recurrent state per request instead of pages (its
        cache is a `HybridCache`; each step's metadata carries `state_slots`)."""
        return self.cfg.has_linear_attention

    def state_shapes(self, num_slots: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The state pools of `num_slots` request slots (slot 0 the null slot), as
        `HybridCache` holds them: {"conv": f32[L_lin, S, W - 1, C], "recurrent":
        f32[L_lin, S, Hv, dk, dv]}; {} for a model without linear-attention layers."""
        return state_shapes(self.cfg, num_slots) if self.has_linear_attention else {}

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes one request's state slot takes over every linear layer (0 without any): the
        whole slot; under tensor parallelism each device holds 1 / size of it (the pools
        split by heads, `TensorParallel.state_shardings`)."""
        return state_bytes_per_slot(self.cfg) if self.has_linear_attention else 0

    def empty_cache(self, num_pages: int, page_size: int, num_state_slots: int = 0,
                    kv_dtype=None):
        """A zeroed cache: the page pool (`kv_pages_shape`, in `kv_dtype`, default the
        model's KV dtype) or, with linear-attention layers, a `HybridCache` of it and
        `num_state_slots` state slots.

        Raises:
            ValueError: A hybrid asked for fewer than 2 state slots (slot 0 is null).
        """
        pages = jnp.zeros(self.kv_pages_shape(num_pages, page_size), kv_dtype or self.kv_dtype)
        if not self.has_linear_attention:
            return pages
        if num_state_slots < 2:
            raise ValueError(f"num_state_slots={num_state_slots}: a model with "
                             "linear-attention layers needs the null slot and at least one")
        shapes = self.state_shapes(num_state_slots)
        return HybridCache(pages, *(jnp.zeros(s.shape, s.dtype) for s in
                                    (shapes["conv"], shapes["recurrent"])))

    def kv_pages_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """Shape of this model's page pool for `num_pages` pages of `page_size` slots (one
        layer per slot: all layers with one KV cache group, `kv_layout.num_slots` with
        several); with latent attention (`ArchConfig.is_mla`) the latent pool, one row of
        `latent_dim` values per token and layer (`latent_pages_shape`)."""
        return pool_shape(self.cfg, self.kv_groups.num_slots, num_pages, page_size)


def check_kv_layout(layout: KVGroupLayout, cfg: ArchConfig) -> None:
    """Checks that a KV cache layout fits a model.

    Raises:
        ValueError: Another layer count than the model's, a slot or group out of range,
            two layers of a group on one slot, or a layer in a sliding group whose window
            is shorter than the layer's (the group would give back pages it still reads).
    """
    n = len(cfg.attention_layers)
    if layout.num_layers != n:
        raise ValueError(f"kv_layout maps {layout.num_layers} layers; the model has {n} "
                         "that attend")
    if not 1 <= layout.num_slots <= n:
        raise ValueError(f"kv_layout.num_slots={layout.num_slots} must be in [1, {n}]")
    seen = set()
    for layer, (group, slot) in enumerate(zip(layout.layer_group, layout.layer_slot,
                                              strict=True)):
        if not 0 <= group < layout.num_groups or not 0 <= slot < layout.num_slots:
            raise ValueError(f"kv_layout: layer {layer} has group {group} / slot {slot}, "
                             f"outside {layout.num_groups} groups of {layout.num_slots} slots")
        if (group, slot) in seen:
            raise ValueError(f"kv_layout: layer {layer} shares slot {slot} of group {group} "
                             "with another layer")
        seen.add((group, slot))
        kept, own = layout.windows[group], cfg.layer_windows[cfg.attention_layers[layer]]
        if kept < 0 and own != kept:
            raise ValueError(f"kv_layout: layer {layer} (window {own}) is in group {group}, "
                             f"which keeps only chunks of {-kept} tokens")
        if kept > 0 and not 0 < own <= kept:
            raise ValueError(f"kv_layout: layer {layer} (window {own or 'none'}) is in group "
                             f"{group}, which keeps only the last {kept} tokens")
