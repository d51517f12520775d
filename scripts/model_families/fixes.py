"""Per-family fixes to the generic shrink rule, and the families this sweep does not build (with the reason).

A fix is a dict of constructor arguments merged over the shrunk ones (sub-configs merged key by key), keyed by
family, then by (head, family) where one head needs more. Each fix restores a constraint between widths or layer
kinds that the generic rule cannot see (an SSM's heads x head width = expanded width, a hybrid's attention layer
placed by period and offset, a mixture of experts with no default expert count).
"""

from __future__ import annotations

_MAMBA2_WIDTHS = {"num_heads": 4, "head_dim": 16, "n_groups": 1}  # hidden 32 x expand 2 = 4 heads x 16
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
    "lfm2_moe": {"num_hidden_layers": 3, "num_dense_layers": 1,
                 "layer_types": ["conv", "full_attention", "conv"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "xlstm": {"num_blocks": 2, "embedding_dim": 32, "chunk_size": 4, "mode": "train", "return_last_states": False},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 2},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "t5": {"decoder_start_token_id": 0},
    "bit": {"num_groups": 2},
    "efficientnet": {"hidden_dim": 2560, "image_size": 64},
    # latents and their self-attention stack; the masked-LM decoder predicts every position up to the maximum
    "perceiver": {"num_latents": 8, "d_latents": 32, "num_self_attends_per_block": 2, "num_self_attention_heads": 2,
                  "num_cross_attention_heads": 1, "max_position_embeddings": 8, "image_size": 16},
    "switch_transformers": {"num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1},  # else no expert layer
    ("causal-lm", "reformer"): {"is_decoder": True},
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [2, 4], "max_position_embeddings": 8,
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2},
}


def _first_language(model) -> None:
    model.set_default_language(model.config.languages[0])


AFTER_BUILD: dict = {"xmod": _first_language}  # what a family's users call on a built model before training

_NEEDS = "needs the {} package, not among this project's dependencies"
NOT_BUILT: dict = {
    "gemma3n": _NEEDS.format("timm"), "timm_wrapper": _NEEDS.format("timm"), "dinat": _NEEDS.format("natten"),
    "layoutlmv2": _NEEDS.format("detectron2"),
    ("image-cls", "imagegpt"): "reads an image as colour-cluster token ids, not pixel values",
    ("contrastive", "videoprism"): "a video model: it needs video frames",
    ("image-cls", "shieldgemma2"): "a vision-language model: it needs a text prompt with image tokens",
    ("seq2seq", "voxtral_realtime"): "a speech model: it needs audio features",
    "musicgen": "an audio-code decoder: its inputs and labels are codes of several codebooks per step",
    "musicgen_melody": "an audio-code decoder: its inputs and labels are codes of several codebooks per step",
    ("causal-lm", "git"): "a vision-language model: it needs pixel values with its text",
}
