"""Drive a real JupyterLab from headless Chromium: start a server on a free localhost port with a token and
a throwaway root/settings/runtime directory, open a notebook, run cells through the Lab UI, and stop
everything this harness started (kernels via the server's API, then the server by its process id).

Used by tests/ui (pytest fixtures) and benchmarks/widget_latency.py (loaded by path).

Example:
    >>> with LabServer(tmp_dir) as lab, browser_page() as page:   # doctest: +SKIP
    ...     open_notebook(page, lab, "demo.ipynb")
    ...     run_cell(page, 0)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("VITCAM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# Quiet, deterministic Lab: no news or update checks (no network), every cell kept in the DOM.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is absent (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright (python) is not installed"
    return None


def notebook7_missing_reason() -> str | None:
    """Why the Notebook 7 check cannot run here, or None when it can."""
    try:
        import notebook
    except ImportError:
        return "Notebook 7 (the notebook package) is not installed"
    major = int(str(getattr(notebook, "__version__", "0")).split(".")[0] or 0)
    return None if major >= 7 else f"notebook {notebook.__version__} is not Notebook 7"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(Exception):
    """The server's port was taken between choosing it and binding it."""


class LabServer:
    """``jupyter lab`` on 127.0.0.1 in ``root`` (notebooks go there); a context manager.

    Example:
        >>> with LabServer(Path("/tmp/x")) as lab:   # doctest: +SKIP
        ...     print(lab.url("lab"))
    """

    def __init__(self, root: Path, startup_timeout: float = 90.0, nodelay: bool | None = None) -> None:
        self.root = Path(root)
        self.nodelay = nodelay
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root.parent / f"jupyter-lab-{self.port}.log"

    def url(self, path: str = "") -> str:
        """URL of ``path`` on the server, token included."""
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def start(self, tries: int = 3) -> LabServer:
        """Start the server and wait until it answers. The port is free when chosen, but another process (another
        pytest-xdist worker's server, say) may take it before this one binds it: then a new port, ``tries`` times."""
        for attempt in range(tries):
            try:
                return self._start()
            except _PortTaken:
                if attempt == tries - 1:
                    raise RuntimeError(f"jupyter lab found its port taken {tries} times:\n{self.log()}") from None
                self.port = free_port()
                self.log_path = self.root.parent / f"jupyter-lab-{self.port}.log"
        raise AssertionError("unreachable")

    def _start(self) -> LabServer:
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.root.parent / f"lab-state-{self.port}"
        settings = state / "settings"
        for rel, value in _SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(state / "runtime"), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "jupyter", "lab", "--ip=127.0.0.1", f"--port={self.port}",
               "--port-retries=0", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--ServerApp.open_browser=False", "--allow-root", f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={state / 'workspaces'}", "--LabApp.news_url=",
               "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate"]
        if self.nodelay is not None:  # on or off whatever the installed configuration says
            cmd.append(f"--ServerApp.jpserver_extensions=vitcam_nb_nodelay={self.nodelay}")
        log = open(self.log_path, "w")  # noqa: SIM115 (kept open for the server's lifetime)
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                if "already in use" in self.log():
                    raise _PortTaken
                raise RuntimeError(f"jupyter lab exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"jupyter lab did not answer within {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        """The server's output so far (for failure messages)."""
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        """Shut down the kernels this server started, then the server (SIGTERM, SIGKILL after 15 s)."""
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            for kernel in self.api("GET", "api/kernels"):
                with contextlib.suppress(Exception):
                    self.api("DELETE", f"api/kernels/{kernel['id']}")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> LabServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_notebook(path: Path, cells: list[str]) -> Path:
    """Write a notebook of code cells with the python3 kernelspec."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nbformat.write(nb, str(path))
    return path


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, launched by Playwright (one per process: the sync API cannot nest)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def required_chromium() -> Iterator[Any]:
    """Chromium for a test module without JupyterLab: skipped when it cannot run, a failure instead where
    ``VITCAM_REQUIRE_BROWSER=1`` (CI) says the browser tests must run."""
    reason = chromium_missing_reason()
    if reason:
        if os.environ.get("VITCAM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests are required here but cannot run: {reason}")
        pytest.skip(reason)
    with chromium() as browser:
        yield browser


def new_page(browser: Any, width: int = 1400, height: int = 1000) -> Any:
    """A fresh page; JS dialogs (alert, confirm) are dismissed and recorded in ``page.dialogs``."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.dialogs = []

    def on_dialog(dialog: Any) -> None:
        page.dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    return page


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """One page in its own Chromium (see :func:`chromium`, :func:`new_page`)."""
    with chromium() as browser:
        yield new_page(browser, width, height)


# The toolbar says "No Kernel" with an idle indicator before the session exists: wait for both.
_KERNEL_READY = """() => {
  const name = document.querySelector(".jp-NotebookPanel-toolbar [title='Switch kernel']");
  const status = document.querySelector(".jp-Notebook-ExecutionIndicator");
  return !!name && !/No Kernel/.test(name.textContent) && !!status && status.dataset.status === "idle";
}"""


def open_notebook(page: Any, lab: LabServer, name: str, timeout_ms: int = 90_000, app: str = "lab",
                  workspace: str | None = None) -> None:
    """Open notebook ``name`` in JupyterLab (``app="lab"``) or Notebook 7 (``app="notebook"``, served by
    the same server when the ``notebook`` package is installed) and wait until its kernel is idle.

    Lab restores the notebooks of its workspace: to open a notebook alone in a second page while another
    page has one open, give a new ``workspace`` name (Lab only)."""
    if app == "lab":
        path = f"lab/workspaces/{workspace}/tree/{name}" if workspace else f"lab/tree/{name}"
    else:
        path = f"notebooks/{name}"
    page.goto(lab.url(path), wait_until="domcontentloaded", timeout=timeout_ms)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    page.wait_for_function(_KERNEL_READY, timeout=timeout_ms)


def run_cell(page: Any, index: int, attempts: int = 3) -> None:
    """Run cell ``index`` the way a user does: click into its editor, press Shift+Enter; check that the
    cell was queued (its prompt shows [*] or a number), pressing again if a just-connected kernel
    dropped the request."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputPrompt").first
    before = prompt.inner_text().strip()
    for _ in range(attempts):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            now = prompt.inner_text().strip()
            if now != before and now not in ("[ ]:", ""):
                return
            page.wait_for_timeout(100)
    raise RuntimeError(f"cell {index} did not start running after {attempts} Shift+Enter presses")


def wait_idle(page: Any, timeout_ms: int = 60_000) -> None:
    """Wait until the kernel is busy-then-idle (or already idle)."""
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_ms)


def output_text(page: Any) -> str:
    """All text in the notebook's output areas (to look for tracebacks)."""
    return page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output')]"
                         ".map((n) => n.innerText).join('\\n')")
