"""Headless Chromium for the HTML report's tests: render a page, run a script in it, read
back what the script measured, or take a screenshot.

The page is written to a file with the script appended to its body; Chromium loads it with
``--dump-dom`` (the DOM after the page's and the script's code ran: the script writes its
findings as JSON into ``<pre id="measured">``) or ``--screenshot``. Each run gets a fresh
profile directory, and every flag that would reach the network is off.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["chromium", "measure", "screenshot", "png_size", "BROWSER_ENV"]

BROWSER_ENV = "AMPREWRITE_CHROMIUM"
"""Which browser the tests use: unset, the first of chromium, chromium-browser and
google-chrome on the PATH (none: the tests skip); ``skip``, none; a path, that one (CI names
the one it installed, so that a failed install fails the tests instead of skipping them)."""
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--hide-scrollbars", "--mute-audio")
_MEASURED = re.compile(r"<pre id=\"measured\">(.*?)</pre>", re.S)


def chromium() -> str | None:
    """The browser to use (see :data:`BROWSER_ENV`), or None."""
    chosen = os.environ.get(BROWSER_ENV)
    if chosen:
        return None if chosen == "skip" else chosen
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(page: str, work: Path, args: list[str], size: tuple[int, int]) -> str:
    browser = chromium()
    if browser is None or shutil.which(browser) is None:
        raise RuntimeError(f"no browser to run ({BROWSER_ENV}={os.environ.get(BROWSER_ENV)!r}, "
                           f"found {browser!r}): apt-get install -y chromium")
    path = work / "page.html"
    path.write_text(page, encoding="utf-8")
    with tempfile.TemporaryDirectory(dir=work) as profile:
        proc = subprocess.run(
            [browser, *_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
             *args, path.as_uri()], capture_output=True, text=True, timeout=180,
            env={**os.environ, "HOME": profile})
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def measure(page: str, script: str, work: Path, size: tuple[int, int] = (1300, 900)) -> Any:
    """Load ``page`` with ``script`` run after its own; ``script`` returns a JSON-ready
    value (it is the body of a function), which comes back here."""
    probe = ("<script>(function () { var out = document.createElement('pre'); "
             "out.id = 'measured'; var value; try { value = (function () {" + script
             + "})(); } catch (e) { value = {error: String(e) + ' ' + e.stack}; } "
             "out.textContent = JSON.stringify(value); document.body.appendChild(out); })();"
             "</script>")
    dom = _run(page.replace("</body>", probe + "</body>"), work, ["--dump-dom"], size)
    found = _MEASURED.search(dom)
    if found is None:
        raise RuntimeError(f"the script wrote nothing; the DOM ends with {dom[-500:]!r}")
    value = json.loads(html.unescape(found.group(1)))
    if isinstance(value, dict) and "error" in value:
        raise RuntimeError(f"the script failed in the page: {value['error']}")
    return value


def screenshot(page: str, png: Path, work: Path, size: tuple[int, int] = (1300, 900),
               script: str = "") -> Path:
    """Save what a window of ``size`` shows of ``page`` (after ``script``, if given) as
    ``png``."""
    if script:
        page = page.replace("</body>", f"<script>{script}</script></body>")
    # NB: the virtual time budget lets the window settle at its size before the picture.
    _run(page, work, [f"--screenshot={png}", "--virtual-time-budget=2000"], size)
    return png


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])
