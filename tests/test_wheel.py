"""The installed product: the wheel holds every subpackage and the Hydra configs, and a fresh
virtual environment with only that wheel (the checkout out of reach) composes a config, trains,
plans and prepares data from any folder.

The fresh environment borrows the dependencies (torch, hydra, ...) of the running one through
a ``.pth`` file naming its site-packages folders. Python does not read the ``.pth`` files inside
a folder listed that way, so the running environment's editable install of this checkout (a
``__editable__*.pth`` finder) stays out: ``trainer`` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "models", "parallelisms")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_pyproject_lists_every_package_and_config() -> None:
    """Fast guard: a new subpackage or config folder the wheel would silently drop fails here."""
    from setuptools import find_packages

    tool = _pyproject()["tool"]["setuptools"]
    on_disk = set(find_packages(str(REPO), include=[f"{p}*" for p in PACKAGES]))
    listed = set(tool["packages"])
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages (pyproject.toml)"
    assert tool["package-dir"]["trainer.configs"] == "configs" and "trainer.configs" in listed
    patterns = tool["package-data"]["trainer.configs"]
    yaml = [p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml")]
    missed = [str(p) for p in yaml if not any(p.match(pattern) for pattern in patterns)]
    assert not missed, f"configs {missed} match no package-data pattern {patterns} in pyproject.toml"


def _copy_sources(dest: Path) -> None:
    """The files a fresh clone would hold (tracked and new, not ignored): no stale build/ or egg-info."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)


def _build(tmp: Path) -> tuple[Path, Path]:
    """(wheel, sdist) built offline from a copy of the checkout."""
    src, dist = tmp / "src", tmp / "dist"
    _copy_sources(src)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    sdist = subprocess.run([sys.executable, "-c", code], cwd=src, check=True, capture_output=True, text=True)
    return next(dist.glob("*.whl")), dist / sdist.stdout.strip().splitlines()[-1]


def _files_per_package(names: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        if name.endswith("/"):
            continue
        top = name.split("/")[0]
        groups["trainer/configs" if name.startswith("trainer/configs/") else top].append(name)
    return dict(groups)


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv holding only the wheel, the running environment's dependencies visible via a .pth."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    (Path(purelib) / "_deps_of_the_test_env.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}


def _check_wheel(wheel: Path, sdist: Path) -> None:
    """Print the wheel's files per package; every module of the checkout and every config is in it."""
    groups = _files_per_package(zipfile.ZipFile(wheel).namelist())
    print(f"\n{wheel.name}: files per package")
    for top in sorted(groups):
        names = " ".join(n.split("/", 1 + top.count("/"))[-1] for n in groups[top])
        print(f"  {top}/ ({len(groups[top])}): {names}")
    for pkg in PACKAGES:
        expected = {p.relative_to(REPO).as_posix() for p in (REPO / pkg).rglob("*.py")}
        assert expected <= set(groups[pkg]), f"missing from the wheel: {sorted(expected - set(groups[pkg]))}"
    configs = {f"trainer/{p.relative_to(REPO).as_posix()}" for p in (REPO / "configs").rglob("*.yaml")}
    assert configs == set(groups["trainer/configs"])
    assert "trainer/data/loader.py" in groups["trainer"]
    assert "trainer/configs/experiment/debug.yaml" in groups["trainer/configs"]
    # `python -m build` builds the wheel from the sdist, which therefore needs the configs too.
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"configs/train.yaml", "configs/experiment/debug.yaml", "trainer/data/loader.py"} <= in_sdist


def _run_outside(python: Path, tmp: Path, work: Path) -> dict[str, tuple[int, str, str]]:
    """{name: (exit status, stdout, stderr)} of the commands, run together from ``work``."""
    commands = {
        "where": [
            "-c",
            "import json, trainer, trainer.data, models, parallelisms; from trainer.config import "
            "CONFIG_DIR; print(json.dumps([trainer.__file__, CONFIG_DIR]))",
        ],
        "train": [
            "-m",
            "trainer.main",
            "+experiment=debug",
            "training.steps=3",
            "metrics.log_freq=1",
            "training.eval_freq=0",
            "data.max_documents=200",
            "checkpoint.enable=false",
            "metrics.tensorboard=false",
            "training.device=cpu",
            "job.name=from_wheel",
        ],
        "plan": ["-m", "trainer.plan", "+experiment=debug", "cluster=cpu", "cluster.nodes=1"],
        "prep": [
            "-m",
            "trainer.prepare_data",
            "data=builtin",
            "data.max_documents=20",
            f"out={tmp / 'shards'}",
        ],
        "bad": ["-m", "trainer.main", "+experiment=nope"],
    }
    procs = {
        name: subprocess.Popen(
            [str(python), *args],
            cwd=work,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    outputs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    return {name: (procs[name].returncode, *outputs[name]) for name in procs}


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    start = time.perf_counter()
    wheel, sdist = _build(tmp_path)
    _check_wheel(wheel, sdist)
    python = _fresh_venv(tmp_path, wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = _run_outside(python, tmp_path, work)
    for name, (code, stdout, stderr) in out.items():
        assert code == (2 if name == "bad" else 0), f"{name}: {stdout[-2000:]}\n{stderr[-3000:]}"

    package_file, config_dir = json.loads(out["where"][1])
    venv = str(tmp_path / "venv")
    assert package_file.startswith(venv) and config_dir.startswith(venv), (package_file, config_dir)
    print(f"trainer from {package_file}\nconfigs from {config_dir}")

    run_dir = work / "outputs" / "from_wheel"  # job.dump_folder is relative to the working directory
    assert (run_dir / "config.yaml").is_file()
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    print(f"3-step run from {work}: losses {losses}")
    assert [s for s, _ in losses] == [1, 2, 3] and all(0 < v < 10 for _, v in losses)
    assert not any(Path(package_file).parent.rglob("outputs")), "the run wrote into the installed package"

    assert "verdict" in out["plan"][1]
    print("plan:", out["plan"][1].strip().splitlines()[-2])
    assert (tmp_path / "shards" / "index.json").is_file()
    print("prepare_data:", out["prep"][2].strip().splitlines()[-1])
    bad = out["bad"][2]
    print("bad experiment:", bad.strip())
    assert "experiment=nope" in bad and config_dir in bad and "Traceback" not in bad
    print(f"wheel test: {time.perf_counter() - start:.1f}s")
