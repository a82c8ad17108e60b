"""What the built wheel ships: PEP 561 markers, and Redis only behind the `cluster` extra."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build_wheel(out: Path) -> Path:
    # setuptools' own PEP 517 backend, in a child process, on a copy of the sources (its
    # build/ and egg-info stay out of the checkout): what `pip install .` builds, offline.
    source = out / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in ("proxy", "plugins", "benchmarks"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    script = (
        "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_the_wheel_ships_py_typed_and_needs_redis_only_for_cluster_mode(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
    assert {"proxy/py.typed", "plugins/py.typed"} <= names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: redis")]
    assert requires and all('extra == "cluster"' in line for line in requires), requires
    assert "Provides-Extra: cluster" in metadata


def _without_redis(tmp_path: Path) -> dict[str, str]:
    # A `redis` package first on the path that cannot be imported: as if it were absent.
    blocker = tmp_path / "block" / "redis"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("redis blocked by the test")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "block"), str(ROOT)])
    return env


def test_a_redis_url_without_the_redis_client_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    env = _without_redis(tmp_path)
    serve = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--port", "0", "--redis-url", "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert serve.returncode != 0
    assert "pip install 'context-proxy[cluster]'" in serve.stderr, serve.stderr
    assert "Traceback" not in serve.stderr
    config = tmp_path / "proxy.toml"
    config.write_text('redis_url = "redis://127.0.0.1:1/0"\n')
    check = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--config", str(config)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert check.returncode != 0
    assert "context-proxy[cluster]" in check.stdout + check.stderr
    # Without redis_url the same environment serves as a single node: `check` passes.
    single = tmp_path / "single.toml"
    single.write_text("port = 0\n")
    ok = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--config", str(single)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_the_ledger_gate_without_the_redis_client_names_the_extra(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        from proxy import open_ledger_gate
        try:
            open_ledger_gate("redis://127.0.0.1:1/0")
        except ValueError as exc:
            print("refused:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, env=_without_redis(tmp_path), check=False,
    )  # fmt: skip
    assert "refused:" in done.stdout and "context-proxy[cluster]" in done.stdout, done
