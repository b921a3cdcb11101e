"""Shared fixtures: offline HF, one local Ray cluster per session, a tiny checkpoint."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ACCEPT_CLOUD_SDK_WARNING", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FIRST = (
    "tests/pipelines/test_webserver.py",
    "tests/e2e/test_resume.py",
    "tests/e2e/test_one_step_off.py",
    "tests/e2e/test_main_job.py",
    "tests/e2e/test_algorithms.py",
    "tests/stages/test_placement.py",
    "tests/e2e/test_multiturn_train.py",
    "tests/e2e/test_grpo_iteration.py",
    "tests/e2e/test_replay.py",
    "tests/e2e/test_rescore.py",
    "tests/pipelines/test_recorded_versions.py",
    "tests/stages/test_fsdp_backend.py",
    "tests/e2e/test_vllm_train.py",
    "tests/pipelines/test_cli_train.py",
)
"""The longest modules (docs/testing.md), started first so that `-n 2` (scripts/test.sh) ends with short ones on
both workers instead of one long module on one."""


def pytest_collection_modifyitems(config, items) -> None:
    """Start the longest modules first (FIRST); each module's tests stay together."""
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(FIRST)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # the namespace stages.workers.group.ensure_ray gives a local cluster (named, detached worker actors)
        # address="local": a new cluster of this process, never a cluster another test (or xdist worker) started
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            namespace="rlake",
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 + char tokenizer saved in HF format."""
    import transformers

    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    transformers.utils.logging.disable_progress_bar()
    out = tmp_path_factory.mktemp("tiny") / "policy_v0"
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0)
    save_policy(model, tok, out)
    return out


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS S3 on 127.0.0.1 with bucket `rlake` (tests/servers.py), stopped by pid at the end."""
    from tests.servers import start_s3

    server = start_s3(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The S3 server's credentials and endpoint in this process's environment (as a cluster node has them)."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """PostgreSQL 15 in a temp dir on 127.0.0.1 (tests/servers.py), stopped at the end."""
    from tests.servers import start_postgres

    server = start_postgres(tmp_path_factory.mktemp("pg"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ci_tiny_pristine(tmp_path_factory, ray_session) -> tuple[Path, dict]:
    """The shared 2-iteration ci_tiny run (tests/shared_run.py), trained once per test session even under
    pytest-xdist: the first worker that needs it trains it under a file lock in the directory all workers share,
    the other reuses it. Never modified: modules use `ci_tiny_run`, their own copy."""
    from tests.shared_run import shared_pristine

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-N: the session's directory, above each worker's
    return shared_pristine(root / "ci_tiny_shared")


@pytest.fixture(scope="module")
def ci_tiny_run(ci_tiny_pristine, tmp_path_factory, request) -> tuple[Path, dict]:
    """(this module's own copy of the shared ci_tiny run, the run's summary), DAGSTER_HOME set to the copy's."""
    from tests.shared_run import copy_run

    pristine, summary = ci_tiny_pristine
    out = copy_run(pristine, tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "run")
    yield out, summary
    os.environ.pop("DAGSTER_HOME", None)
