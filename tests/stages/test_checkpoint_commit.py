"""Checkpoints as committed objects (stages/io/checkpoints.py): a manifest created last and only once, on a local
disk and on a real S3 server (SeaweedFS, tests/servers.py); fetch by id into an empty node-local cache; a writer
killed before its manifest is invisible; one `checkpoints` table row per commit with its lineage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from assets.common import record_checkpoint
from assets.resources import RolloutStoreResource
from configs.errors import load_run_config
from stages.io import objects
from stages.io.checkpoints import (
    MANIFEST,
    CheckpointExistsError,
    ModelStore,
    checkpoint_id,
    resolve_model_dir,
)
from stages.io.store import commit_lineage
from stages.models.policy import load_policy

CI = Path(__file__).resolve().parents[2] / "configs" / "ci_tiny.yaml"


def _commit(ms: ModelStore, src: Path, version: int, kind: str = "policy", **kw) -> dict:
    with ms.writer(kind, version, **kw) as staged:
        for f in src.iterdir():
            shutil.copy2(f, staged.dir / f.name)
    return staged.manifest


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}


def _second_commit_is_refused(ms: ModelStore, src: Path) -> None:
    first = _commit(ms, src, 1, checkpoint_id="run/1/first")
    before = _files(ms.fetch(1))
    with pytest.raises(CheckpointExistsError, match=r"policy version 1 .* already committed as checkpoint run/1/first"):
        _commit(ms, src, 1, checkpoint_id="run/1/second")
    assert ms.manifest(1)["checkpoint_id"] == first["checkpoint_id"] == "run/1/first"
    assert _files(ms.fetch(1)) == before and checkpoint_id(ms.fetch(1)) == "run/1/first"
    assert ms.versions() == [1] and ms.versions("critic") == []


def test_local_second_commit_of_a_version_is_refused(tiny_checkpoint, tmp_path) -> None:
    ms = ModelStore(tmp_path / "checkpoints", "run")
    _second_commit_is_refused(ms, tiny_checkpoint)
    # the local default keeps today's layout: the files where they always were, the manifest beside them
    assert ms.fetch(1) == tmp_path / "checkpoints" / "run" / "policy_v1"
    assert (ms.fetch(1) / MANIFEST).is_file() and (ms.fetch(1) / "config.json").is_file()
    assert not list((tmp_path / "checkpoints" / "run").glob("*.tmp"))


def test_local_raw_manifest_put_is_create_only(tmp_path) -> None:
    store = objects.open_store(str(tmp_path))
    objects.put_bytes(store, "r/policy_v0/MANIFEST.json", b"{}", create=True)
    with pytest.raises(objects.AlreadyExists):
        objects.put_bytes(store, "r/policy_v0/MANIFEST.json", b"{1}", create=True)
    assert objects.get_bytes(store, "r/policy_v0/MANIFEST.json") == b"{}"


def _many_files_round_trip(store, tmp_path: Path) -> None:
    """put_files / download / delete of more objects than objects.IO_THREADS (sub-directories too); a delete
    naming a key already gone deletes the others."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {f"f{i}.bin" if i % 3 else f"sub/f{i}.bin": bytes([i]) * (1000 + i) for i in range(objects.IO_THREADS + 5)}
    for name, body in files.items():
        (src / name).write_bytes(body)
    objects.put_files(store, {f"many/{name}": src / name for name in files})
    got = objects.download(store, {name: f"many/{name}" for name in files}, tmp_path / "got")
    assert {name: (got / name).read_bytes() for name in files} == files
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    objects.delete(store, ["many/f1.bin", "many/f2.bin"])
    objects.delete(store, ["many/f1.bin", "many/f4.bin"])  # f1 is gone already
    assert objects.delete_prefix(store, "many") == len(files) - 3 and objects.list_keys(store, "many") == []
    with pytest.raises(FileNotFoundError):  # nothing was downloaded, and no partial directory is left
        objects.download(store, {"f5.bin": "many/f5.bin"}, tmp_path / "none")
    assert not (tmp_path / "none").exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_local_objects_put_get_and_delete_many(tmp_path) -> None:
    _many_files_round_trip(objects.open_store(str(tmp_path / "store")), tmp_path)


@pytest.mark.cluster
def test_s3_objects_put_get_and_delete_many(s3_env, tmp_path) -> None:
    _many_files_round_trip(objects.open_store(s3_env.root("many")), tmp_path)
    assert not s3_env.keys("many/")


def test_retract_then_recommit_and_prune(tiny_checkpoint, tmp_path) -> None:
    ms = ModelStore(tmp_path, "run")
    for v in range(4):
        _commit(ms, tiny_checkpoint, v)
    old = ms.retract(2)
    assert old["version"] == 2 and ms.versions() == [0, 1, 3]
    assert _commit(ms, tiny_checkpoint, 2, checkpoint_id="again")["checkpoint_id"] == "again"
    assert ms.prune(keep_every=0, latest=3) == [1] and ms.versions() == [0, 2, 3]


@pytest.mark.cluster
def test_s3_second_commit_of_a_version_is_refused(tiny_checkpoint, s3_env, tmp_path) -> None:
    ms = ModelStore(s3_env.root("refuse/checkpoints"), "run", cache_dir=tmp_path / "cache")
    _second_commit_is_refused(ms, tiny_checkpoint)
    keys = s3_env.keys("refuse/")
    assert "refuse/checkpoints/run/policy_v1/MANIFEST.json" in keys
    attempts = {k.split("/")[4] for k in keys if k.count("/") == 5}
    assert len(attempts) == 1, f"the refused attempt's objects are deleted: {keys}"


@pytest.mark.cluster
def test_s3_commit_then_fetch_into_an_empty_cache(tiny_checkpoint, s3_env, tmp_path) -> None:
    root = s3_env.root("fetch/checkpoints")
    writer = ModelStore(root, "run", cache_dir=tmp_path / "writer_cache")
    m = _commit(writer, tiny_checkpoint, 0, checkpoint_id="run/0/abc")
    assert m["uri"] == f"{root}/run/policy_v0/{m['attempt_id']}" and m["bytes"] == sum(m["files"].values())
    reader = ModelStore(root, "run", cache_dir=tmp_path / "reader_cache")  # another node: nothing cached
    assert not (tmp_path / "reader_cache").exists()
    local = reader.fetch(0)
    assert local.is_relative_to(tmp_path / "reader_cache") and checkpoint_id(local) == "run/0/abc"
    assert _files(local) == {**_files(tiny_checkpoint), "checkpoint_id.txt": b"run/0/abc"}
    assert reader.fetch(0) == local  # cached: keyed by the checkpoint id
    ref = reader.require(0, needed_by="test")
    assert isinstance(ref, str) and "run/0/abc" in ref and s3_env.env["AWS_SECRET_ACCESS_KEY"] not in ref
    shutil.rmtree(tmp_path / "reader_cache")  # a worker on a fresh node resolves the reference by downloading
    assert _files(resolve_model_dir(ref)) == _files(local)
    model, _ = load_policy(resolve_model_dir(ref))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert json.loads(reader.read_file(0, "config.json")) == json.loads((tiny_checkpoint / "config.json").read_text())


@pytest.mark.cluster
def test_s3_killed_writer_is_invisible_and_a_retry_commits(tiny_checkpoint, s3_env, tmp_path) -> None:
    ms = ModelStore(s3_env.root("killed/checkpoints"), "run", cache_dir=tmp_path / "cache")
    _commit(ms, tiny_checkpoint, 0)
    for f in tiny_checkpoint.iterdir():  # a writer killed after its upload, before its manifest
        objects.put_file(ms.store, f"run/policy_v1/deadbeef/{f.name}", f)
    assert ms.versions() == [0] and ms.manifest(1) is None
    with pytest.raises(FileNotFoundError, match="policy version 1 .* not committed"):
        ms.fetch(1, needed_by="the test")
    retry = _commit(ms, tiny_checkpoint, 1)
    assert retry["attempt_id"] != "deadbeef" and ms.versions() == [0, 1]
    assert ms.remove_partial() == ["run/policy_v1/deadbeef"]
    assert not [k for k in s3_env.keys("killed/") if "deadbeef" in k] and ms.versions() == [0, 1]


def test_checkpoints_table_has_one_row_per_commit_with_lineage(tiny_checkpoint, tmp_path) -> None:
    cfg = load_run_config(str(CI), [f"trainer.output_dir={tmp_path}", "trainer.run_id=R"])
    ms = ModelStore(tmp_path / "checkpoints", "R")
    tables = RolloutStoreResource(root=str(tmp_path / "tables"))
    policy = _commit(ms, tiny_checkpoint, 1)
    critic = _commit(ms, tiny_checkpoint, 1, kind="critic")
    record_checkpoint(tables, cfg, policy, 0, upstream={"advantages": 7}, metrics={"actor/pg_loss": 0.5})
    v = record_checkpoint(tables, cfg, critic, 0, upstream={"advantages": 7, "values": 3})
    again = _commit(ms, tiny_checkpoint, 2)
    record_checkpoint(tables, cfg, again, 1, upstream={"advantages": 9})
    rows, _ = tables.read("checkpoints", "R", 0, version=v)
    assert sorted(zip(rows["kind"], rows["version"], strict=True)) == [("critic", 1), ("policy", 1)]
    pol = rows[rows["kind"] == "policy"].iloc[0]
    assert pol["checkpoint_id"] == policy["checkpoint_id"] and pol["attempt_id"] == policy["attempt_id"]
    assert json.loads(pol["metrics"]) == {"actor/pg_loss": 0.5} and pol["bytes"] == policy["bytes"]
    assert "config.json" in list(pol["files"]) and pol["uri"] == policy["uri"]
    lineage = commit_lineage(tables.uri("checkpoints"), run_id="R", iteration=0)[0]
    assert lineage["upstream"] == {"advantages": 7, "values": 3} and lineage["stage"] == "critic_checkpoint"
    # re-recording a commit of the same (kind, version) replaces its row, never duplicates it
    record_checkpoint(tables, cfg, policy, 0, upstream={"advantages": 8})
    rows, _ = tables.read("checkpoints", "R", 0)
    assert len(rows) == 2


def _cached_versions(cache: Path) -> list[int]:
    """Versions whose whole copy is in node cache `cache` (its index records each copy)."""
    entries = [json.loads(p.read_text()) for p in (cache / ".index").glob("*.json")]
    return sorted(e["version"] for e in entries if (cache / e["dir"] / "config.json").is_file())


@pytest.mark.cluster
def test_s3_node_cache_keeps_the_newest_versions_and_v0(tiny_checkpoint, s3_env, tmp_path) -> None:
    root = s3_env.root("prune/checkpoints")
    writer = ModelStore(root, "run", cache_dir=tmp_path / "writer", keep_versions=2)
    for v in range(5):  # the trainer's node keeps its own commits: pruned as they arrive
        _commit(writer, tiny_checkpoint, v)
    assert _cached_versions(tmp_path / "writer") == [0, 3, 4]
    assert len([d for d in (tmp_path / "writer").iterdir() if not d.name.startswith(".")]) == 3  # nothing else left
    reader = ModelStore(root, "run", cache_dir=tmp_path / "reader", keep_versions=2)
    for v in (1, 2, 3):  # an engine's node fetching each new version
        resolve_model_dir(reader.require(v, needed_by="test"))
    assert _cached_versions(tmp_path / "reader") == [2, 3]
    assert reader.fetch(1).is_dir() and _cached_versions(tmp_path / "reader") == [1, 2, 3]  # just fetched: kept
    reader.fetch(4)
    assert _cached_versions(tmp_path / "reader") == [3, 4]


@pytest.mark.cluster
def test_s3_driver_reads_the_tokenizer_and_fingerprint_without_the_weights(tiny_checkpoint, s3_env, tmp_path) -> None:
    from stages.models.fingerprint import fingerprint_checkpoint
    from stages.models.policy import load_tokenizer

    root = s3_env.root("tok/checkpoints")
    writer = ModelStore(root, "run", cache_dir=tmp_path / "writer")
    (tmp_path / "src").mkdir()
    for f in tiny_checkpoint.iterdir():
        shutil.copy2(f, tmp_path / "src" / f.name)
    (tmp_path / "src" / "optimizer.pt").write_bytes(b"\0" * 4096)  # optimizer state, as the trainer's commits hold
    _commit(writer, tmp_path / "src", 1)
    driver = ModelStore(root, "run", cache_dir=tmp_path / "driver")
    tok_dir = driver.fetch_tokenizer(1)
    got = {p.name for p in tok_dir.iterdir()}
    assert "config.json" in got and any(n.startswith("tokenizer") for n in got), got
    assert not [n for n in got if n.endswith((".safetensors", ".pt", ".bin"))], got
    assert load_tokenizer(tok_dir).encode("12+3") == load_tokenizer(tiny_checkpoint).encode("12+3")
    assert driver.policy_fingerprint(1) == fingerprint_checkpoint(tiny_checkpoint)  # from the manifest
    weights = [p for p in (tmp_path / "driver").rglob("*") if p.suffix in (".safetensors", ".pt")]
    assert weights == [], weights
    assert writer.fetch_tokenizer(1) == writer.fetch(1)  # a node holding the whole copy reads it there
