"""Headless Chromium for the HTML pages' tests (`report`, `watch`): where it is (``chromium``:
None when not installed), a run of it with a profile of its own (``run_chromium``), and the check
that a page's embedded images decode (``assert_images_decode``)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None



CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]



IMG_PROBE = """<script>
window.addEventListener('load', function () {
  var out = [];
  document.querySelectorAll('img').forEach(function (i) {
    out.push(i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight);
  });
  var p = document.createElement('pre'); p.id = 'imgprobe';
  p.textContent = 'IMG' + 'PROBE[' + out.join(',') + ']'; document.body.appendChild(p);
});
</script>"""



def run_chromium(exe: str, tmp: Path, args: list[str]) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)



def assert_images_decode(exe: str, tmp_path: Path, html_path: Path, count: int) -> None:
    """The page's ``count`` embedded images decode in Chromium: naturalWidth probed from a copy
    of the page with a tiny script."""
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text().replace("</body>", IMG_PROBE + "</body>"))
    res = run_chromium(exe, tmp_path, ["--dump-dom", "--virtual-time-budget=5000", probe.as_uri()])
    m = re.search(r"IMGPROBE\[([^\]]*)\]", res.stdout)
    assert m, res.stdout[-500:] + res.stderr[-2000:]
    entries = m.group(1).split(",")
    assert len(entries) == count
    for e in entries:
        complete, size = e.split(":")
        w, h = map(int, size.split("x"))
        assert complete == "true" and w >= 300 and h >= 200, entries

