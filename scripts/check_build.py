"""Build the sdist and the wheel, and fail on anything a release would regret (tox env ``build``).

- any warning from the build (setuptools warns, for instance, about data folders that are
  not packages, which a later setuptools will leave out);
- ``twine check --strict`` on both files (the long description PyPI will render);
- a file of the package that the wheel lacks (the Lua script, the SQL, templates, static
  files, ``py.typed`` and every module), or one the sdist lacks.

    python scripts/check_build.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_tokenbucket"
WARNING = re.compile(r"warning", re.IGNORECASE)


def package_files() -> set[str]:
    """The files of the package as git tracks them (or as they are, outside a checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", PACKAGE], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE).rglob("*") if p.is_file()]
    return {name for name in listed if "__pycache__" not in name and not name.endswith(".pyc")}


def main() -> int | str:
    problems = []
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # else distutils warns that it cannot byte-compile
        build = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", out, str(ROOT)], env=env, capture_output=True, text=True
        )
        output = build.stdout + build.stderr
        if build.returncode != 0:
            print(output)
            return f"the build failed (exit {build.returncode})"
        warnings = [line for line in output.splitlines() if WARNING.search(line)]
        problems += [f"build warning: {line.strip()}" for line in warnings]
        dist = sorted(Path(out).iterdir())
        wheels = [path for path in dist if path.suffix == ".whl"]
        sdists = [path for path in dist if path.name.endswith(".tar.gz")]
        if len(wheels) != 1 or len(sdists) != 1:
            return f"expected one wheel and one sdist, got {[p.name for p in dist]}"
        twine = subprocess.run(
            [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)], capture_output=True, text=True
        )
        print(twine.stdout.strip())
        if twine.returncode != 0:
            problems.append(f"twine check --strict failed:\n{twine.stdout}{twine.stderr}")
        expected = package_files()
        in_wheel = set(zipfile.ZipFile(wheels[0]).namelist())
        with tarfile.open(sdists[0]) as sdist:
            in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        problems += [f"the wheel lacks {name}" for name in sorted(expected - in_wheel)]
        problems += [f"the sdist lacks {name}" for name in sorted(expected - in_sdist)]
        print(f"built {wheels[0].name} ({len(in_wheel)} files) and {sdists[0].name}: {len(expected)} files checked")
    for problem in problems:
        print(f"build: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
