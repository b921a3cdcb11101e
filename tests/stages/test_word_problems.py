"""GSM8K-style word problems (stages/data/word_problems.py) and the SmolLM2 checkpoint resolution."""

from __future__ import annotations

import os
import re

import pandas as pd
import pytest

from configs.schema import RunConfig, SyntheticTaskConfig
from stages.data.datasets import generate_synthetic_task, read_verl_parquet
from stages.data.rewards import reward_fn_for, score_gsm8k
from stages.data.word_problems import (
    INSTRUCTION,
    TEMPLATES,
    WORD_PROBLEM_SOURCE,
    generate_word_problem_task,
)
from stages.models.smollm2 import (
    SMOLLM2_NAME,
    default_cache_dir,
    ensure_smollm2_checkpoint,
    resolve_model_path,
)
from stages.prompts import build_prompt_rows


def recompute(template: str, steps: int, question: str) -> int:
    """The answer from the question's own numbers, written independently of the generator."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    if template == "shopping":  # "buys a ... $p each [and pays with $bill]"
        return n[0] * n[1] if steps == 1 else n[2] - n[0] * n[1]
    if template == "ages":  # "a years old ... b years older [in c years]"
        return sum(n[:2]) if steps == 1 else sum(n[:3])
    if template == "rates":  # "r toys every hour ... h hours [k broken]"
        return n[0] * n[1] if steps == 1 else n[0] * n[1] - n[2]
    if template == "collections":  # "has a ... gives b [finds c]"
        return n[0] - n[1] if steps == 1 else n[0] - n[1] + n[2]
    if template == "sharing":  # "shares total among k [loses c]"
        return n[0] // n[1] if steps == 1 else n[0] // n[1] - n[2]
    if template == "travel":  # "s miles per hour for h hours [walks w]"
        return n[0] * n[1] if steps == 1 else n[0] * n[1] + n[2]
    raise AssertionError(f"untested template {template}")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> tuple[pd.DataFrame, pd.DataFrame]:
    out = tmp_path_factory.mktemp("wp")
    train, val = generate_word_problem_task(
        out, SyntheticTaskConfig(task="word_problems", num_train=400, num_val=60, max_operand=20, max_steps=2, seed=3)
    )
    return pd.read_parquet(train), pd.read_parquet(val)


def test_answers_are_correct_by_recomputation(task) -> None:
    for df in task:
        for prompt, rm, info in zip(df["prompt"], df["reward_model"], df["extra_info"]):
            question = info["question"]
            assert prompt[0]["content"] == f"{question} {INSTRUCTION}"
            answer = int(rm["ground_truth"])
            assert answer >= 0
            assert answer == recompute(info["template"], int(info["steps"]), question), question
            for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", info["answer"]):  # every worked step
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) / int(b)}[
                    op
                ] == int(c), info["answer"]
            assert info["answer"].endswith(f"#### {answer}")


def test_all_templates_and_both_step_counts_appear(task) -> None:
    train, _ = task
    seen = {(i["template"], int(i["steps"])) for i in train["extra_info"]}
    assert seen == {(t, s) for t in TEMPLATES for s in (1, 2)}


def test_split_is_disjoint_and_seeded(task, tmp_path) -> None:
    train, val = task
    tq = {i["question"] for i in train["extra_info"]}
    vq = {i["question"] for i in val["extra_info"]}
    assert len(tq) == 400 and len(vq) == 60 and not tq & vq
    cfg = SyntheticTaskConfig(task="word_problems", num_train=400, num_val=60, max_operand=20, max_steps=2, seed=3)
    again, _ = generate_synthetic_task(tmp_path, cfg)  # dispatch through stages.data.datasets; same seed, same file
    assert pd.read_parquet(again).equals(train)
    other, _ = generate_synthetic_task(tmp_path / "s4", cfg.model_copy(update={"seed": 4}))
    assert not pd.read_parquet(other).equals(train)


def test_parquet_is_verl_valid_and_gold_scores_one(task, tmp_path) -> None:
    cfg = SyntheticTaskConfig(task="word_problems", num_train=50, num_val=10, max_operand=12, seed=0)
    train_path, _ = generate_word_problem_task(tmp_path, cfg)
    rows = read_verl_parquet(train_path, "train")  # the ingest validator: columns, message structs, ground truth
    assert len(rows) == 50 and set(rows["data_source"]) == {WORD_PROBLEM_SOURCE}
    assert reward_fn_for(WORD_PROBLEM_SOURCE) is score_gsm8k
    train, _ = task
    for rm, info in zip(train["reward_model"], train["extra_info"]):
        gold = info["answer"]
        assert score_gsm8k(gold, rm["ground_truth"]) == 1.0
        assert score_gsm8k(gold.replace("####", "answer:"), rm["ground_truth"]) == 0.0  # no "####": no credit
        wrong = f"#### {int(rm['ground_truth']) + 1}"
        assert score_gsm8k(wrong, rm["ground_truth"], format_score=0.1) == 0.1


def test_ingest_generates_word_problems_from_config(tmp_path) -> None:
    cfg = RunConfig.model_validate(
        {
            "data": {
                "synthetic": {"task": "word_problems", "num_train": 40, "num_val": 8, "max_operand": 10},
                "train_batch_size": 8,
            },
            "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size": 8},
            "trainer": {"output_dir": str(tmp_path)},
        }
    )
    df = build_prompt_rows(cfg)
    assert (tmp_path / "data" / "word_problems_seed0" / "train.parquet").is_file()
    assert df["split"].value_counts().to_dict() == {"train": 40, "val": 8}
    assert set(df["data_source"]) == {WORD_PROBLEM_SOURCE}


def test_bad_settings_say_what_to_change(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_steps .* must be 1 or 2"):
        generate_word_problem_task(tmp_path, SyntheticTaskConfig(task="word_problems", max_steps=3))
    with pytest.raises(ValueError, match="max_operand .* must be >= 5"):
        generate_word_problem_task(tmp_path, SyntheticTaskConfig(task="word_problems", max_operand=4))


def test_named_model_resolution_is_idempotent(tmp_path, monkeypatch) -> None:
    assert resolve_model_path("tiny") == "tiny"
    assert resolve_model_path("/some/hf/dir") == "/some/hf/dir"
    cache = default_cache_dir()
    if not (cache / "model.safetensors").is_file():
        pytest.skip(f"no converted SmolLM2 checkpoint at {cache} (converting takes ~50 s; run the bench once)")
    link = tmp_path / "smol"
    link.mkdir()
    for f in cache.iterdir():  # a converted directory (symlinked): returned as is, nothing rewritten
        os.symlink(f, link / f.name)
    before = {f.name: f.lstat().st_mtime_ns for f in link.iterdir()}
    monkeypatch.setenv("RLAKE_SMOLLM2_DIR", str(link))
    assert resolve_model_path(SMOLLM2_NAME) == str(link) == ensure_smollm2_checkpoint(link)
    assert {f.name: f.lstat().st_mtime_ns for f in link.iterdir()} == before
    from stages.models.policy import load_tokenizer

    tok = load_tokenizer(link)
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_fewshot_examples_are_worked_distinct_and_never_asked(tmp_path) -> None:
    cfg = SyntheticTaskConfig(task="word_problems", num_train=100, num_val=20, max_operand=10, max_steps=1, fewshot=2)
    train, val = (pd.read_parquet(p) for p in generate_word_problem_task(tmp_path, cfg))
    contents = [p[0]["content"] for df in (train, val) for p in df["prompt"]]
    prefix = contents[0].rsplit("Question: ", 1)[0]
    assert all(c.startswith(prefix) for c in contents)  # the same examples before every question
    shots = re.findall(r"Question: (.*?)\nAnswer: (.*?)\n#### (\d+)\n\n", prefix)
    assert len(shots) == 2
    asked = {i["question"] for df in (train, val) for i in df["extra_info"]}
    for question, solution, answer in shots:
        assert question not in asked
        assert score_gsm8k(f"{solution}\n#### {answer}", answer) == 1.0
    for c, info in zip(contents, [i for df in (train, val) for i in df["extra_info"]]):
        assert c == f"{prefix}Question: {info['question']} {INSTRUCTION}"
