import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# processes that tests start by hand (not through refit's launcher, which makes its own) share one job secret
os.environ.setdefault("REFIT_SECRET", "refit-tests-" + secrets.token_hex(16))
# Ray starts its workers (the data plane's storage actors, the tests' actors) at nice 15: beside the other tests'
# processes at nice 0 on a 2-core machine they got a few percent of a core, and a Ray test took ten times its time
# alone. Every Ray the tests start (in this process or a child) runs its workers at the tests' own priority.
os.environ.setdefault("RAY_worker_niceness", "0")

_UNITS_ENV = "REFIT_TEST_UNITS"  # pytest -n: where the workers write each test's unit of work

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_modifyitems(config, items):
    _write_units(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _xdist_group(item) -> str:
    """The unit of work ``pytest -n`` (scripts/test.sh) hands one worker: the tests that share a fixture wider
    than one test. A session or package fixture of ours groups its whole folder (the vLLM engine pool, the data
    plane's Ray instance), a module one its file; a test with neither is a unit of its own."""
    group = item.nodeid
    for defs in item._fixtureinfo.name2fixturedefs.values():
        d = defs[-1]
        if not d.baseid:  # pytest's and plugins' own fixtures
            continue
        if d.scope in ("session", "package"):
            return d.baseid
        if d.scope == "module":
            group = item.nodeid.split("::")[0]
    return group


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        # the controller of ``pytest -n``: where its workers write each test's unit (they collect; it only sees
        # test ids)
        config._refit_units = Path(tempfile.mkdtemp(prefix="refit-units-")) / "units.json"
        os.environ[_UNITS_ENV] = str(config._refit_units)


def pytest_unconfigure(config):
    units = getattr(config, "_refit_units", None)
    if units is not None:
        shutil.rmtree(units.parent, ignore_errors=True)


def _write_units(items) -> None:
    path = os.environ.get(_UNITS_ENV)
    if path:  # a worker: every worker collects the same tests, so each writes the same map
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps({item.nodeid: _xdist_group(item) for item in items}))
        os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (a run without it never calls it)
def pytest_xdist_make_scheduler(config, log):
    """Units of work as ``_xdist_group`` makes them (pytest-xdist's own ``xdist_group`` marks are not read
    under pytest 9.2, whose test ids are not rewritable), each unit's tests one after the other in one
    worker, the units with the most tests first."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                self.units = json.loads(config._refit_units.read_text())
            return self.units.get(nodeid, nodeid)

    return UnitScheduling(config, log)
