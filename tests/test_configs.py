"""Every YAML in configs/ validates; the generated defaults file is current; bad configs fail clearly;
overlays (`defaults:`) compose in order and hold only differences; verl names and `rlake config`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from configs.compose import compose_bases, flatten
from configs.schema import RunConfig, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
OVERLAYS = [p for p in CONFIGS if "defaults" in (yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_yaml_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if not p.name.startswith("_") and p not in OVERLAYS], ids=lambda p: p.name
)
def test_yaml_mirrors_model_one_to_one(path: Path) -> None:
    """Each full (non-generated, non-overlay) YAML spells out every field, with the model's nesting."""

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


def test_tiny_cpu_is_a_full_mirror_and_the_algorithms_are_overlays() -> None:
    names = {p.stem for p in OVERLAYS}
    assert "tiny_cpu" not in names
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo", "ppo", "remax"} <= names


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_overlay_holds_only_differences(path: Path) -> None:
    """Every key an overlay sets exists in its resolved base and changes its value there."""
    own = yaml.safe_load(path.read_text())
    base_cfg = RunConfig.model_validate(compose_bases(path, own.pop("defaults"), RunConfig))
    base = flatten(base_cfg.model_dump(mode="json"))
    for key, value in flatten(own).items():
        assert key in base, f"{path.name}: '{key}' is not a key of its base"
        assert base[key] != value, f"{path.name}: '{key}: {value!r}' repeats its base's value; delete it"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_bases_apply_in_order_then_own_keys_then_overrides(tmp_path: Path) -> None:
    _write(tmp_path, "a", "rollout: {n: 4, temperature: 0.5}\ntrainer: {experiment_name: a}\n")
    _write(tmp_path, "b", "defaults: a\nrollout: {n: 16}\ntrainer: {experiment_name: b, save_freq: 3}\n")
    _write(tmp_path, "c", "rollout: {top_p: 0.9}\ntrainer: {experiment_name: c}\n")
    top = _write(tmp_path, "top", "defaults: [b, c.yaml]\ntrainer: {test_freq: 2}\n")
    cfg = load_config(top, ["trainer.save_freq=7"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.top_p) == (16, 0.5, 0.9)  # deep merge
    assert cfg.trainer.experiment_name == "c"  # later base over earlier
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq) == (2, 7)  # own keys, then overrides


def test_lists_are_replaced_not_merged(tmp_path: Path) -> None:
    _write(tmp_path, "base", "rollout: {stop: ['a', 'b']}\n")
    cfg = load_config(_write(tmp_path, "top", "defaults: [base]\nrollout: {stop: ['c']}\n"))
    assert cfg.rollout.stop == ["c"]


def test_overlay_of_the_shipped_base_equals_the_override(tmp_path: Path) -> None:
    tiny = CONFIGS[0].parent / "tiny_cpu.yaml"
    overlay = _write(tmp_path, "mine", f"defaults: [{tiny}]\nrollout: {{n: 16}}\n")
    assert load_config(overlay) == load_config(tiny, ["rollout.n=16"])


def test_base_cycle_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, "a", "defaults: [b]\n")
    _write(tmp_path, "b", "defaults: [a]\n")
    with pytest.raises(ValueError, match=r"config bases form a cycle: a.yaml -> b.yaml -> a.yaml"):
        load_config(tmp_path / "a.yaml")


def test_missing_base_names_the_file_and_the_choices(tmp_path: Path) -> None:
    _write(tmp_path, "present", "seed: 1\n")
    top = _write(tmp_path, "top", "defaults: [absent]\n")
    with pytest.raises(
        FileNotFoundError,
        match=r"base config 'absent' in the defaults of .*top.yaml' does not exist"
        r".*use one of \['present', 'top'\]",
    ):
        load_config(top)


def test_defaults_entries_are_names_with_an_optional_final_self(tmp_path: Path) -> None:
    _write(tmp_path, "a", "seed: 3\n")
    assert load_config(_write(tmp_path, "ok", "defaults: [a, _self_]\n")).seed == 3
    with pytest.raises(ValueError, match="'_self_' in the defaults of .* must come last"):
        load_config(_write(tmp_path, "early", "defaults: [_self_, a]\n"))
    with pytest.raises(ValueError, match="must be a config name or a list of names"):
        load_config(_write(tmp_path, "hydra", "defaults: [{actor: dp_actor}]\n"))


@pytest.mark.parametrize(
    "verl, rlake, value",
    [
        ("actor_rollout_ref.rollout.n", "rollout.n", "16"),
        ("actor_rollout_ref.rollout.temperature", "rollout.temperature", "0.7"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size", "16"),
        ("actor_rollout_ref.actor.optim.lr", "actor.optim.lr", "3e-4"),
        ("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef", "0.01"),
        ("actor_rollout_ref.model.path", "model.path", "/ckpt/qwen"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", "0.4"),
    ],
)
def test_verl_override_equals_the_rlake_key(verl: str, rlake: str, value: str) -> None:
    assert load_config(None, [f"{verl}={value}"]) == load_config(None, [f"{rlake}={value}"])


def test_verl_names_in_a_yaml_file(tmp_path: Path) -> None:
    tiny = CONFIGS[0].parent / "tiny_cpu.yaml"
    verl = _write(
        tmp_path,
        "verl",
        f"defaults: [{tiny}]\nactor_rollout_ref:\n  rollout: {{n: 16}}\n"
        "  actor: {optim: {lr: 3.0e-4}, use_kl_loss: true}\n",
    )
    assert load_config(verl) == load_config(tiny, ["rollout.n=16", "actor.optim.lr=3e-4", "actor.use_kl_loss=true"])
    both = _write(tmp_path, "both", "rollout: {n: 4}\nactor_rollout_ref: {rollout: {n: 16}}\n")
    with pytest.raises(ValueError, match="'rollout.n' is set twice, directly and as verl's"):
        load_config(both)


@pytest.mark.parametrize(
    "key, hint",
    [
        ("actor_rollout_ref.rollout.nn", "did you mean 'rollout.n'?"),
        ("actor.optm.lr", "did you mean 'actor.optim.lr'?"),
        ("ppo_mini_batch", "did you mean 'actor.ppo_mini_batch_size'?"),
        ("critic.optim.lrr", "did you mean 'critic.optim.lr'?"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", "maps to rlake's rollout.*, which has no such key"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.* has no rlake counterpart"),
    ],
)
def test_unknown_key_says_what_why_and_the_closest_key(key: str, hint: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_config(None, [f"{key}=4"])
    text = str(info.value)
    assert f"unknown config key '{key}' (value 4)" in text and "typo cannot be silently ignored" in text
    assert hint in text


def test_rlake_config_prints_flat_keys_and_the_hash(capsys) -> None:
    from pipelines.cli import main

    grpo = str(CONFIGS[0].parent / "grpo.yaml")
    assert main(["config", "--config", grpo, "actor_rollout_ref.rollout.n=16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cfg = load_config(grpo, ["rollout.n=16"])
    assert lines[0] == "seed: 0" and "rollout.n: 16" in lines and "actor.use_kl_loss: true" in lines
    assert len(lines) == len(flatten(cfg.model_dump(mode="json"))) + 1
    assert lines[-1] == f"# config hash: {cfg.config_hash()}"
    assert yaml.safe_load("\n".join(lines)) == flatten(cfg.model_dump(mode="json"))  # each value is valid YAML


def test_rlake_config_yaml_is_a_full_config(tmp_path: Path, capsys) -> None:
    from pipelines.cli import main

    smol = CONFIGS[0].parent / "smollm2_gsm8k_cpu.yaml"
    assert main(["config", "--config", str(smol), "--yaml"]) == 0
    written = _write(tmp_path, "resolved", capsys.readouterr().out)
    assert load_config(written) == load_config(smol)


def test_rlake_config_reports_a_typo(capsys) -> None:
    from pipelines.cli import main

    assert main(["config", "actor_rollout_ref.rollout.nn=4"]) == 2
    assert "did you mean 'rollout.n'?" in capsys.readouterr().err


def test_a_hash_in_an_override_is_text_not_a_yaml_comment(capsys) -> None:
    """The shell has removed comments already: every '#' in `key=value` is the user's (issue #35)."""
    from pipelines.cli import main

    regex = r"#### Score: (#\d+)"  # YAML alone reads None (the whole value a comment)
    assert main(["config", "--config", "configs/ci_tiny.yaml", f"reward.judge.score_regex={regex}"]) == 0
    assert f"reward.judge.score_regex: '{regex}'" in capsys.readouterr().out
    cfg = load_config(None, ["trainer.project_name=a #b", "rollout.stop=[a, #b]", "reward.judge.score_regex=S: (\\d)"])
    assert cfg.trainer.project_name == "a #b" and cfg.reward.judge.score_regex == "S: (\\d)"  # not 'a', {'S': ...}
    assert list(cfg.rollout.stop) == ["a", "#b"]
    assert load_config(None, ["data.max_prompt_length=64", "rollout.n=8"]).rollout.n == 8  # YAML types kept
    assert main(["config", "--config", "configs/ci_tiny.yaml", "data.max_prompt_length=512 # tokens"]) == 2
    err = capsys.readouterr().err
    assert "(got '512 # tokens')" in err and "'#' in a key=value override is text, not a YAML comment" in err
