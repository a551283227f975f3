"""ds_canzona's checkpoint format: items keyed by parameter name, committed atomically.

Layout of ``<save_dir>/``::

    latest                                   the tag of the newest committed checkpoint
    zero_to_fp32.py, zero_to_torch.py        DeepSpeed's conversion command lines on this format
    <tag>/canzona_meta.pt                    the manifest (rank 0), the commit point of the tag
    <tag>/canzona_rank00003-<save_id>.safetensors
                                             rank 3's fp32 masters and optimizer state, per item
                                             (a whole tensor, or a piece "<name>[start:stop]"):
                                             "master/<item>", "state/<item>/<key>"

The manifest holds the format, the save id, every shard file with its size, every saved item
(name, shape, optimizer kind, param group, which file holds it; a piece of a non-matrix tensor,
saved when the plan had ``split_numel``, also names its tensor, its element range and the
tensor's shape), the param groups' settings,
the loss scaler, the engine counters, the lr scheduler, the client state, and the module's
buffers and frozen parameters. docs/CHECKPOINTS.md describes every field.

Any plan loads it: a checkpoint saved at one world size, alpha, bucket size, stage or
``split_numel`` loads into another, because each rank reads, lazily, only the items it owns under
its own plan, from whichever files the manifest names (an item saved in other pieces is put
together from the element ranges that cover it).

Crash safety: a save writes shard files under names carrying a fresh save id (each written to a
temporary name, fsynced and renamed), agrees across ranks that every file is complete, and only
then does rank 0 replace the manifest (the tag's commit) and ``latest`` (the directory's commit),
each by an atomic rename. Older files of the same tag are removed after the commit. A crash at
any point leaves the previous manifest, the files it names and ``latest`` as they were.

Safety: nothing is unpickled into code. Shards are safetensors; the manifest is read with
``torch.load(weights_only=True)`` (tensors and plain Python values) and a save whose metadata a
weights-only load would refuse fails before anything is written.

Every step that can fail on one rank is followed by an agreement (one small all-gather), so a bad
file or a full disk on one rank is an error on every rank, never a hang.

The package, by seam (each importable alone, in this order of dependence):

    format.py      names of files and items, the manifest (read, serialized, checked), errors
    files.py       atomic writes, shard files, the ``latest`` pointer, leftovers of crashed saves
    reader.py      :class:`Checkpoint`: lazy, validated reads of items and element ranges
    agreement.py   the one-all-gather agreement that makes a failure on one rank an error on all
    batch.py       the global batch a checkpoint records, and the warning when a load changes it
    hf_config.py   the module's HuggingFace config files, carried into the consolidated export
    frozen.py      ZeRO-3 frozen parameters (DeepSpeed's even layout): gathered whole for a save,
                   written slice by slice into their partitions on load
    recovery_scripts.py  the zero_to_fp32.py / zero_to_torch.py every save leaves in its directory
    engine.py      engine.save_checkpoint / engine.load_checkpoint for the ZeRO-1/2 optimizer,
                   the only module that knows its buffers and plan
"""

from ds_canzona.zero.checkpoint.engine import load_engine_checkpoint, save_engine_checkpoint
from ds_canzona.zero.checkpoint.files import atomic_write, resolve_tag
from ds_canzona.zero.checkpoint.format import (FORMAT, LATEST_FILE, META_FILE, CheckpointError, check_same_model,
                                               check_tag, master_key, read_meta, serialize_meta, shard_name,
                                               state_key)
from ds_canzona.zero.checkpoint.reader import Checkpoint

__all__ = ["FORMAT", "LATEST_FILE", "META_FILE", "Checkpoint", "CheckpointError", "atomic_write", "check_same_model",
           "check_tag", "load_engine_checkpoint", "master_key", "read_meta", "resolve_tag", "save_engine_checkpoint",
           "serialize_meta", "shard_name", "state_key"]
