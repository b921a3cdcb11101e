"""Storage URIs: where a run's tables and checkpoints live, as strings that cross nodes unchanged.

Rule of cluster mode (DESIGN.md): no local path crosses a node; a durable hand-off is a URI under
`storage.root`. A root is `file:///abs/dir` or `s3://bucket/prefix`; the default (storage.root null) is
`file://<trainer.output_dir>`, today's layout. URIs are joined as strings, never through `pathlib`, which
turns `s3://b/t` into `s3:/b/t`. A `file://` URI is handed to delta-rs and the file system as the plain
absolute path it names, so local runs keep the paths they always had.

Credentials never come from here: delta-rs and obstore read AWS_* (or other) variables from the environment
of the process that opens the table; `storage.options` holds only what is not secret (endpoint, region,
allow_http), and ray.runtime_env.env_vars_from forwards the environment's credentials to the workers.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from configs.schema import RunConfig

SCHEMES = ("file", "s3")


def scheme(uri: str) -> str:
    """'s3' for s3://..., 'file' for file://... and for a plain path."""
    parsed = urlparse(str(uri))
    return parsed.scheme if parsed.scheme in SCHEMES and "://" in str(uri) else "file"


def is_local(uri: str) -> bool:
    return scheme(uri) == "file"


def local_path(uri: str) -> Path:
    """The file-system path of a file:// URI (or plain path); a remote URI is a ValueError."""
    uri = str(uri)
    if not is_local(uri):
        raise ValueError(f"'{uri}' is not on the local file system: open it through its storage URI instead")
    return Path(unquote(urlparse(uri).path)) if uri.startswith("file://") else Path(uri)


def normalize(uri: str | Path) -> str:
    """A storage URI as rlake hands it around: s3://bucket/prefix without a trailing slash; a local one as
    its absolute path (what delta-rs, DuckDB and the file system all take)."""
    uri = str(uri)
    if is_local(uri):
        return str(local_path(uri).expanduser().resolve())
    return uri.rstrip("/")


def join(root: str | Path, *parts: str) -> str:
    """root/part/...: string join that keeps `s3://` intact (pathlib would collapse it to `s3:/`)."""
    out = normalize(root)
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = f"{out}/{part}"
    return out


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
