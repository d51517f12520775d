"""Tiny configs derived from each family's defaults: a generic shrink rule over the config's constructor arguments, then
per-family fixes where the rule alone leaves a config the model cannot build or run.

The rule passes only the arguments it changes to the config class, so the values a config derives in its constructor
(Swin's ``num_layers`` from ``depths``, a default ``head_dim``, a default ``layer_types``) are derived again from the
small ones. Sub-configs (a vision and a text tower, an encoder and a decoder) are shrunk the same way, recursively.
"""

from __future__ import annotations

import inspect

LAYERS = 2
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 64
VOCAB = 512
EXPERTS = 4

LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
              "num_encoder_layers", "num_decoder_layers", "depth", "text_layers", "vision_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim", "n_embed",
               "embedding_dim", "model_dim", "hidden_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
             "num_heads", "attention_heads")
INTERMEDIATE_KEYS = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff",
                     "ffn_hidden_size", "mlp_dim", "feed_forward_size", "hidden_dim_ffn")
SMALL = {  # each a width the generic rule sets outright, where the default is larger
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "v_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM // 2,
    "qk_rope_head_dim": HEAD_DIM // 2, "qk_head_dim": HEAD_DIM, "kv_lora_rank": HEAD_DIM, "q_lora_rank": HEAD_DIM,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": HEADS,
    "linear_num_value_heads": 2 * HEADS, "moe_intermediate_size": HIDDEN, "shared_expert_intermediate_size": HIDDEN,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "projection_size": HIDDEN, "num_patches": 16, "moe_topk": 2, "top_k": 2,
    "num_experts_per_token": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "projection_dim": HIDDEN, "embedding_size": HIDDEN, "state_size": 8,
    "mamba_d_state": 8, "ssm_state_size": 8, "mamba_n_heads": 4, "n_mamba_heads": 4, "mamba_head_dim": HEAD_DIM,
    "intermediate_size_mlp": INTERMEDIATE, "num_global_key_value_heads": 1, "global_head_dim": HEAD_DIM,
    "attention_head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "num_key_value_groups": 1, "rotary_dim": HEAD_DIM // 2,
    "rotary_emb_base_dim": HEAD_DIM // 2, "moe_k": 2, "moe_num_shared_experts": 1, "time_step_rank": 8,
    "mamba_dt_rank": 8, "mamba_d_head": HEAD_DIM, "mamba_headdim": HEAD_DIM, "laurel_rank": 8, "adapter_rank": 8,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "lru_width": HIDDEN, "zero_expert_num": 2,
    "expert_ffn_hidden_size": HIDDEN, "num_kv_shared_layers": 0, "index_num_heads": 1,
    "mlp_only_intermediate_size": HIDDEN,
}
TYPE_KEYS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types")  # per-layer kinds, first found
KEY_VALUE_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")


def constructor_arguments(config_class) -> set[str]:
    return set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}


def _kept_layers(types: list) -> list[int]:
    """The first layer of each distinct type, in order (at least ``LAYERS`` layers): every kind of layer stays."""
    kept: list[int] = []
    for index, kind in enumerate(types):
        if kind not in [types[i] for i in kept]:
            kept.append(index)
    kept += [i for i in range(len(types)) if i not in kept][:max(0, LAYERS - len(kept))]
    return sorted(kept)


def _per_layer(key: str, value, layers: int, kept: list[int]):
    """``value`` for the kept layers when it describes each layer (a list as long as the model, a dict keyed by layer
    index) or names layers (a list of indices); ``None`` when it does neither."""
    if isinstance(value, list) and len(value) == layers:
        return [value[i] for i in kept]
    if isinstance(value, dict) and value and all(str(k).isdigit() and int(k) < layers for k in value):
        return {type(k)(f"{kept.index(int(k)):0{len(str(k))}d}") if isinstance(k, str) else kept.index(k): v
                for k, v in value.items() if int(k) in kept}
    names_layers = key.endswith(("_layers", "_layer_ids", "_layer_indices", "_indices"))
    if names_layers and isinstance(value, list) and value and all(type(i) is int and 0 <= i < layers for i in value):
        moved = [kept.index(i) for i in value if i in kept]
        return moved or [len(kept) - 1]  # a kind of layer the model names stays, on its last layer
    return None


def _shrunk_int(key: str, value: int) -> int | None:
    for keys, limit in ((LAYER_KEYS, LAYERS), (HIDDEN_KEYS, HIDDEN), (HEAD_KEYS, HEADS),
                        (INTERMEDIATE_KEYS, INTERMEDIATE)):
        if key in keys:
            return min(value, limit)
    if key in SMALL:
        return min(value, SMALL[key])
    if key == "vocab_size" or key.endswith("_vocab_size") and value > VOCAB:
        return min(value, VOCAB)
    return None


def _small_token_ids(value, vocab: int, moved: dict[int, int]):
    """A special token id at or past the small vocabulary moves to one of its last ids (one per distinct id)."""
    if isinstance(value, list):
        return [_small_token_ids(v, vocab, moved) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
        return moved.setdefault(value, vocab - 1 - len(moved))
    return value


def shrink(config_class, defaults: dict | None = None) -> dict:
    """Constructor arguments for a tiny ``config_class``: the defaults' changed values only, sub-configs as dicts."""
    defaults = defaults if defaults is not None else config_class().to_dict()
    names = constructor_arguments(config_class)
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    out: dict = {}
    layers = defaults.get("num_hidden_layers")
    for key, value in defaults.items():
        if key in sub_configs and isinstance(value, dict):
            sub_class = _sub_config_class(sub_configs[key], value)
            if sub_class is not None:
                out[key] = {**value, **shrink(sub_class, value)}
            continue
        if key not in names or isinstance(value, bool):
            continue
        if value is None and key in ("head_dim", "num_key_value_heads"):  # derived at full size by some models
            out[key] = HEAD_DIM if key == "head_dim" else HEADS
        elif isinstance(value, int) and key in KEY_VALUE_HEAD_KEYS:
            heads = next((defaults[k] for k in HEAD_KEYS if isinstance(defaults.get(k), int)), None)
            small = HEADS if value == heads else 1  # multi-head stays multi-head; grouped or multi-query: one group
            if small != value:
                out[key] = small
        elif isinstance(value, int):
            small = _shrunk_int(key, value)
            if small is not None and small != value:
                out[key] = small
        elif isinstance(value, float) and "drop" in key and value > 0:
            out[key] = 0.0
        elif key in ("depths", "num_heads", "hidden_sizes", "embed_dims", "dims", "hidden_dims", "encoder_hidden_sizes",
                     "num_attention_heads", "neck_hidden_sizes") and isinstance(value, (list, tuple)) and value:
            out[key] = _shrunk_list(key, list(value))
    types = next((defaults[k] for k in TYPE_KEYS if isinstance(defaults.get(k), list) and len(defaults[k]) == layers),
                 None)
    if isinstance(layers, int) and types:
        kept = _kept_layers(types)
    else:
        kept = list(range(out.get("num_hidden_layers", layers))) if isinstance(layers, int) else []
    if isinstance(layers, int) and len(kept) != layers:
        out["num_hidden_layers"] = len(kept)
        for key, value in defaults.items():  # what describes or names layers follows the kept ones
            small = _per_layer(key, value, layers, kept) if key not in ("id2label", "label2id") else None
            if small is not None:
                out[key] = small
    vocab = out.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        moved: dict[int, int] = {}
        for key, value in defaults.items():
            if key in names and (key.endswith("token_id") or key.endswith("token_index") or key.endswith("token_ids")):
                small = _small_token_ids(value, vocab, moved)
                if small != value:
                    out[key] = small
    return out


def _sub_config_class(declared, value: dict):
    """The class a sub-config's dict builds: the declared one, or for an ``AutoConfig`` slot its ``model_type``'s."""
    if isinstance(declared, type) and declared.__name__ != "AutoConfig":
        return declared
    from transformers import CONFIG_MAPPING

    model_type = value.get("model_type")
    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def _shrunk_list(key: str, values: list) -> list:
    if key == "depths":
        return [min(v, 1) if isinstance(v, int) else v for v in values]
    if key in ("num_heads", "num_attention_heads"):
        return [min(v, HEADS) if isinstance(v, int) else v for v in values]
    first = values[0] if isinstance(values[0], int) else None
    if not first or first <= 16:
        return values
    factor = max(1, first // 16)
    return [max(HEADS, v // factor) if isinstance(v, int) else v for v in values]
