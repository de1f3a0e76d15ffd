"""The configuration of a Conduit run: one typed tree, read from YAML in Conduit's dialect.

What it offers (import these from ``pipeline.config``):

- ``load_config(path, overrides)`` and ``config_from_dict(raw)``: a checked ``RunConfig``, or a
  ``ConfigError`` that names the file, field or value and what is allowed.
- ``RunConfig`` and its sections (``TrainSection``, ``OptimizerSection``, ``ValidationSection``,
  ``CheckpointSection``, ``DeploySection``, ...).
- ``hash_view(section)``: the part of a section that changes a stage's output; ``flatten(dict)``: the
  dotted keys MLflow params use.

Its modules: ``schema`` (the sections, loading, overrides and cross-field checks), ``dialect`` (the
YAML reader: PyYAML's safe loader with Conduit's two fixes), ``ranges`` (the allowed range of every
numeric field no other rule judges), ``limits`` (the rules of a parallel layout and training options,
each with its one message; the training code checks the same ones).
"""

from pipeline.base import DEFAULT_DATA_ROOT, REPO_ROOT, ConfigError
from pipeline.config.schema import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    DeploySection,
    EvalSection,
    OptimizerSection,
    ParallelSection,
    PromoteSection,
    RegisterSection,
    RunConfig,
    RunSection,
    TokenizerSection,
    TokenizeSection,
    TrackingSection,
    TrainSection,
    ValidationSection,
    config_from_dict,
    flatten,
    hash_view,
    load_config,
    validate,
)

__all__ = [
    "DEFAULT_DATA_ROOT", "REPO_ROOT", "ConfigError", "CheckpointSection", "ClusterSection", "DataSection", "DeploySection",
    "EvalSection", "OptimizerSection", "ParallelSection", "PromoteSection", "RegisterSection", "RunConfig", "RunSection",
    "TokenizerSection", "TokenizeSection", "TrackingSection", "TrainSection", "ValidationSection", "config_from_dict", "flatten",
    "hash_view", "load_config", "validate",
]
