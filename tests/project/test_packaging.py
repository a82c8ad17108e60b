"""What the built wheel ships: PEP 561 markers, Redis only behind the `cluster` extra,
aiohttp only behind the `testing` (and `bench`) extra and never loaded by the proxy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

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
    aiohttp = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: aiohttp")]
    assert aiohttp and all(
        'extra == "testing"' in line or 'extra == "bench"' in line for line in aiohttp
    ), aiohttp
    assert "Provides-Extra: testing" in metadata


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


def _loaded(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The modules of aiohttp, the emulator and proxy.testing loaded after ``code`` ran."""
    probe = (
        f"{code}\nimport sys\nprint(sorted(m for m in sys.modules"
        " if m.split('.')[0] == 'aiohttp' or m.startswith(('proxy._emulator', 'proxy.testing',"
        " 'proxy._demo'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return list(eval(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import proxy",
        "import proxy._app",
        # The CLI's `serve` path up to the loop: the command, its settings, the app.
        "import proxy._cli, proxy._app; proxy._app.build_app(proxy.load_settings())",
        "import proxy.pytest_plugin",
    ],
)
def test_the_proxy_and_its_pytest_plugin_load_no_aiohttp(code: str) -> None:
    # aiohttp is installed here (the dev extra): only an import would load it.
    assert _loaded(code) == []


def _without_aiohttp(tmp_path: Path) -> dict[str, str]:
    # An `aiohttp` package first on the path that cannot be imported: as if it were absent.
    blocker = tmp_path / "block" / "aiohttp"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("aiohttp blocked by the test")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "block"), str(ROOT)])
    return env


@pytest.mark.parametrize("command", [["demo", "--once", "--port", "0"], ["emulate", "--port", "0"]])
def test_demo_and_emulate_without_the_testing_extra_are_one_line_naming_it(
    tmp_path: Path, command: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", *command],
        capture_output=True, text=True, timeout=60, env=_without_aiohttp(tmp_path), check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: context-proxy {command[0]} needs the 'testing' extra: "
        "pip install 'context-proxy[testing]'"
    ], done.stderr


def test_serve_runs_without_aiohttp(tmp_path: Path) -> None:
    # The app served, answering a request, in an environment with no aiohttp at all.
    code = textwrap.dedent(
        """
        import asyncio
        import proxy

        async def main() -> None:
            app = proxy.build_app(proxy.load_settings(overrides={"plugins": []}))
            async with proxy.running(app, "127.0.0.1", 0) as port:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                print((await asyncio.wait_for(reader.readline(), 10)).decode().strip())
                writer.close()

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, env=_without_aiohttp(tmp_path), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["HTTP/1.1 200 OK"], done.stdout


def test_proxy_testing_without_the_extra_names_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import proxy.testing"],
        capture_output=True, text=True, timeout=60, env=_without_aiohttp(tmp_path), check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "ImportError: proxy.testing needs the 'testing' extra: " in done.stderr, done.stderr
    assert "pip install 'context-proxy[testing]'" in done.stderr


_PROBE_TESTS = """
import sys

def test_the_plugin_is_loaded_and_nothing_heavy() -> None:
    assert "proxy.pytest_plugin" in sys.modules
    heavy = [m for m in sys.modules
             if m.split(".")[0] == "aiohttp" or m.startswith(("proxy._emulator", "proxy.testing"))]
    assert heavy == []

async def test_the_fixture(context_proxy) -> None:
    h = await context_proxy()
    assert h.openai_base_url.startswith("http://127.0.0.1:")
"""


@pytest.mark.parametrize("extra", [True, False], ids=["with-testing", "without-testing"])
def test_the_pytest_entry_point_loads_the_emulator_only_for_the_fixture(
    tmp_path: Path, extra: bool
) -> None:
    # pytest loads proxy.pytest_plugin through its pytest11 entry point in every session
    # of this environment: a project of its own, with no conftest naming the plugin.
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_probe.py").write_text(_PROBE_TESTS)
    env = _without_aiohttp(tmp_path) if not extra else None
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_PROXY_")}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
         "asyncio_mode=auto", "test_probe.py"],
        capture_output=True, text=True, timeout=120, cwd=project, env=env, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    if extra:
        assert done.returncode == 0 and "2 passed" in out, out[-3000:]
    else:
        assert "1 passed" in out and "1 error" in out, out[-3000:]
        assert "the context_proxy fixture: proxy.testing needs the 'testing' extra" in out
