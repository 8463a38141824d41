"""The GPU relay's requirement check (scripts/gpu_sglang/check_requirements.py) finds the
next missing piece on this machine: a requirement neither carried nor on the GPU machine,
or met by a version that does not fit, unless it is waived with a reason."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_sglang" / "check_requirements.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_requirements", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {line}\n" for line in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)


def test_unmet_wrong_version_and_waived_requirements(tmp_path: Path) -> None:
    check = _load()
    _wheel(
        tmp_path, "alpha", "1.0", "beta>=2", "gamma", "delta<1", "win32api; sys_platform == 'win32'"
    )
    _wheel(tmp_path, "beta", "2.1")
    _wheel(tmp_path, "ipython", "9.0", "jedi>=0.18", "extra-only; extra == 'test'")
    machine = {"delta": check.Version("1.5"), "jedi-unused": None}
    problems = check.unmet(tmp_path, machine)
    assert problems == [
        "alpha requires gamma: neither carried nor on the GPU machine",
        "alpha requires delta<1: the GPU machine has delta 1.5",
    ]  # beta carried, win32api and the extra do not apply there, ipython's jedi is waived


def test_the_machine_list_reads_versions_and_bare_names(tmp_path: Path) -> None:
    check = _load()
    listing = tmp_path / "list.txt"
    listing.write_text("# comment\nTorch==2.11.0\nsome_pkg\n")
    assert check.machine_packages(listing) == {"torch": check.Version("2.11.0"), "some-pkg": None}
