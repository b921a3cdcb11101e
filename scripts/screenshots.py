#!/usr/bin/env python
"""Redo docs/screenshots/*.png: `rlake train` in tmux, then the run's MLflow UI pages.

    source /work/venv/bin/activate
    python scripts/screenshots.py [--out /tmp/rlake-shots/out] [--skip-train]

Needs tmux, chromium (/usr/bin/chromium), node + npm (playwright-core is installed into a temporary
folder; Chromium itself comes from Debian, Playwright downloads no browser), and optionally optipng /
pngquant to shrink the PNGs. Everything listens on 127.0.0.1 and every process started here is
stopped by its own id.

1. tmux runs `rlake train --config configs/tiny_cpu.yaml trainer.output_dir=OUT rollout.name=hf` in a
   160x30 pane; `tmux capture-pane -e -p` is polled each second; the first frame whose live line
   shows iteration >= MIN_DONE/N with tok/s is train_terminal.png, the whole scrollback after the
   run is train_terminal_end.png. ANSI -> SVG with rich (Console.save_svg) -> PNG with headless
   Chromium.
2. `mlflow server --backend-store-uri sqlite:///OUT/mlflow.db --host 127.0.0.1 --port 5055`, and
   Playwright (playwright-core driving /usr/bin/chromium) screenshots the run page with its dataset
   inputs list open (mlflow_run.png), the dataset drawer of one rollouts input (mlflow_run_dataset.png)
   and the artifacts view with the last samples/val_step_N.json as a table (mlflow_samples.png).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "docs" / "screenshots"
SESSION = "rlake-shots"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
LIVE = re.compile(r"iteration\s+\S*\s+(\d+)/(\d+)\s.*tok/s=")


def sh(*cmd: str, **kw) -> str:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout


def capture(full: bool = False) -> str:
    return sh("tmux", "capture-pane", "-e", "-p", "-t", SESSION, *(["-S", "-"] if full else []))


def strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", s)


# -- 1. the terminal -----------------------------------------------------------------------------
def train(out: Path, frames: Path, min_done: int, timeout_s: int) -> tuple[str, str]:
    venv = Path(sys.prefix)
    cmd = (
        f"cd {ROOT} && source {venv}/bin/activate && rlake train --config configs/tiny_cpu.yaml "
        f"trainer.output_dir={out} rollout.name=hf; sleep 600"
    )
    sh("tmux", "new-session", "-d", "-s", SESSION, "-x", "160", "-y", "30", cmd)
    mid = None
    t0 = time.time()
    try:
        while time.time() - t0 < timeout_s:
            time.sleep(1)
            frame = capture()
            (frames / f"{int(time.time() - t0):04d}.ansi").write_text(frame)
            plain = strip_ansi(frame)
            m = LIVE.search(plain)
            if mid is None and m and int(m.group(1)) >= min_done:
                mid = frame
                print(f"  live frame at {time.time() - t0:.0f}s: {m.group(0)[:120]}")
            if re.search(r"^done: \d+ iterations", plain, re.M) or "Traceback" in plain:
                time.sleep(2)
                break
        else:
            raise TimeoutError(f"rlake train did not finish in {timeout_s}s")
        end = capture(full=True)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], check=False)
    if "Traceback" in strip_ansi(end):
        raise RuntimeError("rlake train failed:\n" + strip_ansi(end))
    if mid is None:
        raise RuntimeError(f"no frame showed iteration >= {min_done} with tok/s (iterations too fast?)")
    return mid, end


def ansi_to_png(ansi: str, png: Path, title: str, tmp: Path) -> None:
    from rich.console import Console
    from rich.text import Text

    lines = ansi.rstrip("\n").split("\n")
    while lines and not strip_ansi(lines[-1]).strip():
        lines.pop()
    console = Console(record=True, width=160, force_terminal=True, color_system="truecolor", file=open(os.devnull, "w"))
    for line in lines:
        console.print(Text.from_ansi(line), no_wrap=True, overflow="crop", soft_wrap=False)
    console.print()  # room for the last line's descenders inside rich's clip
    svg = tmp / (png.stem + ".svg")
    console.save_svg(str(svg), title=title)
    text = svg.read_text()
    w, h = (float(v) for v in re.search(r'viewBox="0 0 ([\d.]+) ([\d.]+)"', text).groups())
    # rich's SVG asks for Fira Code from a CDN; offline, Chromium falls back to DejaVu Sans Mono
    html = tmp / (png.stem + ".html")
    html.write_text(f"<html><body style='margin:0;background:#fff'>{text}</body></html>")
    chromium_shot(f"file://{html}", png, int(w + 1), int(h + 1))


def chromium_shot(url: str, png: Path, w: int, h: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                CHROMIUM,
                *CHROME_FLAGS,
                f"--user-data-dir={profile}",
                f"--screenshot={png}",
                f"--window-size={w},{h}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


# -- 2. MLflow -----------------------------------------------------------------------------------
PW_SCRIPT = r"""
const { chromium } = require('playwright-core');
const [base, exp, run, outRun, outData, outSamples, sample, dataset] = process.argv.slice(2);
const hide = ['policy_version', 'sampling', 'sample_index', 'data_source', 'iteration_metrics_version'];
(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
           '--disable-component-update', '--disable-sync'] });
  const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
  const runUrl = `${base}/#/experiments/${exp}/runs/${run}`;
  const finished = () => page.getByText(/^(FINISHED|Finished)$/).first().waitFor({ timeout: 90000 });
  await page.goto(runUrl);
  await finished();
  // MLflow 3 opens in "GenAI" mode, where a run is an "evaluation run": switch to "Model training"
  await page.getByText('Model training', { exact: true }).first().click();
  await page.waitForTimeout(1000);
  await page.goto(runUrl);
  await finished();
  const close = page.getByRole('button', { name: 'Close' });  // the MLflow Assistant side panel
  if (await close.count()) await close.first().click();
  await page.getByRole('button', { name: 'Toggle sidebar' }).click();
  await page.waitForTimeout(1000);
  // mlflow_run.png: status, metrics, params, and the dataset inputs list opened
  await page.getByText(/^\+\d+$/).first().click();
  await page.waitForTimeout(1500);
  await page.mouse.move(1, 600);
  await page.screenshot({ path: outRun });
  await page.keyboard.press('Escape');
  // mlflow_run_dataset.png: the dataset drawer on one Delta table input (its lineage profile)
  await page.getByText(/^\+\d+$/).first().click();
  await page.getByText(dataset, { exact: true }).first().click();
  await page.waitForTimeout(2000);
  await page.screenshot({ path: outData });
  // mlflow_samples.png: Artifacts > samples/val_step_N.json as a table, bookkeeping columns hidden
  await page.goto(`${runUrl}/artifacts`);
  await page.getByText('samples', { exact: true }).first().click({ timeout: 90000 });
  await page.getByText(sample, { exact: true }).first().click({ timeout: 30000 });
  await page.getByRole('button', { name: 'Table settings' }).click({ timeout: 30000 });
  for (const c of hide) {
    const item = page.getByRole('menuitemcheckbox', { name: c, exact: true });
    if (await item.count()) { await item.click(); await page.waitForTimeout(300); }
  }
  await page.keyboard.press('Escape');
  await page.evaluate(() => document.activeElement && document.activeElement.blur());  // no tooltip
  // widen prompt_text: drag the resize handle nearest to its header's right edge
  const head = await page.getByText('prompt_text', { exact: true }).first().boundingBox();
  if (head) {
    const handles = await page.locator('[aria-label="Resize Column"]').evaluateAll(els =>
      els.map(e => { const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }));
    const right = head.x + head.width;
    const h = handles.filter(([x]) => x > right - 5).sort((a, b) => a[0] - b[0])[0];
    if (h) { await page.mouse.move(h[0], h[1]); await page.mouse.down(); await page.mouse.move(h[0] + 110, h[1], { steps: 8 }); await page.mouse.up(); }
  }
  await page.mouse.move(1, 600);
  await page.waitForTimeout(1500);
  await page.screenshot({ path: outSamples });
  await browser.close();
})().catch(e => { console.error(e); process.exit(1); });
"""


# long: one browser session visiting the MLflow pages in order; each step waits on the previous
def mlflow_pages(out: Path, tmp: Path, port: int) -> None:
    from mlflow import MlflowClient

    db = f"sqlite:///{out}/mlflow.db"
    client = MlflowClient(tracking_uri=db)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    run = max(runs, key=lambda r: r.info.start_time)
    samples = sorted(
        (a.path for a in client.list_artifacts(run.info.run_id, "samples")),
        key=lambda p: int(re.search(r"(\d+)\.json$", p).group(1)),
    )
    sample = Path(samples[-1]).name
    # a mid-run input: its drawer shows the lineage profile (iteration, policy version, upstream versions)
    inputs = [d.dataset for d in run.inputs.dataset_inputs if d.dataset.name == "rollouts"]
    dataset = (
        f"{inputs[min(2, len(inputs) - 1)].name} ({inputs[min(2, len(inputs) - 1)].digest})" if inputs else "prompts"
    )
    print(
        f"  run {run.info.run_name} ({run.info.run_id}) {run.info.status}, experiment {run.info.experiment_id}, {sample}"
    )

    pw = tmp / "pw"
    pw.mkdir()
    sh("npm", "install", "--silent", "--prefix", str(pw), "playwright-core")
    (pw / "shots.js").write_text(PW_SCRIPT)

    log = open(tmp / "mlflow-server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            db,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError(f"mlflow server did not answer; see {tmp / 'mlflow-server.log'}")
        subprocess.run(
            [
                "node",
                str(pw / "shots.js"),
                base,
                run.info.experiment_id,
                run.info.run_id,
                str(DEST / "mlflow_run.png"),
                str(DEST / "mlflow_run_dataset.png"),
                str(DEST / "mlflow_samples.png"),
                sample,
                dataset,
            ],
            check=True,
            timeout=300,
            env={**os.environ, "CHROMIUM": CHROMIUM},
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server's own process group (gunicorn/uvicorn workers)
        server.wait(timeout=30)


def shrink(png: Path) -> None:
    if shutil.which("pngquant"):
        subprocess.run(
            ["pngquant", "--force", "--skip-if-larger", "--quality=70-95", "--output", str(png), str(png)], check=False
        )
    if shutil.which("optipng"):
        subprocess.run(["optipng", "-quiet", "-o2", str(png)], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default="/tmp/rlake-shots/out", help="trainer.output_dir (must not exist unless --skip-train)"
    )
    ap.add_argument("--skip-train", action="store_true", help="reuse the finished run under --out; MLflow pages only")
    ap.add_argument("--min-done", type=int, default=4, help="live frame: first with at least this many iterations done")
    ap.add_argument("--port", type=int, default=5055)
    ap.add_argument("--timeout", type=int, default=1200, help="seconds allowed for rlake train")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    DEST.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rlake-shots-"))
    print(f"scratch: {tmp}")
    if not args.skip_train:
        if out.exists():
            sys.exit(f"{out} exists: pass a fresh --out (or --skip-train to reuse its run)")
        frames = tmp / "frames"
        frames.mkdir()
        print(f"rlake train -> {out} (tmux session {SESSION}; frames in {frames})")
        mid, end = train(out, frames, args.min_done, args.timeout)
        (tmp / "mid.ansi").write_text(mid)
        (tmp / "end.ansi").write_text(end)
        ansi_to_png(mid, DEST / "train_terminal.png", "rlake train (during the run)", tmp)
        ansi_to_png(end, DEST / "train_terminal_end.png", "rlake train (after the run)", tmp)
    print("MLflow UI")
    mlflow_pages(out, tmp, args.port)
    for png in sorted(DEST.glob("*.png")):
        shrink(png)
        print(f"  {png.relative_to(ROOT)}  {png.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
