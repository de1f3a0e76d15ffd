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
"""

from pipeline.training.checkpoint.manager import CheckpointManager, Restored, precision_record, resume_checkpoint

__all__ = ["CheckpointManager", "Restored", "precision_record", "resume_checkpoint"]
