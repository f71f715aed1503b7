"""Take docs/admin-changelist.png: the rate-limits changelist with live values and fill bars.

Runs the example project on a throwaway SQLite database seeded with keys in every state,
logs a superuser in automatically (screenshot settings only) and captures the page with
headless Chromium (``apt-get install chromium``):

    .venv/bin/python scripts/admin_screenshot.py [--out docs/admin-changelist.png]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: A top-level module, found through PYTHONPATH: scripts/ is a folder of commands, not a
#: package, and ``scripts.`` could name an installed distribution's package instead.
SETTINGS = "screenshot_settings"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "admin-changelist.png"))
    parser.add_argument("--size", default="1440,900")
    parser.add_argument("--path", default="/admin/django_tokenbucket/ratelimit/")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "SCREENSHOT_DB": str(Path(tmp) / "db.sqlite3")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
        manage(env, "migrate", "--noinput", "-v", "0")
        manage(env, "shell", "-c", f"from {SETTINGS} import seed; seed()")
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}{args.path}"
            for _ in range(100):
                try:
                    urllib.request.urlopen(url, timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                    "--hide-scrollbars",
                    f"--user-data-dir={Path(tmp) / 'chromium'}",
                    f"--window-size={args.size}",
                    f"--screenshot={args.out}",
                    url,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=120,
            )
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(args.out)


if __name__ == "__main__":
    main()
