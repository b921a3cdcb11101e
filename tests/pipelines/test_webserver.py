"""The Dagster UI as the cockpit, driven the way a user drives it: the webserver and the daemon on 127.0.0.1 in a
temp DAGSTER_HOME, every launch over the webserver's GraphQL API.

One scenario (module fixture `cockpit`), then assertions on what it left:
- run `ui-a`: set-up and iteration 0 launched with a launch-time config change (rollout.n=8; ci_tiny says 4),
  iteration 0 as the whole job (stages this GRPO config lacks write nothing); the daemon's sensor launches
  iteration 1 with the same run config and only this config's stages, and stops after total_training_steps;
- run `ui-b`: set-up with the code location's default config (one iteration), chained by the sensor;
- one partition of one run re-scored (scored_rollouts of 0|ui-a alone) while the second run exists: its
  advantages turn stale in that partition only;
- trainer_state.json, Delta tables, checks and plots as the UI shows them; headless Chromium renders the asset
  graph, the launchpad with an rlake config, the partition view with two runs and the asset pages with plots and
  checks (PNGs kept in RLAKE_SCREENSHOTS_DIR when set: `RLAKE_SCREENSHOTS_DIR=docs/screenshots pytest
  tests/pipelines/test_webserver.py` redoes the docs' PNGs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from configs.schema import load_config
from stages.io import store
from stages.io.ports import free_port
from stages.run.resume import read_trainer_state, trainer_state

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "configs" / "ci_tiny.yaml"
A, B = "ui-a", "ui-b"


def _gql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        method="POST",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.loads(resp.read())
    assert "errors" not in body, body
    return body["data"]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process group we started, by its id (the webserver may ignore SIGTERM: escalate)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


class Cockpit:
    def __init__(self, port: int, out: Path, ray_address: str) -> None:
        self.port, self.out, self.ray_address = port, out, ray_address
        repo = _gql(
            port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }"
        )
        (self.repo,) = repo["repositoriesOrError"]["nodes"]
        self.runs: dict[str, str] = {}

    @property
    def repo_selector(self) -> dict:
        return {"repositoryLocationName": self.repo["location"]["name"], "repositoryName": self.repo["name"]}

    @property
    def repo_path(self) -> str:
        return f"{self.repo['name']}@{self.repo['location']['name']}"

    def overrides(self, *extra: str) -> list[str]:
        """The launch-time overrides: where this test's run writes, this test's Ray cluster, and `extra`."""
        return [f"trainer.output_dir={self.out}", f"ray.address={self.ray_address}", *extra]

    def add_partition(self, dimension: str, key: str) -> None:
        added = _gql(
            self.port,
            """mutation($r: RepositorySelector!, $d: String!, $k: String!) { addDynamicPartition(
            repositorySelector: $r, partitionsDefName: $d, partitionKey: $k) { __typename } }""",
            {"r": self.repo_selector, "d": dimension, "k": key},
        )["addDynamicPartition"]["__typename"]
        assert added in ("AddDynamicPartitionSuccess", "DuplicateDynamicPartitionError"), added

    def launch(
        self,
        job: str,
        run_id: str,
        *,
        iteration: int | None = None,
        overrides: list[str] | None = None,
        assets: list[str] | None = None,
    ) -> str:
        """Launch `job` for run `run_id` (and iteration), like the launchpad: a run_config resource config when
        `overrides` is given (else the code location's default), only `assets` when given."""
        selector = {**self.repo_selector, "jobName": job}
        if assets:
            selector["assetSelection"] = [{"path": [a]} for a in assets]
        if iteration is None:
            tags = [{"key": "dagster/partition", "value": run_id}]
        else:
            tags = [
                {"key": "dagster/partition", "value": f"{iteration}|{run_id}"},
                {"key": "dagster/partition/iteration", "value": str(iteration)},
                {"key": "dagster/partition/run", "value": run_id},
            ]
        run_config = {} if overrides is None else {"resources": {"run_config": {"config": {"overrides": overrides}}}}
        params = {"selector": selector, "runConfigData": run_config, "executionMetadata": {"tags": tags}}
        launched = _gql(
            self.port,
            """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
              __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
              ... on RunConfigValidationInvalid { errors { message } } } }""",
            {"p": params},
        )["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return launched["run"]["runId"]

    def wait(self, run_id: str, timeout_s: float = 300) -> str:
        status = None
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            status = self.run(run_id)["status"]
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                break
            time.sleep(1)
        return status

    def run(self, run_id: str) -> dict:
        return _gql(
            self.port,
            """query($id: ID!) { runOrError(runId: $id) { ... on Run { status runConfigYaml stepKeysToExecute
              assetSelection { path } tags { key value } } } }""",
            {"id": run_id},
        )["runOrError"]

    def messages(self, run_id: str) -> str:
        """Every event message and error message of a run, one per line (what the run's page shows)."""
        events = _gql(
            self.port,
            """query($id: ID!) { logsForRun(runId: $id, limit: 1000) { ... on EventConnection { events {
              ... on MessageEvent { message } ... on ErrorEvent { error { message } } } } } }""",
            {"id": run_id},
        )["logsForRun"]["events"]
        return "\n".join(f"{e.get('message', '')} {(e.get('error') or {}).get('message', '')}" for e in events)

    def runs_of_partition(self, key: str) -> list[str]:
        rows = _gql(
            self.port,
            """query($k: String!) { runsOrError(filter: {tags: [{key: "dagster/partition", value: $k}]}) {
              ... on Runs { results { runId } } } }""",
            {"k": key},
        )["runsOrError"]["results"]
        return [r["runId"] for r in rows]

    def wait_for_sensor_run(self, key: str, timeout_s: float = 180) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = self.runs_of_partition(key)
            if found:
                return found[0]
            time.sleep(2)
        raise TimeoutError(f"the sensor launched no run of partition {key} in {timeout_s} s")

    def set_sensor(self, on: bool) -> None:
        selector = {**self.repo_selector, "sensorName": "next_iteration_sensor"}
        if on:
            res = _gql(
                self.port,
                """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename
                  ... on Sensor { sensorState { status } } ... on PythonError { message } } }""",
                {"s": selector},
            )["startSensor"]
            assert res["__typename"] == "Sensor" and res["sensorState"]["status"] == "RUNNING", res
        else:
            state_id = _gql(
                self.port,
                """query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { ... on Sensor {
                  sensorState { id } } } }""",
                {"s": selector},
            )["sensorOrError"]["sensorState"]
            _gql(
                self.port,
                """mutation($i: String) { stopSensor(id: $i) { __typename } }""",
                {"i": state_id["id"]},
            )

    def stale(self, asset: str, partitions: list[str]) -> list[str]:
        node = _gql(
            self.port,
            """query($k: [AssetKeyInput!], $p: [String!]!) { assetNodes(assetKeys: $k) {
              staleStatusByPartition(partitions: $p) } }""",
            {"k": [{"path": [asset]}], "p": partitions},
        )["assetNodes"][0]
        return node["staleStatusByPartition"]

    def check(self, asset: str, check: str, partition: str) -> dict:
        """The latest execution of check `check` of `asset` in `partition`."""
        rows = _gql(
            self.port,
            """query($k: AssetKeyInput!, $c: String!, $p: String) {
              assetCheckExecutions(assetKey: $k, checkName: $c, limit: 5, partition: $p) {
              status partition evaluation { severity metadataEntries { label } } } }""",
            {"k": {"path": [asset]}, "c": check, "p": partition},
        )["assetCheckExecutions"]
        assert rows, f"no execution of {asset}:{check} in partition {partition}"
        return rows[0]

    def metadata(self, asset: str, partition: str) -> dict[str, object]:
        """Label -> value of the latest materialization of `asset` in `partition` (bool, text, float, int)."""
        mats = _gql(
            self.port,
            """query($k: AssetKeyInput!, $p: [String!]) { assetOrError(assetKey: $k) { ... on Asset {
              assetMaterializations(partitions: $p, limit: 1) { metadataEntries { label
                ... on BoolMetadataEntry { boolValue } ... on TextMetadataEntry { text }
                ... on FloatMetadataEntry { floatValue } ... on IntMetadataEntry { intValue } } } } } }""",
            {"k": {"path": [asset]}, "p": [partition]},
        )["assetOrError"]["assetMaterializations"]
        assert mats, f"no materialization of {asset} in partition {partition}"
        entries = mats[0]["metadataEntries"]
        return {e["label"]: next((v for k, v in e.items() if k != "label"), None) for e in entries}


@pytest.fixture(scope="module")
def cockpit(tmp_path_factory, ray_session):
    port = free_port()
    tmp = tmp_path_factory.mktemp("cockpit")
    home = tmp / "dagster_home"
    home.mkdir()
    # runs launch at once (no queue), no "join the community" dialog over the pages, no telemetry
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n"
        "  class: DefaultRunCoordinator\nnux:\n  enabled: false\n"
        "telemetry:\n  enabled: false\n"
    )
    out = tmp / "out"
    address = ray_session.get_runtime_context().gcs_address
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "RLAKE_CONFIG": str(CI),
        # the code location's default: one iteration, written under out, on this test's Ray cluster (a run
        # process attaches in 0.1 s instead of starting a cluster in 10 s); no run id: the partition names it
        "RLAKE_OVERRIDES": f"trainer.output_dir={out};ray.address={address};trainer.total_training_steps=1",
    }
    bindir = Path(sys.executable).parent
    web = [str(bindir / "dagster-webserver"), "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)]
    daemon = [str(bindir / "dagster-daemon"), "run", "-w", str(ROOT / "workspace.yaml")]
    logs = tmp / "logs"
    logs.mkdir()
    procs = []

    def start(name: str, cmd: list[str]) -> None:
        with open(logs / f"{name}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log))

    try:
        # the webserver first: it creates the instance's sqlite storage, which two processes creating it at
        # once would corrupt (two alembic heads); then the daemon (sensors)
        start("webserver", web)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError(f"webserver did not come up in 120 s: {(logs / 'webserver.log').read_text()[-3000:]}")
        start("daemon", daemon)
        c = Cockpit(port, out, address)
        _scenario(c)
        yield c
    finally:
        for proc in procs:
            _stop(proc)


def _scenario(c: Cockpit) -> None:
    """Everything the tests below look at, in the order a user would do it."""
    c.add_partition("run", A)
    c.runs["setup-a"] = c.launch("rlake_setup_job", A, overrides=c.overrides("rollout.n=8"))
    assert c.wait(c.runs["setup-a"]) == "SUCCESS"
    c.set_sensor(True)  # from now on the daemon chains iterations (earlier successes are behind its cursor)
    c.add_partition("iteration", "0")
    c.runs["it0-a"] = c.launch(
        "rl_iteration_job", A, iteration=0, overrides=c.overrides("rollout.n=8", "trainer.total_training_steps=2")
    )
    assert c.wait(c.runs["it0-a"]) == "SUCCESS"
    c.runs["it1-a"] = c.wait_for_sensor_run(f"1|{A}")
    assert c.wait(c.runs["it1-a"]) == "SUCCESS"

    c.add_partition("run", B)  # a second run with the location's default config (1 iteration)
    c.runs["setup-b"] = c.launch("rlake_setup_job", B)
    assert c.wait(c.runs["setup-b"]) == "SUCCESS"
    c.runs["it0-b"] = c.wait_for_sensor_run(f"0|{B}")
    assert c.wait(c.runs["it0-b"]) == "SUCCESS"
    # a launch-time config that does not validate fails that run at start, with rlake's what/why/fix message; its
    # process starts while the sensor is watched (a failed set-up run chains nothing)
    c.runs["bad"] = c.launch("rlake_setup_job", B, overrides=c.overrides("rollout.nn=8"))
    time.sleep(12)  # two sensor intervals: nothing follows the last iterations
    c.set_sensor(False)

    c.scored_before = store.table_version(str(c.out / "tables" / "scored_rollouts"))
    c.runs["rescore"] = c.launch(
        "rl_iteration_job", A, iteration=0, assets=["scored_rollouts"], overrides=c.overrides("rollout.n=8")
    )
    assert c.wait(c.runs["bad"]) == "FAILURE"
    assert c.wait(c.runs["rescore"]) == "SUCCESS"


def _tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["tags"]}


def test_launch_time_config_is_used_by_every_stage_and_carried_by_the_sensor(cockpit) -> None:
    c = cockpit
    rollouts = store.read_partition(str(c.out / "tables" / "rollouts"), A, 1)
    assert rollouts.groupby("prompt_id").size().eq(8).all()  # rollout.n=8 from the launch, not ci_tiny's 4
    assert len(store.read_partition(str(c.out / "tables" / "rollouts"), B, 0).groupby("prompt_id").size()) > 0
    assert store.read_partition(str(c.out / "tables" / "rollouts"), B, 0).groupby("prompt_id").size().eq(4).all()

    it0, it1 = c.run(c.runs["it0-a"]), c.run(c.runs["it1-a"])
    assert yaml.safe_load(it1["runConfigYaml"]) == yaml.safe_load(it0["runConfigYaml"])  # carried as launched
    assert _tags(it1)["rlake/driver"] == "sensor" and _tags(it1)["rlake/run_id"] == A
    # the sensor selects this config's stages; the whole-job launch of iteration 0 ran the others as no-ops
    selected = {a["path"][-1] for a in it1["assetSelection"]}
    assert "values" not in selected and {"rollouts", "old_logprobs", "policy_checkpoint"} <= selected
    assert it0["stepKeysToExecute"] is None or "values" in it0["stepKeysToExecute"]  # None: every step
    assert c.metadata("values", f"0|{A}")["in_dag"] is False  # a GRPO run has no critic: nothing written
    assert not store.table_exists(str(c.out / "tables" / "values"))
    assert "in_dag" not in c.metadata("rollouts", f"0|{A}")
    assert c.runs_of_partition(f"2|{A}") == [] and c.runs_of_partition(f"1|{B}") == []  # chains end

    # one driver: the UI-launched run leaves the trainer_state.json `rlake train` leaves, for its launched config
    prompts = store.read_partition(str(c.out / "tables" / "prompts"), A, -1, columns=["split"])
    n_train = int((prompts["split"] == "train").sum())
    cfg = load_config(CI, [*c.overrides("rollout.n=8", "trainer.total_training_steps=2"), f"trainer.run_id={A}"])
    state = read_trainer_state(c.out / "checkpoints" / A / "policy_v2")
    assert state == json.loads(json.dumps(trainer_state(cfg, A, 2, n_train)))


def test_a_bad_launch_config_fails_the_run_saying_what_why_and_fix(cockpit) -> None:
    text = cockpit.messages(cockpit.runs["bad"])
    assert "unknown config key 'rollout.nn'" in text and "did you mean 'rollout.n'" in text, text[-3000:]


def test_rescoring_one_partition_of_one_run_marks_only_its_downstream_stale(cockpit) -> None:
    c = cockpit
    uri = str(c.out / "tables" / "scored_rollouts")
    assert store.table_version(uri) == c.scored_before + 1
    newest = store.commit_lineage(uri, run_id=A, iteration=0)[0]
    assert newest["version"] == c.scored_before + 1 and newest["upstream_version_source"] == '{"rollouts": "dagster"}'
    assert c.run(c.runs["rescore"])["stepKeysToExecute"] == ["scored_rollouts"]
    assert c.stale("advantages", [f"0|{A}", f"1|{A}", f"0|{B}"]) == ["STALE", "FRESH", "FRESH"]
    assert c.stale("scored_rollouts", [f"0|{A}"]) == ["FRESH"]


def test_checks_and_plot_metadata_of_every_partition(cockpit) -> None:
    c = cockpit
    for key in (f"0|{A}", f"1|{A}", f"0|{B}"):
        assert isinstance(c.metadata("scored_rollouts", key)["reward_mean"], float)
        assert isinstance(c.metadata("rollouts", key)["tokens_per_s"], float)
        assert isinstance(c.metadata("iteration_metrics", key)["actor/entropy"], float)
        weights = c.check("rollouts", "engine_weights_match_policy", key)
        assert weights["status"] == "SUCCEEDED", weights
        gap = c.check("old_logprobs", "rollout_probs_diff_within_limit", key)
        assert gap["status"] == "SUCCEEDED" and gap["evaluation"]["severity"] == "WARN", gap


SHOTS = {
    # name: (path, texts the page must show, a button to click, texts it must show after the click)
    "ui_asset_graph.png": ("asset-groups/ROLLOUT", ("prompt_batches", "rollouts", "scored_rollouts"), None, ()),
    "ui_launchpad.png": (
        "jobs/rl_iteration_job/playground/setup?config={config}",
        ("run_config", "overrides"),
        None,
        (),
    ),
    "ui_partitions_two_runs.png": ("/assets/rollouts?view=partitions", (A, B, "Materialized (3)"), None, ()),
    "ui_rollouts_checks.png": ("/assets/rollouts?view=checks", ("engine_weights_match_policy", "blocking"), None, ()),
    "ui_metrics_plots.png": (
        "/assets/iteration_metrics",
        ("Metadata", "critic/score/mean"),
        "Plots",
        ("actor/entropy",),
    ),
}


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        hint = "Debian: apt-get install -y --no-install-recommends chromium (.ci/run does)"
        if os.environ.get("RLAKE_REQUIRE_CHROMIUM"):
            pytest.fail(f"no chromium on PATH, and RLAKE_REQUIRE_CHROMIUM is set (CI must render the UI): {hint}")
        pytest.skip(f"no chromium on PATH ({hint})")
    return found


def test_ui_pages_render_in_headless_chromium(cockpit, tmp_path) -> None:
    """The pages a user looks at render with their content (checked in the page's text), as 1600x1000 PNGs."""
    from PIL import Image

    from tests.pipelines.chromium import Browser

    c = cockpit
    config = yaml.safe_dump({"resources": {"run_config": {"config": {"overrides": c.overrides("rollout.n=8")}}}})
    with Browser(_chromium()) as browser:
        for name, (path, texts, click, after) in sorted(SHOTS.items()):
            path = path.format(config=urllib.parse.quote(config))
            url = f"http://127.0.0.1:{c.port}" + (path if path.startswith("/") else f"/locations/{c.repo_path}/{path}")
            text = browser.open(url, wait_for=texts)
            assert "Join the Dagster community" not in text
            if click:
                browser.click(click)
                browser.wait_for(after)
            shot = tmp_path / name
            browser.screenshot(shot)
            with Image.open(shot) as img:
                assert img.size == (1600, 1000), name
                colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colors is not None and len(colors) > 50, name  # a rendered page, not a blank one
            if os.environ.get("RLAKE_SCREENSHOTS_DIR"):
                shutil.copy(shot, Path(os.environ["RLAKE_SCREENSHOTS_DIR"]) / name)
