"""constraints.txt: the pins `make setup` installs with are exact, leave torch to the user, and sit inside
the ranges pyproject.toml declares (a pin outside them would make pip refuse the install); `make check-newest`
tries the newest transformers those ranges allow, in a venv of its own, and CI runs it as a report only."""
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version and name == name.strip(), f"constraints.txt: {line!r} is not name==version"
            out[canonicalize_name(name)] = version
    return out


def test_pins_are_exact_and_never_torch():
    pins = _pins()
    assert "transformers" in pins
    # a GPU user installs the CUDA torch of their choice first; a torch pin here would replace it
    assert not {n for n in pins if n == "torch" or n == "triton" or n.startswith("nvidia-")}


def test_pins_sit_inside_the_declared_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    pins = _pins()
    for req in declared:
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside pyproject's {req}"


def test_setup_installs_with_the_constraints():
    make = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS ?= constraints.txt" in make and "-c $(CONSTRAINTS)" in make
    assert "-c constraints.txt" in (ROOT / "environment.yml").read_text()


def test_check_newest_takes_the_newest_transformers_the_range_allows_in_its_own_venv():
    import re
    import subprocess

    make = (ROOT / "Makefile").read_text()
    target = make[make.index("check-newest:"):]
    assert "$(NEWEST)/bin/python" in target and "-c $(CONSTRAINTS)" not in target  # never the pinned versions
    assert "--upgrade \"$(TRANSFORMERS)\"" in target and "--compare docs/families.md" in target
    assert ".venv-newest/" in (ROOT / ".gitignore").read_text().splitlines()
    printed = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "-n", "check-newest"],
                             capture_output=True, text=True, check=True).stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = next(r.split("#")[0].strip() for r in project["dependencies"] if r.startswith("transformers"))
    assert f'"{declared}"' in printed  # the range pyproject.toml declares, read from it
    assert re.search(r"pytest .*tests/offloading/test_families_runtime\.py", printed)


def test_ci_reports_the_newest_release_without_failing_on_it():
    run = (ROOT / ".ci" / "run").read_text()
    assert "set -e" in run and run.index("make test") < run.index("make check-newest")
    assert "if make check-newest; then" in run  # a failing report cannot end CI (set -e spares `if` conditions)
