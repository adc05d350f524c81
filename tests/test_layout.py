"""The layout: a core (hf_sandbox_provider.py + proxy.py) that imports no layer, command-line or test machinery;
the training layer and the command line beside it, each one more file to vendor, re-exported lazily by the
core; what a vendored copy misses is said in one sentence; `pip install .` installs every module."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import support
from hf_jobs_emulator import echo_server_command
from test_cli import REPO, RUN_TIMEOUT_S, clean_env

LIBRARY = os.path.join(REPO, "hf_sandbox_provider.py")
# What the command line needs: the core, proxy.py and the modules it imports (not the emulator).
COMMAND_LINE = ["hf_sandbox_provider.py", "proxy.py", "hf_sandbox_training.py", "hf_sandbox_cli.py"]


def module_level_imports(path: str):
    """Top-level module names imported when the module is imported (not inside functions or classes)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    names = []
    for node in tree.body:
        for child in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(child, ast.Import):
                names += [alias.name.split(".")[0] for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                names += [child.module.split(".")[0]] if child.level == 0 and child.module else \
                    [alias.name for alias in child.names]
    return names


@pytest.mark.parametrize("module, sibling", [("hf_sandbox_provider.py", "proxy"),
                                             ("hf_sandbox_training.py", "hf_sandbox_provider")])
def test_the_library_modules_import_no_layer_argparse_or_emulator_at_module_level(module, sibling):
    imported = module_level_imports(os.path.join(REPO, module))
    assert not {"argparse", "hf_jobs_emulator", "hf_sandbox_training", "hf_sandbox_cli"} & set(imported)
    assert sibling in imported  # the one module below it


# Every module beside the core that imports it (a layer), or that the core must never load (the emulators).
LAYERS = ("hf_sandbox_training", "hf_sandbox_cli", "hf_sandbox_pool", "proxy_host", "hf_jobs_emulator",
          "hf_sbx_emulator")


def test_no_core_function_imports_a_layer_module():
    """No import circle: the core's functions neither import a layer nor name one; a layer is found through
    the module-level tables (_LAYERS, _PLACEMENT_LAYERS) by the one loader, _import_layer."""
    tree = ast.parse(Path(LIBRARY).read_text(encoding="utf-8"), filename=LIBRARY)
    found = []
    for function in (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Lambda))):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names if alias.name.split(".")[-1] in LAYERS]
            elif isinstance(node, ast.ImportFrom):
                found += [alias.name for alias in node.names if alias.name in LAYERS]
                found += [node.module] if node.module and node.module.split(".")[-1] in LAYERS else []
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in LAYERS:
                found.append(node.value)
    assert found == []


@pytest.mark.slow  # a fresh interpreter importing requests and huggingface_hub
def test_importing_the_core_loads_no_layer_nor_the_emulator_and_starts_no_thread():
    script = textwrap.dedent("""
        import json, os, sys, hf_sandbox_provider as hsp
        ours = %r""" % (LAYERS,) + """
        loaded = sorted(set(ours) & set(sys.modules))
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
        import hf_sandbox_cli, hf_sandbox_training
        reexported = (hsp.Sandbox is hf_sandbox_training.Sandbox and hsp.main is hf_sandbox_cli.main
                      and "EnvSession" in dir(hsp) and "EnvSession" in hsp.__all__)
        print(json.dumps({"loaded": loaded, "threads": threads, "reexported": reexported}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"loaded": [], "threads": 1, "reexported": True}


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_core_loads_no_argparse():
    """README: the library modules import neither argparse nor the emulator (the emulator and the layers are
    checked above); only the command lines load the parser."""
    script = "import sys, hf_sandbox_provider\nprint('argparse' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.split() == ["False"], result.stdout + result.stderr


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
    support.vendored_package(str(tmp_path), "vendored", names)
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
    env["HF_TOKEN"], env["HF_ENDPOINT"] = "hf_unused_" + "x" * 20, "http://127.0.0.1:9"  # (no call is made)
    sweep = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "sweep", "--pool", "mypool"],
                           cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    lines = sweep.stderr.strip().splitlines()  # before: an ImportError's traceback
    assert sweep.returncode == 2 and len(lines) == 1 and "hf_sandbox_pool.py" in lines[0], sweep.stderr


@pytest.mark.slow  # fresh interpreters importing requests, huggingface_hub and openenv
def test_a_vendored_copy_with_the_emulator_passes_smoke_local(tmp_path):
    env = vendor(tmp_path, COMMAND_LINE + ["hf_jobs_emulator.py"])
    result = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "smoke", "--local", "--json"],
                            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert '"ok": true' in result.stdout


# Run inside the vendored package against the emulator: a provider, then what the core says about Sandbox.
CORE_ALONE = textwrap.dedent("""
    import json, sys, requests
    from vendored.hf_sandbox_provider import HFSandboxProvider
    provider = HFSandboxProvider("img:tag", endpoint=sys.argv[1], token=sys.argv[2], command=json.loads(sys.argv[3]),
                                 poll_interval_s=0.05)
    base_url = provider.start_container()
    provider.wait_for_ready(base_url)
    print("health", requests.get(base_url + "/health", timeout=30).status_code)
    provider.stop_container()
    print("stage", provider.stage)
    try:
        from vendored.hf_sandbox_provider import Sandbox
    except ImportError as exc:
        print("ImportError", exc)
    try:
        HFSandboxProvider("img:tag", endpoint=sys.argv[1], token=sys.argv[2], pool="p")
    except ImportError as exc:
        print("ImportError", exc)
    print("modules", sorted(m for m in sys.modules if m.startswith(("vendored.", "hf_", "proxy"))))
""")

# The same with the training layer beside the core: a Sandbox session.
CORE_AND_TRAINING = textwrap.dedent("""
    import json, sys
    from vendored.hf_sandbox_provider import Sandbox
    import vendored.hf_sandbox_training as training
    with Sandbox("img:tag", endpoint=sys.argv[1], token=sys.argv[2], command=json.loads(sys.argv[3]),
                 poll_interval_s=0.05) as box:
        with box.session() as session:
            session.reset()
            print("step", session.step({"message": "hi"})["observation"]["echoed_message"])
    print("same class", Sandbox is training.Sandbox)
    print("modules", sorted(m for m in sys.modules if m.startswith(("vendored.", "hf_", "proxy"))))
""")


def run_vendored(tmp_path, names, script, emulator):
    env = vendor(tmp_path, names)
    return subprocess.run([sys.executable, "-c", script, emulator.endpoint, emulator.token,
                           json.dumps(echo_server_command())], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


@pytest.mark.slow  # fresh interpreters and a job
def test_the_core_vendored_alone_runs_a_provider_and_names_the_file_sandbox_needs(tmp_path, emu):
    result = run_vendored(tmp_path, ["hf_sandbox_provider.py", "proxy.py"], CORE_ALONE, emu)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["health 200", "stage CANCELED"]
    assert lines[2].startswith("ImportError Sandbox lives in hf_sandbox_training.py") and "copy it" in lines[2]
    assert lines[3].startswith("ImportError pool= (pooled placement) lives in hf_sandbox_pool.py"), lines[3]
    assert "copy it" in lines[3]
    assert lines[4] == "modules ['vendored.hf_sandbox_provider', 'vendored.proxy']"
    cli = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "smoke", "--local"], cwd=str(tmp_path),
                         env=clean_env(tmp_path, PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "hf_sandbox_cli.py" in cli.stderr and "Traceback" not in cli.stderr
    shutil.copy(os.path.join(REPO, "hf_sandbox_cli.py"), str(tmp_path / "vendored"))  # the CLI without its layer
    cli = subprocess.run([sys.executable, "-m", "vendored.hf_sandbox_provider", "smoke", "--local"], cwd=str(tmp_path),
                         env=clean_env(tmp_path, PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "hf_sandbox_training.py" in cli.stderr and "copy it" in cli.stderr, cli.stderr


@pytest.mark.slow  # fresh interpreters and a job
def test_the_core_vendored_with_the_training_layer_runs_a_sandbox_session(tmp_path, emu):
    result = run_vendored(tmp_path, ["hf_sandbox_provider.py", "proxy.py", "hf_sandbox_training.py"],
                          CORE_AND_TRAINING, emu)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "step hi", "same class True",
        "modules ['vendored.hf_sandbox_provider', 'vendored.hf_sandbox_training', 'vendored.proxy']"]


@pytest.mark.slow  # a fresh interpreter and a job
def test_a_sandbox_pickled_here_loads_and_runs_in_a_fresh_process_also_under_its_old_module_name(tmp_path, emu):
    from hf_sandbox_provider import Sandbox

    box = Sandbox("img:tag", begin=False, endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                  poll_interval_s=0.05)
    data = pickle.dumps(box)
    assert b"hf_sandbox_training" in data
    # A pickle made before the move names hf_sandbox_provider.Sandbox (a name of the same length).
    (tmp_path / "new.pkl").write_bytes(data)
    (tmp_path / "old.pkl").write_bytes(data.replace(b"hf_sandbox_training", b"hf_sandbox_provider"))
    script = textwrap.dedent("""
        import pickle, sys
        from pathlib import Path
        for name in ("new.pkl", "old.pkl"):
            box = pickle.loads(Path(name).read_bytes())
            with box, box.session() as session:
                session.reset()
                print(name, type(box).__module__, session.step({"message": name})["observation"]["echoed_message"])
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=clean_env(tmp_path),
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["new.pkl hf_sandbox_training new.pkl", "old.pkl hf_sandbox_training old.pkl"]


@pytest.mark.slow  # a fresh virtualenv and a wheel build
def test_pip_install_outside_the_checkout_installs_the_core_and_its_layers(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ and egg-info there
    source.mkdir()
    for name in ["setup.cfg", "pyproject.toml", "README.md"] + [f for f in os.listdir(REPO) if f.endswith(".py")]:
        shutil.copy(os.path.join(REPO, name), str(source / name))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # The dependencies (and the build tools) come from this interpreter's site-packages, after the venv's own.
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "_test_dependencies.pth"), "w") as pth:
        pth.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                              "--no-build-isolation", "--ignore-installed", str(source)], cwd=str(tmp_path), env=env,
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    script = ("import hf_sandbox_provider, hf_sandbox_training, hf_sandbox_cli\n"
              "from hf_sandbox_provider import Sandbox, EnvSession, main\n"
              "print(all(m.__file__.startswith(sys.argv[1]) for m in (hf_sandbox_provider, hf_sandbox_training, "
              "hf_sandbox_cli)), Sandbox is hf_sandbox_training.Sandbox, main is hf_sandbox_cli.main)")
    result = subprocess.run([python, "-c", "import sys\n" + script, purelib], cwd=str(tmp_path), env=env,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0 and result.stdout.split() == ["True"] * 3, result.stdout + result.stderr
