"""Reading, cleaning and packing text for the data stages (shard, tokenizer, tokenize).

``sources`` resolves inputs (paths, globs, pyarrow filesystem URIs) to files (``fs.InputFile``);
``readers`` turns one input into documents with its counts; ``clean`` normalises and filters documents; ``packing``
joins encoded documents into fixed-size token blocks; ``encode`` is the sentencepiece batch encoder
that the tokenize stage runs in a Ray task per document shard (or in-process).
"""


class DataError(ValueError):
    """Input data that cannot be read as configured; the message names the file and the place."""


def ray_running() -> bool:
    """Whether this process is connected to Ray: stage bodies then fan out into Ray tasks and actors
    (inside the pipeline they always are); otherwise they do the same work in-process."""
    import ray

    return ray.is_initialized()
