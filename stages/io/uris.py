"""Storage URIs: where a run's tables and checkpoints live, as strings that cross nodes unchanged.

Rule of cluster mode (DESIGN.md): no local path crosses a node; a durable hand-off is a URI under
`storage.root`. A root is `file:///abs/dir` or `s3://bucket/prefix`; the default (storage.root null) is
`file://<trainer.output_dir>`, today's layout. URIs are joined as strings, never through `pathlib`, which
turns `s3://b/t` into `s3:/b/t`. A `file://` URI is handed to delta-rs and the file system as the plain
absolute path it names, so local runs keep the paths they always had.

Credentials never come from here: delta-rs and obstore read AWS_* (or other) variables from the environment
of the process that opens the table; `storage.options` holds only what is not secret (endpoint, region,
allow_http), and ray.runtime_env.env_vars_from forwards the environment's credentials to the workers.

A `StorageURI` is a URI that carries those options: `RolloutStoreResource.uri(table)` returns one, so the
store functions (stages/io/store.py), a worker's request (it pickles with its options) and `join` under it
open the table with the run's options without each caller passing them. Options given explicitly win.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from configs.schema import RunConfig

SCHEMES = ("file", "s3")


def scheme(uri: str) -> str:
    """'s3' for s3://..., 'file' for file://... and for a plain path; another scheme is a ValueError."""
    uri = str(uri)
    if "://" not in uri:
        return "file"
    found = urlparse(uri).scheme
    if found not in SCHEMES:
        raise ValueError(
            f"'{uri}' has scheme '{found}://', which rlake cannot store tables or checkpoints under: it knows "
            f"{', '.join(s + '://' for s in SCHEMES)}; use e.g. s3://bucket/prefix or a local path"
        )
    return found


def is_local(uri: str) -> bool:
    return scheme(uri) == "file"


def local_path(uri: str) -> Path:
    """The file-system path of a file:// URI (or plain path); a remote URI is a ValueError."""
    uri = str(uri)
    if not is_local(uri):
        raise ValueError(f"'{uri}' is not on the local file system: open it through its storage URI instead")
    return Path(unquote(urlparse(uri).path)) if uri.startswith("file://") else Path(uri)


class StorageURI(str):
    """A storage URI (a plain `str` everywhere) plus the delta-rs storage_options to open it with (None: a
    local path, or a remote one whose options all come from the environment). Survives pickling (a Ray
    task's request) and `join`; `str(uri)` or an f-string drops the options."""

    storage_options: dict[str, str] | None

    def __new__(cls, uri: str | Path, storage_options: Mapping[str, str] | None = None) -> StorageURI:
        obj = super().__new__(cls, str(uri))
        obj.storage_options = dict(storage_options) if storage_options else None
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageURI, (str(self), self.storage_options))


def with_options(uri: str | Path, storage_options: Mapping[str, str] | None) -> str:
    """`uri` carrying `storage_options` (a StorageURI) when there are options, else the plain string."""
    return StorageURI(uri, storage_options) if storage_options else str(uri)


def options_of(uri: str | Path, storage_options: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The options to open `uri` with: `storage_options` when given, else those `uri` carries (a StorageURI),
    else None; always None for a local URI (delta-rs takes none for local paths)."""
    if is_local(str(uri)):
        return None
    if storage_options:
        return dict(storage_options)
    carried = getattr(uri, "storage_options", None)
    return dict(carried) if carried else None


def normalize(uri: str | Path) -> str:
    """A storage URI as rlake hands it around: s3://bucket/prefix without a trailing slash; a local one as
    its absolute path (what delta-rs, DuckDB and the file system all take). Options a StorageURI carries stay."""
    text = str(uri)
    out = str(local_path(text).expanduser().resolve()) if is_local(text) else text.rstrip("/")
    return with_options(out, getattr(uri, "storage_options", None))


def join(root: str | Path, *parts: str) -> str:
    """root/part/...: string join that keeps `s3://` intact (pathlib would collapse it to `s3:/`), and the
    options of a StorageURI root."""
    out = str(normalize(root))
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = f"{out}/{part}"
    return with_options(out, getattr(root, "storage_options", None))


def target(uri: str | Path) -> str:
    """What delta-rs opens: a local URI as its plain path (file:// stripped), a remote one unchanged."""
    return str(local_path(str(uri))) if is_local(str(uri)) else str(uri).rstrip("/")


def name(uri: str | Path) -> str:
    """The last segment of a URI (a table's name under its tables root)."""
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


CLIENT_OPTIONS = (
    "allow_http", "allow_invalid_certificates", "connect_timeout", "pool_idle_timeout", "pool_max_idle_per_host",
    "proxy_url", "randomize_addresses", "read_timeout", "timeout", "user_agent",
)  # fmt: skip
"""delta-rs options that obstore takes as HTTP-client options (the rest are aws_* store options)."""


def obstore_config(storage_options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, Any]]:
    """(store config, client options) for obstore from delta-rs style options: AWS_ENDPOINT_URL ->
    aws_endpoint_url, AWS_ALLOW_HTTP=true -> client allow_http=True."""
    config: dict[str, str] = {}
    client: dict[str, Any] = {}
    for key, value in (storage_options or {}).items():
        low = key.lower()
        bare = low.removeprefix("aws_")
        if bare in CLIENT_OPTIONS:
            flag = bare in ("allow_http", "allow_invalid_certificates", "randomize_addresses")
            client[bare] = str(value).lower() in ("true", "1", "yes") if flag else value
        else:
            config[low if low.startswith("aws_") else f"aws_{low}"] = value
    return config, client


def object_store(uri: str, storage_options: Mapping[str, str] | None = None):
    """An obstore store rooted at remote `uri` (the `cluster` extra), configured from delta-rs style options
    (explicit, else those a StorageURI carries); credentials come from the environment as for delta-rs."""
    try:
        from obstore.store import from_url  # noqa: PLC0415 - only remote roots need obstore
    except ImportError as exc:
        raise ImportError(
            f"opening '{uri}' needs obstore, which rlake's `cluster` extra installs: "
            "bash scripts/install.sh dev,cluster (or pip install obstore)"
        ) from exc
    config, client = obstore_config(options_of(uri, storage_options))
    try:
        return from_url(str(uri).rstrip("/"), config=config or None, client_options=client or None)
    except BaseException as exc:  # obstore panics (a BaseException) on a key it does not know
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(
            f"cannot open '{uri}' with storage options {sorted(config) + sorted(client)}: {exc}; storage.options "
            "takes delta-rs / object_store S3 keys (AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP, ...): fix or drop "
            "the key"
        ) from None


def list_dirs(uri: str | Path, storage_options: Mapping[str, str] | None = None) -> list[str]:
    """Names of the 'directories' directly under `uri` (sorted): a local directory's subdirectories, or the
    common prefixes of a remote prefix. A local `uri` that is not a directory is a FileNotFoundError."""
    if is_local(str(uri)):
        root = local_path(str(uri))
        if not root.is_dir():
            raise FileNotFoundError(f"'{root}' is not a directory")
        return sorted(p.name for p in root.iterdir() if p.is_dir())
    listing = object_store(str(uri), storage_options).list_with_delimiter()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"])


def storage_root(cfg: RunConfig) -> str:
    """storage.root, else trainer.output_dir (as an absolute path)."""
    return normalize(cfg.storage.root or cfg.trainer.output_dir)


def tables_root(cfg: RunConfig) -> str:
    """Where the run's Delta tables live: <storage root>/tables."""
    return join(storage_root(cfg), "tables")


def checkpoints_root(cfg: RunConfig) -> str:
    """Where the run's committed checkpoints live: <storage root>/checkpoints."""
    return join(storage_root(cfg), "checkpoints")


def storage_options(cfg: RunConfig, uri: str | None = None) -> dict[str, str] | None:
    """delta-rs storage_options for `uri` (default: the storage root): storage.options for a remote root,
    None for a local one (delta-rs takes no options for local paths)."""
    uri = uri if uri is not None else storage_root(cfg)
    if is_local(uri) or not cfg.storage.options:
        return None
    return dict(cfg.storage.options)


def table_uri(cfg: RunConfig, table: str) -> str:
    """<tables root>/<table>, carrying storage.options (a StorageURI) when the root is remote."""
    root = tables_root(cfg)
    return join(with_options(root, storage_options(cfg, root)), table)
