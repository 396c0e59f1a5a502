"""Packaging on a machine without a C++ compiler: ``python -m build`` makes an sdist and, from it, a
wheel whose extensions could not be built; installed, tracecmp captures on the Python references
and says so once, in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CAPTURE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    # An editable install of tracecmp in this environment maps its modules, built extensions
    # included, to the source tree: without its finder only the wheel is seen.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "")]
    import torch
    import tracecmp
    from tracecmp.capture import native, stats

    out = Path(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    for run in ("a", "b"):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with tracecmp.TraceCompare(out / run, model=model) as tc:
            model(torch.randn(3, 4)).sum().backward()
            tc.step()
    print(tracecmp.__file__)
    print(stats.native_available(), native.error("_crecord") is None)
    print(len(tracecmp.load(out / "a").to_frame()), tracecmp.compare(out / "a", out / "b").agrees)
    """
)


def test_sdist_and_wheel_built_without_a_compiler_run_on_the_references(tmp_path: Path) -> None:
    source = tmp_path / "src"  # what the sdist is made from: the sources, no built extensions
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in ("csrc", "tracecmp"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACECMP_")}
    no_compiler = {**env, "CC": "false", "CXX": "false"}
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(source)],
        env=no_compiler,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "tracecmp will use its slower pure-Python/torch reference" in built.stdout + built.stderr
    sdists, wheels = list((tmp_path / "dist").glob("*.tar.gz")), list((tmp_path / "dist").glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1  # the wheel is built from the sdist
    with tarfile.open(sdists[0]) as sdist:  # every source a compiler needs, headers included
        names = {name.split("/", 1)[-1] for name in sdist.getnames()}
    assert {f"csrc/{name.name}" for name in (ROOT / "csrc").glob("*.[ch]pp")} <= names
    with zipfile.ZipFile(wheels[0]) as wheel:  # the extensions' C contract ships with the package
        assert {"tracecmp/_crecord.pyi", "tracecmp/_cstats.pyi"} <= set(wheel.namelist())
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheels[0])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert not list(site.glob("tracecmp/*.so"))
    ran = subprocess.run(
        [sys.executable, "-c", _CAPTURE, str(tmp_path / "traces")],
        env={**env, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    where, native, counts = ran.stdout.splitlines()[-3:]
    assert Path(where).is_relative_to(site)
    assert native == "False False"
    ops, agrees = counts.split()
    assert int(ops) > 10 and agrees == "True"
    notes = [line for line in ran.stderr.splitlines() if line.startswith("tracecmp:")]
    assert len(notes) == 1, ran.stderr  # two captures, one notice
    assert "_cstats and _crecord not built" in notes[0] and "Python reference" in notes[0]
