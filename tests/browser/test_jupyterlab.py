"""JupyterLab in a real browser: run notebook 00 from a working copy, autosave on; the repo stays clean.

    make test-browser        # sets GUIDE_BROWSER_TEST=1; skipped otherwise (make test does not run it)

Makes a working copy as ``make lab`` does (``python -m helpers.workcopy``, here in
``work/browser-test/``, ignored by git), starts ``jupyter lab`` on it from this Python's bin/ on a
free localhost port with autosave on (every 2 s), drives headless Chromium (Debian's ``chromium``,
found on PATH or $CHROMIUM) with Playwright, opens ``notebooks/00_launching.ipynb`` as a learner
would, runs all cells under ``GUIDE_SIZE=quick``, and checks from the notebook model that no cell
errored and that a figure rendered, from the page that the optional panel rendered, that autosave
wrote the copy, that the jobs wrote their runs inside the copy, and that ``git status --porcelain``
is what it was before. A screenshot lands in the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/00_launching.ipynb"
WORK = REPO / "work" / "browser-test"

pytestmark = pytest.mark.skipif(os.environ.get("GUIDE_BROWSER_TEST") != "1",
                                reason="browser test: run it with make test-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no chromium on PATH: apt-get install chromium (make test-browser does it in CI)")
    return path


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free port, serving a copy of the notebook; yields its base URL."""
    shutil.rmtree(WORK, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "helpers.workcopy", "--dir", str(WORK)], cwd=REPO, check=True)
    root = WORK
    settings = tmp_path / "settings" / "@jupyterlab" / "docmanager-extension"
    settings.mkdir(parents=True)
    (settings / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": True, "autosaveInterval": 2}))
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port, token = free_port(), "guide-browser-test"
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "GUIDE_SIZE": "quick",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter_config")}
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(bindir / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"jupyter lab exited: {(tmp_path / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not answer within 60 s")
        yield url, token
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the server and its kernel: they share the session we started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        log.close()
        shutil.rmtree(WORK, ignore_errors=True)


# In the page: open the .py as a notebook through jupytext, wait for the kernel, run all cells,
# then report every cell's outputs from the model (not from the DOM).
OPEN_AND_RUN = """async (path) => {
  const app = window.jupyterapp;
  const panel = await app.commands.execute('docmanager:open', {path});
  await panel.context.ready;
  await panel.sessionContext.ready;
  app.shell.activateById(panel.id);
  const ok = await app.commands.execute('notebook:run-all-cells');
  const cells = [];
  for (const cell of panel.content.widgets) {
    const m = cell.model;
    cells.push({type: m.type, count: m.type === 'code' ? m.executionCount : null,
                outputs: m.type === 'code' ? m.outputs.toJSON().map(o => ({
                  output_type: o.output_type, ename: o.ename || null, evalue: o.evalue || null,
                  mimes: Object.keys(o.data || {})})) : []});
  }
  return {ok, cells};
}"""


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def test_notebook_runs_in_jupyterlab(lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    before, copy = git_status(), WORK / NOTEBOOK
    copied = copy.read_text()
    url, token = lab
    t0 = time.perf_counter()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab?token={token}", timeout=90_000)
            page.wait_for_function("window.jupyterapp && window.jupyterapp.started !== undefined",
                                   timeout=90_000)
            page.evaluate("() => window.jupyterapp.started")
            result = page.evaluate(OPEN_AND_RUN, NOTEBOOK)  # returns when the last cell has run
            page.wait_for_selector(".jp-RenderedImage img", timeout=30_000)
            page.wait_for_selector(".jupyter-button", timeout=30_000)  # the optional panel rendered (ipywidgets)
            page.locator(".jp-RenderedImage img").first.scroll_into_view_if_needed()
            for _ in range(30):  # autosave (every 2 s) writes the copy with this session's outputs
                if copy.read_text() != copied:
                    break
                time.sleep(1)
        finally:
            page.screenshot(path=str(tmp_path / "jupyterlab.png"), full_page=True)
            browser.close()
    print(f"ran {NOTEBOOK} in JupyterLab in {time.perf_counter() - t0:.0f} s; screenshot {tmp_path / 'jupyterlab.png'}")
    code = [c for c in result["cells"] if c["type"] == "code"]
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"cells errored: {errors}"
    assert result["ok"], "run-all-cells reported a failure"
    assert code and all(c["count"] for c in code), "some code cells did not run"
    assert any("image/png" in o["mimes"] for c in code for o in c["outputs"]), "no figure was rendered"
    assert (tmp_path / "jupyterlab.png").stat().st_size > 10_000
    assert copy.read_text() != copied, "autosave did not write the working copy"
    assert (WORK / "notebooks/runs/00_fsdp/summary.json").is_file(), "the jobs did not write into the copy"
    assert not (WORK / "notebooks/00_launching.py").exists()  # unpaired: no .py written beside it
    assert git_status() == before, f"running the notebook changed the repo:\n{git_status()}"
