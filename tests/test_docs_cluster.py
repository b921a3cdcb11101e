"""Every YAML snippet in docs/cluster.md loads: run configs through configs' loader (with their `defaults:`
resolved next to the shipped configs, as the doc says to place them), dagster.yaml snippets through rlake's
instance check."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from configs.errors import load_run_config
from pipelines.runner import check_instance_yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cluster.md"


def _snippets() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_yaml_snippet_of_the_cluster_doc_loads(tmp_path, monkeypatch) -> None:
    snippets = _snippets()
    assert len(snippets) >= 2, "docs/cluster.md lost its dagster.yaml or its run config"
    configs = tmp_path / "configs"  # a copy: `defaults:` names are relative to the config's own directory
    shutil.copytree(ROOT / "configs", configs)
    loaded = 0
    for i, text in enumerate(snippets):
        data = yaml.safe_load(text)
        if "postgres" in (data.get("storage") or {}):  # a dagster.yaml
            monkeypatch.setenv("DAGSTER_PG_URL", "postgresql+psycopg2://dagster@db.internal:5432/dagster")
            check_instance_yaml(tmp_path / "dagster.yaml", text)
            continue
        path = configs / f"doc_snippet_{i}.yaml"
        path.write_text(text)
        cfg = load_run_config(path)
        assert cfg.storage.root == data["storage"]["root"]
        loaded += 1
    assert loaded >= 1, "no run config snippet in docs/cluster.md"
