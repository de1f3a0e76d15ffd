"""The artifact store: where each stage's sealed output lives, and what crosses between stages.

Its modules (imported by name; this package imports nothing on its own):

- ``artifacts``: content-addressed stage artifacts: the hash of a stage's config and inputs, the
  manifest that seals a folder (every file's size and sha256), checking a sealed folder.
- ``backends``: where sealed artifacts live (``store_for(root)``): a local folder, or any ``pyarrow.fs``
  URI through node-local scratch (``publish`` uploads the manifest last, ``fetch`` checks every byte).
- ``locks``: one lock per stage and hash, so two drivers of one config never write the same stage.
- ``contracts``: what one stage writes and another reads: file names and the manifest counts that
  cross stages (shards, token files, train metrics and starts, the eval report, the registered model).
"""
