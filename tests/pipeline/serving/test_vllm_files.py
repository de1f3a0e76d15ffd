"""The node-local copies vLLM loads (pipeline.serving.vllm_files): a model's copies other than the version
in service are removed, on every node; another registry's or model's are left alone. The copies of a real
vLLM deployment rolling over and going down: tests/jobs/test_deploy_vllm.py."""

from __future__ import annotations

from pathlib import Path

from pipeline.serving import vllm_files


def _copy(folder: Path, key: str, name: str, version: int) -> Path:
    """A version's copy as VersionFiles leaves it (and a download of it cut off, beside it)."""
    files = folder / key / f"{name}-v{version}"
    files.mkdir(parents=True)
    (files / "config.json").write_text("{}")
    (files / "model.safetensors").write_bytes(b"\0" * 1024)
    (folder / key / f"{name}-v{version}.tmp123").mkdir()
    return files


def test_prune_keeps_only_the_version_in_service_of_one_registrys_model(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_files.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = Path(vllm_files.model_dir("http://mlflow:5000", "demo"))
    assert mine.parent == tmp_path / "conduit-vllm"
    theirs = Path(vllm_files.model_dir("sqlite:///other.db", "demo"))  # same name, another registry
    other_model = Path(vllm_files.model_dir("http://mlflow:5000", "demo-2"))
    assert len({mine, theirs, other_model}) == 3
    keys = [vllm_files.version_key("http://mlflow:5000", "demo", v, f"run{v}") for v in (1, 2, 3)]
    for v, key in zip((1, 2, 3), keys):
        _copy(mine, key, "demo", v)
    _copy(theirs, "k1", "demo", 1)
    _copy(other_model, "k1", "demo-2", 1)

    removed = vllm_files.prune(str(mine), keep=keys[1])
    assert removed == sorted(str(mine / k) for k in (keys[0], keys[2]))
    assert sorted(p.name for p in mine.iterdir()) == [keys[1]]
    assert (mine / keys[1] / "demo-v2" / "model.safetensors").stat().st_size == 1024
    assert vllm_files.prune(str(mine), keep=keys[1]) == []  # nothing more to remove

    assert vllm_files.prune(str(mine), keep=None) == [str(mine / keys[1]), str(mine)]
    assert not mine.exists() and vllm_files.prune(str(mine), keep=None) == []
    assert (theirs / "k1" / "demo-v1" / "config.json").is_file()  # another registry's, another model's: kept
    assert (other_model / "k1" / "demo-2-v1" / "config.json").is_file()


def test_prune_on_every_node_runs_on_the_clusters_nodes(ray_cluster, tmp_path):
    folder = tmp_path / "model"
    _copy(folder, "old", "demo", 1)
    _copy(folder, "new", "demo", 2)
    removed = vllm_files.prune_on_every_node(str(folder), keep="new")
    assert list(removed.values()) == [[str(folder / "old")]]  # the session's Ray has one node
    assert sorted(p.name for p in folder.iterdir()) == ["new"]
