"""A real browser opens the report offline: no console errors, no network, working sort, the graph
drawn, a screenshot; once with graphviz's dot and once with dot hidden from PATH (tracecmp's own layout).

Headless Chromium (Debian package ``chromium``). Skipped only when Chromium is missing and ``CI`` is
not set; in CI it must run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((path for name in BROWSERS if (path := shutil.which(name))), None)
pytestmark = pytest.mark.skipif(
    BROWSER is None and os.environ.get("CI", "").lower() in ("", "0", "false"),
    reason="chromium not installed (CI installs it)",
)

# Collects every error the page raises or logs, before the report's own code runs.
_SINK = """<script>
window.__errors = [];
window.addEventListener("error", function (e) {
  window.__errors.push("error: " + (e.message || (e.target && (e.target.src || e.target.href)) || "?"));
}, true);
window.addEventListener("unhandledrejection", function (e) { window.__errors.push("rejection: " + e.reason); });
["error", "warn"].forEach(function (level) {
  console[level] = function () { window.__errors.push(level + ": " + Array.prototype.join.call(arguments, " ")); };
});
</script>"""

# Runs after the report's script: clicks headers the way a person would and writes what it saw into the DOM.
_PROBE = """<script>
(function () {
  var out = {errors: window.__errors};
  var table = document.getElementById("modules-table");
  var header = table.tHead.rows[0].cells[1];
  function column() { return Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[1].dataset.sort; }); }
  header.click(); out.ascending = column();
  header.click(); out.descending = column();
  var name = table.tHead.rows[0].cells[0];
  name.click(); out.byName = Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[0].textContent; });
  out.figures = Array.prototype.map.call(document.querySelectorAll(".figure svg"), function (s) {
    var box = s.getBoundingClientRect(); return [box.width, box.height];
  });
  out.resources = performance.getEntriesByType("resource").map(function (r) { return r.name; });
  out.verdict = document.getElementById("verdict").textContent;
  out.graphNodes = Array.prototype.map.call(document.querySelectorAll(".figure.graph svg g.node"), function (g) {
    var box = g.getBoundingClientRect(); return [box.width, box.height, g.textContent];
  });
  var pre = document.createElement("pre"); pre.id = "probe-result"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def _browser(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None, "CI is set but chromium is not installed (.ci/setup installs it)"
    command = [
        BROWSER,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        "--enable-logging=stderr",
        "--v=0",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _console_lines(stderr: str) -> list[str]:
    """Chromium logs every page console message (and uncaught exception) as ``INFO:CONSOLE`` on stderr."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def _without_dot(path: str) -> str:
    """PATH less every folder that holds a ``dot``."""
    return os.pathsep.join(d for d in path.split(os.pathsep) if not os.access(os.path.join(d, "dot"), os.X_OK))


@pytest.fixture(scope="module", params=["dot", "dot hidden from PATH"])
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.unit.test_render import diverged_result
    from tracecmp.render import write_report

    folder = tmp_path_factory.mktemp("report")
    result = diverged_result(folder / "runs")
    if request.param == "dot" and shutil.which("dot") is None:
        if os.environ.get("CI", "").lower() in ("", "0", "false"):
            pytest.skip("graphviz 'dot' not installed (CI installs it)")
        raise AssertionError("CI is set but graphviz 'dot' is not installed (.ci/setup installs it)")
    with pytest.MonkeyPatch.context() as patch:
        if request.param != "dot":
            patch.setenv("PATH", _without_dot(os.environ.get("PATH", "")))
            assert shutil.which("dot") is None
        path = write_report(result, folder / "out")
    drawn_by_dot = "tracecmp's own layout" not in path.read_text(encoding="utf-8")
    assert drawn_by_dot == (request.param == "dot")
    return path


def test_report_opens_without_errors_and_sorts(report: Path, tmp_path: Path) -> None:
    html = report.read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(
        html.replace("<head>", "<head>" + _SINK, 1).replace("</body>", _PROBE + "</body>", 1), encoding="utf-8"
    )
    done = _browser("--dump-dom", "--virtual-time-budget=5000", probed.as_uri(), profile=tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r'<pre id="probe-result">(.*?)</pre>', done.stdout, re.S)
    assert match, "the probe did not run: " + done.stdout[-1000:]
    seen = json.loads(
        match.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    )
    assert seen["errors"] == []
    assert _console_lines(done.stderr) == []
    assert [r for r in seen["resources"] if not r.startswith("file:")] == []  # nothing fetched: works offline
    ascending = [float(v) for v in seen["ascending"]]
    assert ascending == sorted(ascending) and len(ascending) > 1
    assert [float(v) for v in seen["descending"]] == sorted(ascending, reverse=True)
    assert seen["byName"] == sorted(seen["byName"], key=str.lower)
    assert seen["verdict"].startswith("DIVERGED")
    assert len(seen["figures"]) == 2 and all(w > 100 and h > 100 for w, h in seen["figures"])
    # The graph: every node laid out with a size, the root among them with its label.
    assert len(seen["graphNodes"]) >= 5 and all(w > 20 and h > 15 for w, h, _ in seen["graphNodes"])
    assert any("FIRST DIVERGENCE" in text and "gelu" in text for _, _, text in seen["graphNodes"])


def test_report_screenshot(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    done = _browser(f"--screenshot={shot}", "--window-size=1400,2000", report.as_uri(), profile=tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _console_lines(done.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(data) > 50_000  # a rendered page, not a blank one
