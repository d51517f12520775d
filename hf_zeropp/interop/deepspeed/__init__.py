"""DeepSpeed's formats, without DeepSpeed.

- ``config``: a DeepSpeed JSON config's sections mapped to hf_zeropp options or refused; ``optim``: its optimizer and
  scheduler sections built as torch ones; ``training``: its training-loop settings (loss scaling, clipping, batch);
- ``files`` / ``zero`` / ``universal`` / ``checkpoint``: its ZeRO-1/2/3 and universal checkpoint folders, read into
  one per-parameter view.

May import ``_compat`` and each other only."""
