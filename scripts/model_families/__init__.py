"""Every family of Transformers' auto mappings, stock against hf_zeropp: ``python -m scripts.model_families``."""
