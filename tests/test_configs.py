"""Every YAML in configs/ validates; the generated defaults file is current; bad configs fail clearly."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from configs.schema import RunConfig, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_yaml_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize("path", [p for p in CONFIGS if not p.name.startswith("_")], ids=lambda p: p.name)
def test_yaml_mirrors_model_one_to_one(path: Path) -> None:
    """Each non-generated YAML spells out every field, with the model's nesting (no hidden defaults)."""
    def keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out.add(prefix + k)
            if isinstance(v, dict):
                out |= keys(v, prefix + k + ".")
        return out
    assert keys(yaml.safe_load(path.read_text())) == keys(RunConfig().model_dump(mode="json"))


def test_defaults_file_is_current() -> None:
    text = (CONFIGS[0].parent / "_defaults.yaml").read_text()
    assert yaml.safe_load(text) == RunConfig().model_dump(mode="json")


def test_typo_is_rejected_with_the_key_named() -> None:
    with pytest.raises(ValidationError, match="ppo_mini_bach_size"):
        load_config(None, ["actor.ppo_mini_bach_size=4"])


def test_grpo_needs_a_group() -> None:
    with pytest.raises(ValidationError, match=r"rollout.n \(1\) must be >= 2 for GRPO"):
        load_config(None, ["rollout.n=1"])


def test_mini_batch_must_divide_batch() -> None:
    with pytest.raises(ValidationError, match=r"ppo_mini_batch_size \(5\) must divide data.train_batch_size \(32\)"):
        load_config(None, ["actor.ppo_mini_batch_size=5"])


def test_unknown_estimator_lists_choices() -> None:
    with pytest.raises(ValidationError, match="grpo"):
        load_config(None, ["algorithm.adv_estimator=ppo2"])


def test_overrides_parse_yaml_values_and_hash_ignores_run_id() -> None:
    a = load_config(None, ["actor.optim.lr=0.5", "trainer.run_id=a"])
    b = load_config(None, ["actor.optim.lr=0.5", "trainer.run_id=b"])
    assert a.actor.optim.lr == 0.5 and a.run_id == "a"
    assert a.config_hash() == b.config_hash() != RunConfig().config_hash()


def test_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
