"""The wheel is whole: built as a user would (`pip wheel --no-deps --no-build-isolation`), it holds every module under
megarl/ and the launcher's templates, and `megarl launch slurm` runs from a non-editable install of it."""

import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["megarl", "launch", "checkpoints_tools", "setup.py", "pyproject.toml", "README.md"]
PACKAGE_DATA = ["launch/sbatch.sh.tmpl", "launch/clusters/example.env"]


def _modules(root: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(os.path.join(root, "megarl"))
        for f in files
        if f.endswith(".py")
    }


def test_wheel_holds_every_module_and_template_and_launches_from_a_plain_install(tmp_path, tiny_llama_dir):
    src = tmp_path / "src"  # a copy of the sources: the build leaves build/ and *.egg-info beside them
    for name in SOURCES:
        (shutil.copytree if os.path.isdir(os.path.join(REPO, name)) else shutil.copy)(
            os.path.join(REPO, name), src / name
        )
    for cache in src.rglob("__pycache__"):
        shutil.rmtree(cache)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(src)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("megarl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_modules(REPO) - names)
    assert missing == [], f"modules missing from the wheel: {missing}"
    assert [f for f in PACKAGE_DATA if f not in names] == []

    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                str(wheel)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert all((target / f).is_file() for f in PACKAGE_DATA)
    env = {**os.environ, "PYTHONPATH": str(target)}
    recipe = os.path.join(REPO, "configs", "tiny_grpo.yaml")
    probe = "import megarl.reshard.plan, megarl.run.train, megarl; print(megarl.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stdout + where.stderr
    launched = subprocess.run(
        [str(target / "bin" / "megarl"), "launch", "slurm", recipe, "--nodes", "2", "--gpus-per-node", "2",
         f"model.path={tiny_llama_dir}", "actor.parallel.tp=2", "actor.parallel.dp=2",
         f"trainer.output_dir={tmp_path / 'run'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    script = launched.stdout
    assert script.startswith("#!/bin/bash\n# megarl on SLURM") and "#SBATCH --nodes=2" in script
    assert "-m megarl.launch.node " in script and "--nproc-per-node=2" in script
