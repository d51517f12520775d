"""Read DeepSpeed checkpoints without DeepSpeed: the ZeRO stage 1, 2 and 3 partition files that
``engine.save_checkpoint`` writes (fp32, bf16 or fp16 training, any number of ranks;
:mod:`hf_zeropp.interop.deepspeed.zero`) and the "universal" layout of ``ds_to_universal`` (one folder per parameter;
:mod:`hf_zeropp.interop.deepspeed.universal`). The result is a per-parameter view
(:class:`~hf_zeropp.interop.deepspeed.files.DeepSpeedCheckpoint`): for every trainable parameter its fp32 master values
and each optimizer state tensor, read lazily as flat ranges of the memory-mapped files, plus the optimizer step, the
parameter group's hyperparameters, the LR scheduler's state and the step counters.
:mod:`hf_zeropp.checkpoint.deepspeed_restore` loads that view into a sharded model and its optimizer.
"""

from __future__ import annotations

from pathlib import Path

from .files import MODEL_STATES, DeepSpeedCheckpoint, DeepSpeedCheckpointError, load_file, rank_order
from .universal import read_universal
from .zero import read_zero

LATEST_FILES = ("latest", "latest_universal")


def find_deepspeed_folder(path: str | Path, tag: str | None = None) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint at ``path``: a ``save_checkpoint`` folder (``latest`` names the tag;
    ``latest_universal`` for a universal one), a Trainer ``checkpoint-N`` folder (which holds one), or a tag folder
    itself. None when ``path`` holds no DeepSpeed checkpoint. A ``latest`` naming a missing tag is an error."""
    path = Path(path)
    if tag is not None:
        folder = path / tag
        if not folder.is_dir():
            raise DeepSpeedCheckpointError(f"{folder} does not exist: tag {tag!r} is not in {path}")
        return folder
    if _is_tag_folder(path):
        return path
    for latest in LATEST_FILES:
        if (path / latest).is_file():
            named = (path / latest).read_text().strip()
            if not (path / named).is_dir():
                raise DeepSpeedCheckpointError(
                    f"{path / latest} names the tag {named!r}, but {path / named} does not exist: the checkpoint is "
                    f"incomplete; point at a complete one or pass the tag of one that exists")
            return path / named
    tags = sorted(p for p in path.glob("global_step*") if _is_tag_folder(p)) if path.is_dir() else []
    if len(tags) == 1:
        return tags[0]
    if tags:
        raise DeepSpeedCheckpointError(f"{path} holds several DeepSpeed tags ({[t.name for t in tags]}) and no "
                                       f"'latest' file; pass the tag to load")
    return None


def _is_tag_folder(path: Path) -> bool:
    return path.is_dir() and (any(MODEL_STATES.match(p.name) for p in path.iterdir())
                              or (path / "zero" / "optimizer_state.pt").is_file())


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    try:
        return find_deepspeed_folder(path) is not None
    except DeepSpeedCheckpointError:
        return True  # it is one, though a broken one: reading it says what is wrong


def read_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint at ``path`` (see :func:`find_deepspeed_folder`) as per-parameter state."""
    folder = find_deepspeed_folder(path, tag)
    if folder is None:
        raise DeepSpeedCheckpointError(f"{path} holds no DeepSpeed checkpoint (no 'latest' file, no global_step* "
                                       f"folder, no *_model_states.pt)")
    model_files = sorted((p for p in folder.iterdir() if MODEL_STATES.match(p.name)), key=rank_order)
    if not model_files:
        raise DeepSpeedCheckpointError(f"{folder} holds no *_model_states.pt file: not a DeepSpeed checkpoint tag")
    _refuse_model_parallel(folder, model_files)
    model_states = load_file(model_files[0])
    if (folder / "zero").is_dir():
        return read_universal(folder, model_states)
    return read_zero(folder, model_states)


def _refuse_model_parallel(folder: Path, model_files: list[Path]) -> None:
    mp_ranks = {MODEL_STATES.match(p.name).group(1) for p in model_files}
    extra = [p.name for p in folder.iterdir() if p.name.startswith(("layer_", "expp_rank_"))]
    if len(mp_ranks) > 1 or extra:
        raise DeepSpeedCheckpointError(
            f"{folder} was written with tensor, pipeline or expert parallelism ({sorted(mp_ranks)} model-parallel "
            f"ranks, {len(extra)} layer/expert files); hf_zeropp reads data-parallel ZeRO checkpoints only. Convert "
            f"it with DeepSpeed's ds_to_universal first if its layout allows")


__all__ = ["DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "find_deepspeed_folder", "is_deepspeed_checkpoint",
           "read_deepspeed_checkpoint"]
