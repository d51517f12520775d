"""Per-family fixes to the generic shrink rule, and the families this sweep does not build (with the reason).

A fix is a dict of constructor arguments merged over the shrunk ones (sub-configs merged key by key), keyed by
family, then by (head, family) where one head needs more. Each fix restores a constraint between widths or layer
kinds that the generic rule cannot see (an SSM's heads x head width = expanded width, a hybrid's attention layer
placed by period and offset, a mixture of experts with no default expert count).
"""

from __future__ import annotations

_MAMBA2_WIDTHS = {"num_heads": 4, "head_dim": 16, "n_groups": 1}  # hidden 32 x expand 2 = 4 heads x 16
# its sliding-window layers keep the released widths in ``per_layer_config`` (64 heads, 1,024-rank keys and values),
# and its sparse-attention indexer and shared expert have widths of their own
_DOTS3 = {"per_layer_config": {"01": {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16,
                                      "qk_nope_head_dim": 8}},
          "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4, "shared_experts_intermediate_size": 32}
# its attention layers are indexed (QSA) whose indexer widths default to none: one key head, a budget of 4 tokens in
# blocks of 2
_QWEN4_EXP = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
              "indexer_compress_ratio": 2, "hc_lowrank": 8}
_EXPERTS = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}

FIXES: dict = {
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "use_mamba_kernels": False},
    # its hybrid layers share one attention block, so it needs two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 64, "attention_head_dim": 32, "use_mamba_kernels": False},
    "zamba2": {"attention_hidden_size": 64, "attention_head_dim": 32, "num_query_groups": 2, "kv_channels": 16,
               "use_mamba_kernels": False},
    "recurrent_gemma": {"num_hidden_layers": 3, "head_dim": 16},
    "mamba2": _MAMBA2_WIDTHS,
    "deepseek_v2": _EXPERTS,
    "dots1": _EXPERTS,
    "qwen4_exp": _QWEN4_EXP,
    "qwen4_exp_text": _QWEN4_EXP,
    "dots3_note": _DOTS3,
    "dots3_note_text": _DOTS3,
    "lfm2_moe": {"num_hidden_layers": 3, "num_dense_layers": 1,
                 "layer_types": ["conv", "full_attention", "conv"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # the training kernel in chunks of 4; its cache's initial state does not take the heads' query/key and value widths
    "xlstm": {"num_blocks": 2, "embedding_dim": 32, "chunk_size": 4, "mode": "train", "use_cache": False},
    # input, looped and output stages of one layer each; its config lists an "mlp" block after each attention layer,
    # which the rule's kinds take for a layer, so the layer kinds are given one per layer
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 2},
    "t5": {"decoder_start_token_id": 0},
    "bit": {"num_groups": 2},
    # its stages' channels are lists of their own, which the classifier's width (the last hidden size) must match
    "hgnet_v2": {"stem_channels": [3, 8, 8], "stage_in_channels": [8, 16, 32, 64],
                 "stage_mid_channels": [8, 16, 16, 32], "stage_out_channels": [16, 32, 64, 128],
                 "stage_num_blocks": [1, 1, 1, 1], "stage_numb_of_layers": [2, 2, 2, 2]},
    # its transformer widths must divide by the heads (the rule's division of 144, 192, 240 leaves 21); its convolution
    # widths are a second list; a 64-pixel image keeps every stage's patches whole
    "mobilevit": {"hidden_sizes": [16, 24, 32], "neck_hidden_sizes": [8, 16, 24, 32, 40, 48, 64], "image_size": 64},
    "textnet": {"stem_out_channels": 16, "image_size": 64},  # its stem feeds the first stage: the first hidden size
    # its image tower is an EfficientNet scaled by width and depth coefficients the rule does not see: at width 0.1 its
    # last stage gives the projection width (32), at depth 1 each stage has one block
    "align": {"vision_config": {"image_size": 32, "width_coefficient": 0.1, "depth_coefficient": 1.0,
                                "num_block_repeats": [1, 1, 1, 1, 1, 1, 1]}},
    # its image tower is a backbone whose output stage names its last layer; 16 patches of 14 pixels
    "tipsv2": {"vision_config": {"out_features": ["stage2"], "out_indices": [2], "image_size": 56}},
    "videoprism": {"vision_config": {"num_frames": 2, "image_size": 36}},  # 2 frames of 2 x 2 tubelets of 18 pixels
    "efficientnet": {"hidden_dim": 2560, "image_size": 64},
    # latents and their self-attention stack; the masked-LM decoder predicts every position up to the maximum
    "perceiver": {"num_latents": 8, "d_latents": 32, "num_self_attends_per_block": 2, "num_self_attention_heads": 2,
                  "num_cross_attention_heads": 1, "max_position_embeddings": 8, "image_size": 16},
    "switch_transformers": {"num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1},  # else no expert layer
    ("causal-lm", "reformer"): {"is_decoder": True},
    # its cache is built from a top-level layer count the config does not have (a training step needs no cache); its
    # towers keep their default head width and global width unless given, which the shrunk widths must match; its
    # hashed byte-group embeddings (500,002 rows each) are a vocabulary the rule does not see
    "blt": {"use_cache": False, "encoder_hash_byte_group_vocab": 512, "patcher_config": {"head_dim": 16},
            "global_config": {"head_dim": 16}, "encoder_config": {"hidden_size_global": 32},
            "decoder_config": {"head_dim": 16, "hidden_size_global": 32}},
    # its rotary embedding reads one RoPE setting per layer kind, and the default config gives none
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # its attention reads a RoPE base from the attention sub-config, which the default one does not carry, and clamps
    # queries, keys and values to a bound that defaults to none (the released checkpoints clip at 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # its per-layer K/V sources are layer indices kept as values, which the rule does not renumber: three layers, the
    # last reading the K/V of the indexed layer before it; its expert count is saved under an alias the rule skips
    "kolibri1_1": {"num_experts": 4, "num_hidden_layers": 3,
                   "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"],
                   "index_layers": [1], "kv_source_layers": [0, 1, 1], "mlp_only_layers": [0]},
    "longcat_flash": {"head_dim": 8},  # its rotary width: the rotated part of a query/key head (qk_rope_head_dim)
    # no default vocabulary nor padding id (its positions count from the padding id): those of the released protein
    # models
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    # its diarization head reads the audio encoder's width, saved apart in the head's config; its language model saves
    # its 52 layers as kinds only (no count for the rule to cut), one of each kind kept, and its shared expert's width
    "nemo_speechlm": {"audio_config": {"diarization_config": {"head_config": {"audio_hidden_size": 32}}},
                      "text_config": {"layers_block_type": ["linear_attention", "moe", "full_attention"],
                                      "moe_shared_expert_intermediate_size": 32}},
    # its layout embedding concatenates four coordinates and two sizes, which must add up to the hidden width
    "layoutlmv3": {"coordinate_size": 4, "shape_size": 8},
    "lilt": {"hidden_size": 48},  # six layout embeddings of a sixth of the width each: a width divisible by 6
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [2, 4], "max_position_embeddings": 8,
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2},
}


def _first_language(model) -> None:
    model.set_default_language(model.config.languages[0])


AFTER_BUILD: dict = {"xmod": _first_language}  # what a family's users call on a built model before training

_NEEDS = "needs the {} package (on PyPI, not among this project's dependencies)"
_DRAFT = ("a draft model for assisted decoding: it reads its target model's input embeddings and key/value states, "
          "and returns logits, no loss")
NOT_BUILT: dict = {
    "gemma3n": _NEEDS.format("timm"), "timm_wrapper": _NEEDS.format("timm"), "dinat": _NEEDS.format("natten"),
    "layoutlmv2": "needs the detectron2 package, which is not on PyPI (built from its source)",
    ("image-cls", "shieldgemma2"): "a safety classifier: it returns yes/no probabilities for a prompt with image "
                                   "tokens, no loss",
    ("contrastive", "blip-2"): "an image-text retrieval head: it returns matching scores or similarities, no loss",
    ("image-cls", "pp_lcnet"): "its classification head returns logits only: it computes no loss from labels",
    "gemma4_assistant": _DRAFT, "gemma4_unified_assistant": _DRAFT,
}
