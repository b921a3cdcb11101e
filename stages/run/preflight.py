"""Checks of a run's input before any expensive work (warm start, Ray, Dagster).

`rlake train` calls `preflight(cfg)` right after parsing the config (configs.errors.load_run_config),
so bad input fails in seconds with a what / why / fix message instead of minutes into a run: malformed
or missing parquet columns, an unknown data_source, too few prompts, prompts over
data.max_prompt_length, a model.path that is not a causal-LM checkpoint, and a distillation teacher that is
missing or reads tokens with another tokenizer than the student's.

A custom reward function (reward.custom_reward_function) is loaded as the Ray tasks will load it (file
read, source exec'd, function looked up, signature checked) and then called ONCE: on the first training
prompt with its ground truth as the response. verl does not probe; rlake does, so a function that returns
a string, a dict without "score" or an extra key named like an rlake column fails here in seconds instead
of after minutes of generation. The probe costs one call (mind it if the function calls a paid service).
"""

from __future__ import annotations

from pathlib import Path

from configs.schema import ModelConfig, RunConfig
from stages.data.custom_reward import parse_extra_info, read_custom_reward
from stages.models.policy import load_tokenizer
from stages.models.tiny import build_char_tokenizer
from stages.prompt_batches import tokenize_prompts
from stages.prompts import build_prompt_rows
from stages.reward_model import check_reward_model_dir
from stages.run.resume import check_causal_lm_dir
from stages.scored_rollouts import load_custom_reward, probe_custom_reward
from stages.teacher_logprobs import check_teacher_tokenizer, teacher_dir
from stages.workers.connect import check_cluster_auth


def preflight_tokenizer(model_cfg: ModelConfig):
    """The tokenizer the run will use, without loading weights (None when it is built later, e.g. a GGUF)."""
    if model_cfg.path == "tiny":
        return build_char_tokenizer(tool_tokens=model_cfg.tiny.tool_tokens)
    if not Path(model_cfg.path).is_dir():
        return None  # a named model that a stage builds (stages/initial_policy.py) validates itself
    check_causal_lm_dir(model_cfg.path, what="model.path")
    return load_tokenizer(model_cfg.path)


def preflight(cfg: RunConfig) -> dict:
    """Validate data and model input of RunConfig `cfg`; returns counts (rows, train, longest prompt)."""
    check_cluster_auth(cfg.ray.address)  # a cluster without token auth fails here, before Dagster or Ray start
    if cfg.reward.reward_model.enable:  # a checkpoint without a one-label classification head fails here
        check_reward_model_dir(cfg.reward.reward_model.model_path)
    if cfg.reward.judge.enable:  # the judge generates: a causal-LM checkpoint with a tokenizer
        check_causal_lm_dir(cfg.reward.judge.model_path, what="reward.judge.model_path")
        load_tokenizer(cfg.reward.judge.model_path)
    custom = read_custom_reward(cfg.reward.custom_reward_function)  # missing file
    if custom is not None:
        load_custom_reward(custom)  # import error (with its line), missing function, wrong signature
    rows = build_prompt_rows(cfg)  # parquet columns and types, data_source, train_batch_size <= prompts
    out = {"rows": len(rows), "train": int((rows["split"] == "train").sum())}
    if custom is not None:  # what the function returns, on one call
        first = rows[rows["split"] == "train"].iloc[0]
        gt = first["reward_model"]["ground_truth"]
        row = {"data_source": first["data_source"], "solution_str": gt, "ground_truth": gt}
        out["reward_probe"] = probe_custom_reward(custom, {**row, "extra_info": parse_extra_info(first["extra_info"])})
    tok = preflight_tokenizer(cfg.model)
    if cfg.algorithm.distillation.enable:  # no teacher, not a causal LM, or another tokenizer: fails here
        teacher = teacher_dir(cfg)
        check_causal_lm_dir(teacher, what="algorithm.distillation.teacher_model_path")
        if tok is not None:
            check_teacher_tokenizer(teacher, tok)
    if tok is not None:
        ids, _ = tokenize_prompts(
            list(rows["prompt"]), tok, cfg.data.max_prompt_length, prompt_ids=list(rows["prompt_id"])
        )
        out["longest_prompt"] = max(len(x) for x in ids)
    return out
