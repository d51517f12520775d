"""The representative slice the CI runs (tests/conformance/test_model_families.py) and ZeRO++ sweeps: every head, dense and
mixture-of-experts decoders (Switch's experts as separate modules, which the ranks' tokens reach differently), sliding-window, linear-attention and state-space layers, shared (ALBERT) and tied
weights (one across units: BERT's, BART's), an empty weight (MobileBERT's), an embedding called alone (ModernVBERT),
embeddings and heads in a container, one per codebook (MusicGen),
encoder-decoders, convolutional and windowed vision models, and the contrastive towers with their 0-d or 1-element
parameters."""

CI_SLICE = [
    ("causal-lm", "llama"), ("causal-lm", "gpt2"), ("causal-lm", "mixtral"), ("causal-lm", "qwen3_moe"),
    ("causal-lm", "deepseek_v3"), ("causal-lm", "gemma3_text"), ("causal-lm", "qwen3_next"), ("causal-lm", "mamba"),
    ("causal-lm", "phi3"), ("causal-lm", "gpt_neox"), ("causal-lm", "bloom"), ("causal-lm", "opt"),
    ("causal-lm", "musicgen"),
    ("masked-lm", "bert"), ("masked-lm", "albert"), ("masked-lm", "mobilebert"), ("masked-lm", "modernvbert"),
    ("seq2seq", "t5"), ("seq2seq", "bart"), ("seq2seq", "marian"), ("seq2seq", "switch_transformers"),
    ("seq-cls", "llama"), ("seq-cls", "bart"), ("seq-cls", "xlnet"),
    ("image-cls", "vit"), ("image-cls", "resnet"), ("image-cls", "convnext"), ("image-cls", "swin"),
    ("contrastive", "clip"), ("contrastive", "siglip"), ("contrastive", "siglip2"), ("contrastive", "blip"),
]
