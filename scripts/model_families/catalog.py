"""The families of Transformers' auto mappings, by head, and how to build each tiny with a batch its head trains on."""

from __future__ import annotations

import torch

from .fixes import AFTER_BUILD, FIXES, NOT_BUILT
from .tiny import VOCAB, shrink

# head -> the auto mapping that lists its families (model type -> class name)
MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "contrastive": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
LABELS = 3
CAPTIONERS = {"git"}  # language models listed as causal LMs that read an image with their text
AUDIO_CODES = {"musicgen_decoder", "musicgen_melody_decoder"}  # decoders of audio codes, several codebooks per step
SPEECH = {"voxtral_realtime"}  # speech-to-text models whose audio frames line up with the text tokens
VIDEO = {"videoprism"}  # contrastive video-text models
TOKEN_IMAGES = {"imagegpt"}  # image classifiers that read an image as colour-cluster token ids, not pixel values
BATCH, LENGTH, TARGET_LENGTH = 2, 8, 6


def _mapping(head: str) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, MAPPINGS[head])


def entries() -> list[tuple[str, str]]:
    """Every (head, family) pair of the mappings, in mapping order."""
    return [(head, family) for head in MAPPINGS for family in _mapping(head)]


def model_class(head: str, family: str):
    import transformers

    name = _mapping(head)[family]
    return getattr(transformers, name[0] if isinstance(name, tuple) else name)


def tiny_config(head: str, family: str):
    """The family's default config, shrunk, with its fixes; a classification head gets ``LABELS`` labels."""
    from transformers import CONFIG_MAPPING

    if (head, family) in NOT_BUILT or family in NOT_BUILT:
        raise NotBuilt(NOT_BUILT.get((head, family)) or NOT_BUILT[family])
    declared = getattr(model_class(head, family), "config_class", None)  # a text model of a multimodal family
    config_class = declared if isinstance(declared, type) and declared.__name__ != "PretrainedConfig" \
        else CONFIG_MAPPING[family]
    arguments = shrink(config_class)
    for fix in (FIXES.get(family), FIXES.get((head, family))):
        arguments = _merged(arguments, fix or {})
    if head in ("seq-cls", "image-cls"):
        arguments["num_labels"] = LABELS
    config = config_class(**arguments)
    if head == "seq-cls" and getattr(_text(config), "pad_token_id", None) is None:
        _text(config).pad_token_id = 0  # a batch of several sequences needs one; the batch never holds id 0
        config.pad_token_id = 0
    return config


def _merged(base: dict, fix: dict) -> dict:
    out = dict(base)
    for key, value in fix.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) and key.endswith("_config") else value
    return out


class NotBuilt(Exception):
    """A family this sweep does not build (the reason names what it would need)."""


def build(head: str, family: str, config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_class(head, family)(config)
    model.train()
    if family in AFTER_BUILD:
        AFTER_BUILD[family](model)
    return model


def _text(config):
    return getattr(config, "text_config", None) or getattr(config, "encoder", None) or config


def _vision(config):
    return getattr(config, "vision_config", None) or config


def batch(head: str, config, rank: int) -> dict:
    """Rank ``rank``'s micro-batch: token ids clear of the special ids (the low ones and the vocabulary's last ones,
    where the shrink rule moved the others), pixel values of the configured size, labels as the head needs; the
    families of the sets above get the inputs they read instead or besides (video frames, audio codes or features)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    out: dict = {}
    token_image = config.model_type in TOKEN_IMAGES
    if head != "image-cls" or token_image:
        vocab = getattr(_text(config), "vocab_size", None) or VOCAB
        high = max(8, min(vocab, VOCAB) - 16)
        out["input_ids"] = torch.randint(4, high, (BATCH, LENGTH), generator=generator)
        eos = getattr(config, "eos_token_id", None)
        if head == "seq-cls" and config.is_encoder_decoder and isinstance(eos, int):
            out["input_ids"][:, -1] = eos  # the head classifies the state at the end-of-sequence token
    if head in ("image-cls", "contrastive") and not token_image or config.model_type in CAPTIONERS:
        vision = _vision(config)
        size = getattr(vision, "image_size", 32)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(vision, "num_channels", 3)
        if config.model_type in VIDEO:  # a clip of frames per sample
            out["pixel_values_videos"] = torch.randn(BATCH, vision.num_frames, channels, *size, generator=generator)
        else:
            out["pixel_values"] = torch.randn(BATCH, channels, *size, generator=generator)
        if config.model_type == "siglip2":  # patches already cut out, with each image's grid (its processor's output)
            side = int(vision.num_patches ** 0.5)
            out["pixel_values"] = torch.randn(BATCH, side * side, channels * vision.patch_size ** 2,
                                              generator=generator)
            out["pixel_attention_mask"] = torch.ones(BATCH, side * side, dtype=torch.long)
            out["spatial_shapes"] = torch.tensor([[side, side]] * BATCH)
    if config.model_type in SPEECH:  # log-mel frames: the encoder's convolution halves them, its projector groups
        frames = LENGTH * 2 * config.downsample_factor  # downsample_factor of them per text token they are added to
        out["input_features"] = torch.randn(BATCH, config.audio_config.num_mel_bins, frames, generator=generator)
    codebooks = getattr(config, "num_codebooks", None) if config.model_type in AUDIO_CODES else None
    if codebooks:  # each step a code per codebook: the ids stacked by codebook, the labels with the codebooks last
        codes = torch.randint(4, high, (BATCH, codebooks, LENGTH), generator=generator)
        out["input_ids"], out["labels"] = codes.reshape(BATCH * codebooks, LENGTH), codes.transpose(1, 2)
    elif head in ("causal-lm", "masked-lm") or head == "seq2seq" and not config.is_encoder_decoder:
        out["labels"] = out["input_ids"].clone()  # a decoder with an audio tower is listed as seq2seq
    elif head == "seq2seq":  # decoder inputs given: no start token to configure
        out["labels"] = torch.randint(4, high, (BATCH, TARGET_LENGTH), generator=generator)
        out["decoder_input_ids"] = torch.randint(4, high, (BATCH, TARGET_LENGTH), generator=generator)
    elif head in ("seq-cls", "image-cls"):
        out["labels"] = torch.randint(0, LABELS, (BATCH,), generator=generator)
    else:
        out["return_loss"] = True
    return out


def loss(model, inputs: dict, rank: int) -> torch.Tensor:
    """The head's loss on ``inputs``, the RNG seeded per rank so any sampling in the forward matches stock's."""
    torch.manual_seed(2000 + rank)
    output = model(**inputs)
    value = output["loss"] if "loss" in output else None
    if value is None:
        raise NotBuilt(f"{type(model).__name__} returns no loss for these inputs")
    return value
