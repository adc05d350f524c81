"""What a vendoring user copies: the library module imports no command-line or test machinery at module
level, runs from a package with proxy.py alone, and says in one sentence what `smoke --local` misses."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from test_cli import REPO, RUN_TIMEOUT_S, clean_env

LIBRARY = os.path.join(REPO, "hf_sandbox_provider.py")
# What the command line needs: the core, proxy.py and the modules it imports (not the emulator).
COMMAND_LINE = ["hf_sandbox_provider.py", "proxy.py", "hf_sandbox_training.py", "hf_sandbox_cli.py"]


def module_level_imports(path: str):
    """Top-level module names imported when the module is imported (not inside functions or classes)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    names = []
    for node in tree.body:
        for child in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(child, ast.Import):
                names += [alias.name.split(".")[0] for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                names += [child.module.split(".")[0]] if child.level == 0 and child.module else \
                    [alias.name for alias in child.names]
    return names


def test_the_library_module_imports_neither_argparse_nor_the_emulator_at_module_level():
    imported = module_level_imports(LIBRARY)
    assert "argparse" not in imported and "hf_jobs_emulator" not in imported
    assert "proxy" in imported  # the one sibling it needs


@pytest.mark.slow  # fresh interpreters importing requests, huggingface_hub and openenv
def test_importing_the_library_does_not_load_the_emulator():
    script = "import sys, hf_sandbox_provider; print(sorted({'hf_jobs_emulator'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_library_loads_no_openenv_and_starts_no_thread():
    # openenv.core's package init loads gradio, pandas and pyarrow: about 4 s, 170 MiB and two native threads
    # that every trainer process importing the library would pay, whether or not it uses OpenEnv.
    script = ("import json, os, sys, hf_sandbox_provider\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('openenv', 'gradio', 'pandas', 'pyarrow'))\n"
              "tasks = len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else 1\n"
              "print(json.dumps({'heavy': heavy, 'threads': tasks}))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"heavy": [], "threads": 1}


@pytest.mark.slow  # fresh interpreters importing openenv
@pytest.mark.parametrize("order", ["openenv first", "library first"])
def test_the_provider_is_an_openenv_container_provider_whichever_is_imported_first(order):
    pytest.importorskip("openenv.core.containers.runtime.providers")
    imports = ["from openenv.core.containers.runtime.providers import ContainerProvider",
               "import hf_sandbox_provider as hsp"]
    script = "\n".join((imports if order == "openenv first" else imports[::-1]) + [
        "import pickle",
        "provider = hsp.HFSandboxProvider('python:3.12')",
        "copy = pickle.loads(pickle.dumps(provider))",
        "print(issubclass(hsp.HFSandboxProvider, ContainerProvider), isinstance(provider, ContainerProvider),"
        " isinstance(copy, ContainerProvider))"])
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.split() == ["True"] * 3, result.stderr


def vendor(tmp_path, names):
    package = tmp_path / "vendored"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in names:
        (package / name).write_text(open(os.path.join(REPO, name), encoding="utf-8").read())
    env = clean_env(tmp_path)
    env["PYTHONPATH"] = str(tmp_path)
    return env


@pytest.mark.slow  # fresh interpreters importing requests, huggingface_hub and openenv
def test_a_vendored_copy_without_the_emulator_refuses_smoke_local_in_one_sentence(tmp_path):
    env = vendor(tmp_path, COMMAND_LINE)
    result = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "smoke", "--local"],
                            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf_jobs_emulator.py" in lines[0] and "Traceback" not in result.stderr
    bench = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "bench", "--local"],
                           cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert bench.returncode == 2 and "benchmarks/lifecycle.py" in bench.stderr and "Traceback" not in bench.stderr


@pytest.mark.slow  # fresh interpreters importing requests, huggingface_hub and openenv
def test_a_vendored_copy_with_the_emulator_passes_smoke_local(tmp_path):
    env = vendor(tmp_path, COMMAND_LINE + ["hf_jobs_emulator.py"])
    result = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "smoke", "--local", "--json"],
                            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert '"ok": true' in result.stdout
