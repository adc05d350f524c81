"""The supported range, checked for real: Python 3.9 syntax, no event-loop or web-framework imports in the
library, and the whole offline path (`smoke --local`) on the oldest and the other supported majors of the
runtime dependencies, each in a fresh virtualenv (on Python 3.9 itself when this machine has it)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

import support

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_MODULES = ["hf_sandbox_provider.py", "hf_sandbox_training.py", "hf_sandbox_cli.py", "hf_sandbox_pool.py",
                   "proxy.py", "hf_jobs_emulator.py", "hf_sbx_emulator.py"]
FORBIDDEN_IMPORTS = {"asyncio", "httpx", "fastapi", "uvicorn", "websockets", "aiohttp", "starlette", "anyio"}

# The matrix stated in setup.cfg and README.md. The lowest pins are the declared lower bounds; the main
# test virtualenv covers the newest releases (huggingface_hub 2.x).
# Each set: what to install, and the huggingface_hub version prefix that must end up installed.
DEPENDENCY_SETS = {
    "oldest (hub 0.20, requests 2.25, wsproto 1.0)": (
        ["huggingface_hub==0.20.3", "requests==2.25.1", "wsproto==1.0.0"], "0.20.3"),
    "hub 0.x, last requests-based": (["huggingface_hub==0.36.2", "requests", "wsproto"], "0.36.2"),
    # the newest 1.x this interpreter can install (1.9 and later need Python 3.10)
    "hub 1.x, httpx-based": (["huggingface_hub>=1.0,<2", "requests", "wsproto"], "1."),
}
INSTALL_TIMEOUT_S = 240


@pytest.mark.slow  # vermin in a fresh interpreter
def test_library_modules_need_nothing_newer_than_python_3_9():
    vermin = Path(sys.executable).with_name("vermin")
    result = subprocess.run([str(vermin), "--target=3.9-", "--violations", "--no-tips", "--eval-annotations",
                             *LIBRARY_MODULES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_library_module_imports_no_event_loop_or_web_framework(module):
    tree = ast.parse((ROOT / module).read_text(), filename=module)
    imported: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.append(node.module.split(".")[0])
    assert not FORBIDDEN_IMPORTS.intersection(imported), f"{module} imports {FORBIDDEN_IMPORTS.intersection(imported)}"


@pytest.mark.slow  # a fresh virtualenv per dependency set
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
@pytest.mark.parametrize("requirements, hub_version", list(DEPENDENCY_SETS.values()), ids=list(DEPENDENCY_SETS))
def test_smoke_local_passes_on_each_supported_dependency_set(tmp_path, requirements, hub_version):
    interpreter = support.python_of((3, 9)) or sys.executable
    venv = tmp_path / "venv"
    subprocess.run([interpreter, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              *requirements], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert install.returncode == 0, install.stderr[-2000:]
    # The project's modules from the checkout, nothing else of the test environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(ROOT)
    smoke = subprocess.run([python, "-m", "hf_sandbox_provider", "smoke", "--local", "--json"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    report = json.loads(smoke.stdout)
    assert report["ok"] is True and report["error"] is None
    installed = subprocess.run([python, "-c", "import huggingface_hub; print(huggingface_hub.__version__)"],
                               capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert installed.startswith(hub_version), f"huggingface_hub {installed} installed, {hub_version} wanted"
