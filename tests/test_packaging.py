"""Packaging: the wheel installs into an environment that already has its own torch, and keeps
that torch (`pyproject.toml` declares a range; set-up installs the CPU build first)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The oldest torch this project has run on: 2.11.0+cu130 (tests/test_cuda.py, test_compute.py
#: and the 100 M scale benchmark on a GPU, docs/benchmarks.md); CI runs 2.13.0.
OLDEST_TORCH = "2.11.0"


def test_the_wheel_installs_beside_an_older_torch_and_keeps_it(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)],
        check=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = dist.glob("peertrain-*.whl")
    # A fresh environment whose packages are ours (every dependency installed), except that
    # its torch is an older release of the user's own, found first.
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.strip()
    )  # fmt: skip
    users_torch = site / f"torch-{OLDEST_TORCH}.dist-info"
    users_torch.mkdir()
    (users_torch / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {OLDEST_TORCH}\n"
    )
    (users_torch / "RECORD").write_text("")
    (site / "zz-ours.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    report = tmp_path / "report.json"
    # Offline: anything pip wanted to fetch (a torch replacing the user's) would fail here.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--report", str(report), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    installs = [i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]]
    assert "torch" not in installs, installs
    assert set(installs) <= {"peertrain"}, installs  # every dependency was already there
