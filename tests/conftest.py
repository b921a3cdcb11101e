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


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # the namespace stages.workers.group.ensure_ray gives a local cluster (named, detached worker actors)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="rlake")
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
