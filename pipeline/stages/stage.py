"""The stage record: everything the runner knows of a stage, and the artifact contract around its body.

A stage is data, not a module the runner inspects: its name, its code version (bump when its output
changes), the upstream stages it reads, the config view that changes its output, its body and the
resources its Ray task reserves. ``Stage.execute`` runs the body into a fresh folder and seals it
with the manifest; it needs no Ray, so tests and benchmarks call it directly.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.store.artifacts import Artifact, prepare_dir, write_manifest
from pipeline.config import RunConfig


# A write that failed because the disk is full, a quota or file size limit was hit, or the place is read-only.
_FULL_OR_READ_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


@dataclass(frozen=True)
class Resources:
    """Logical CPUs and GPUs that the runner reserves for a stage's Ray task.

    Only what the task itself holds: the Ray tasks or Ray Train workers a stage
    body starts reserve their own.

    Raises:
        ValueError: a negative amount.
    """

    cpus: float = 1.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"Resources(cpus={self.cpus}, gpus={self.gpus}): amounts must be >= 0")


# The body: (resolved config, upstream artifacts by stage name, empty output folder, tracker) -> counts.
StageBody = Callable[[RunConfig, Mapping[str, Artifact], Path, Any], dict[str, Any]]
ResourceRule = Callable[[RunConfig, Mapping[str, Artifact]], Resources]
# (resolved config, the stage's artifact hash): state a stage keeps outside its folder to resume.
StateHook = Callable[[RunConfig, str], None]
# (resolved config, upstream artifacts, the stage's hash) -> [(location, bytes, what for)]: an upper
# estimate of what the stage writes; location None is its own artifact folder.
DiskRule = Callable[[RunConfig, Mapping[str, Artifact], str], list[tuple[str | None, int, str]]]


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline.

    Attributes:
        name: the stage's name: its artifact folder, MLflow run and ``--only`` / ``--force`` value.
        version: the code version in the artifact hash; bump it when the output changes.
        inputs: upstream stage names, whose artifacts ``run`` gets.
        hash_config: the JSON-able config view that changes the output (no logging-only fields).
        run: the body; it fills the output folder and returns the manifest's counts.
        resources: what the stage's task reserves, when that does not depend on the run.
        resources_for: for a stage whose task's needs depend on the config and the inputs (tokenize
            encodes in its own process or in Ray tasks): returns them, in place of ``resources``.
        discard_state: for a stage that keeps resumable state outside its artifact folder, keyed by
            its hash (train: its checkpoints), so that a rerun after a crash continues where the
            crashed attempt was: removes that state; the runner calls it when the stage is forced.
        after_seal: prunes that state once the artifact is sealed (train keeps its final checkpoint).
        disk_need: what the stage will write and where, estimated before it runs; the runner checks
            that each place is writable and has the room (``pipeline.preflight.check_disk``).
        read_in_place: inputs the body reads where they live rather than from a copy on its node
            (train: each worker reads its own blocks of the token shards, ranged reads in an object
            store); the runner does not fetch them, so their ``path`` there is not filled.

    Raises:
        ValueError: an empty name, a version below 1, or a stage that lists itself as an input.
    """

    name: str
    version: int
    inputs: tuple[str, ...]
    hash_config: Callable[[RunConfig], Any]
    run: StageBody
    resources: Resources = Resources()
    resources_for: ResourceRule | None = None
    discard_state: StateHook | None = None
    after_seal: StateHook | None = None
    disk_need: DiskRule | None = None
    read_in_place: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.version < 1 or self.name in self.inputs:
            raise ValueError(f"stage {self.name!r} (version {self.version}, inputs {self.inputs}): a stage needs "
                             "a name, a version >= 1 and inputs other than itself")

    def task_resources(self, cfg: RunConfig, inputs: Mapping[str, Artifact]) -> Resources:
        """What the runner reserves for this stage's task in this run.

        Args:
            cfg: the resolved run config.
            inputs: upstream artifacts by stage name.

        Returns:
            ``resources_for(cfg, inputs)`` when the stage has one, else ``resources``.
        """
        return self.resources if self.resources_for is None else self.resources_for(cfg, inputs)

    def execute(self, cfg: RunConfig, hash_: str, out_dir: Path, inputs: Mapping[str, Artifact],
                tracker: Any) -> Artifact:
        """Run the body into ``out_dir`` and seal it with its manifest (written last).

        Args:
            cfg: the resolved run config.
            hash_: the artifact hash the runner computed for this stage.
            out_dir: ``<artifact_root>/<name>/<hash_>``; cleared first if an earlier attempt left it unsealed.
            inputs: upstream artifacts by stage name.
            tracker: the stage's ``StageTracker`` (or a test's stand-in).

        Returns:
            The sealed Artifact.

        Raises:
            ValueError: an input is missing. Whatever the body raises propagates, and the folder
                stays unsealed (no manifest), so the next run redoes it.
        """
        missing = [i for i in self.inputs if i not in inputs]
        if missing:
            raise ValueError(f"stage {self.name} needs inputs {missing}")
        started = time.time()
        prepare_dir(out_dir)
        try:
            counts = self.run(cfg, inputs, out_dir, tracker)
        except OSError as e:
            if e.errno in _FULL_OR_READ_ONLY and not e.filename:
                # numpy, pyarrow and torch often drop the path; the folder tells the user where to look
                raise OSError(e.errno, f"{e.strerror} while stage {self.name} wrote into {out_dir}") from e
            raise
        artifact = write_manifest(
            out_dir, stage=self.name, hash_=hash_, stage_config=self.hash_config(cfg), run_config=cfg.to_dict(),
            inputs={i: inputs[i].hash for i in self.inputs}, counts=counts, started_at=started,
        )
        if self.after_seal is not None:
            try:
                self.after_seal(cfg, hash_)
            except Exception as e:  # the artifact is sealed and good: pruning state is housekeeping
                print(f"warning: stage {self.name} ({hash_}) is done, but cleaning up its resumable state "
                      f"failed: {type(e).__name__}: {e}", flush=True)
        return artifact


def in_order(stages: Iterable[Stage]) -> dict[str, Stage]:
    """A stage table by name, checked to be in dependency order.

    Args:
        stages: the stages, each after every stage it reads.

    Returns:
        Name -> stage, in the given order (the order the runner walks).

    Raises:
        ValueError: two stages with one name, or a stage before one of its inputs.
    """
    table: dict[str, Stage] = {}
    for stage in stages:
        if stage.name in table:
            raise ValueError(f"two stages are named {stage.name!r}")
        unknown = [i for i in stage.inputs if i not in table]
        if unknown:
            raise ValueError(f"stage {stage.name!r} reads {unknown}, which do not come before it in {list(table)}")
        table[stage.name] = stage
    return table
