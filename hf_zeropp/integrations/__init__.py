"""The integrations wing: hf_zeropp where users already are.

- ``accelerate_integration``: ``hf_zeropp.Accelerator``; ``trainer``: the Trainer, its arguments and callback;
- ``launch``: ``hf-zeropp launch`` (accelerate launch, torchrun underneath); ``dropin``: the worker module every
  launched rank runs (``python -m hf_zeropp.integrations.dropin``), which installs hf_zeropp into unchanged scripts.

May import every wing below it; only ``hf_zeropp`` itself (``__init__``, ``__main__``) imports it. These are the heavy
modules (transformers' Trainer, Accelerate): ``import hf_zeropp`` loads none of them until a name needs it."""
