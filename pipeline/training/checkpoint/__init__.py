"""One home for checkpoints: what one holds, its checksums, which one training resumes from, and the
layout-independent form. The training loop asks ``resume_checkpoint`` which checkpoint it starts from and
``precision_record`` what that one trained in (before its engine is built), then talks to
``CheckpointManager`` (``restore`` once, ``save`` at checkpoint steps); the modules behind it:

- ``native``: DeepSpeed's own checkpoint of each rank with the step, the loader position and the RNG
  states (bit-exact on the same layout).
- ``canonical``: ``canonical.pt``, full fp32 weights and Adam state per parameter, for resuming on
  another world size, ZeRO stage or ``parallel.ep_size``.
- ``checksums``: every file's sha256, recorded when written, checked before anything is read.
- ``choice``: which kept checkpoint a restarted group resumes from when the latest does not verify.
- ``record``: where a training's checkpoints live (``checkpoint.storage``, ``train-<hash>``), which are whole
  and kept (``CheckpointRecord``), for every launch alike.
"""

# Read lazily: the train stage's task reaches the record (where checkpoints are) without importing torch.
_EXPORTS = {"CheckpointManager": "manager", "Restored": "manager", "precision_record": "manager",
            "resume_checkpoint": "manager", "CheckpointRecord": "record", "discard_checkpoints": "record",
            "place_for": "record"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
