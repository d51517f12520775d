"""The interop wing: other libraries' formats, read and written without the engine.

- ``hf_checkpoint``: Hugging Face safetensors folders read and written by every rank at once (slices, not the model);
- ``deepspeed/``: DeepSpeed's formats — its config's training-loop sections (``config``, ``optim``, ``training``) and
  its checkpoint files (``files``, ``zero``, ``universal``, ``checkpoint``).

Low in the order: the config maps a DeepSpeed config, the engine loads safetensors slices and checkpoints detect
DeepSpeed folders through it. May import ``kernels`` and ``_compat`` only. What needs a sharded model (resuming a
DeepSpeed checkpoint, converting one) lives in the checkpoint wing."""
