"""pytest setup of the package's tests. Tests marked `gpu` need a CUDA device and torch; the ctest
entry kvq:python_gpu runs only those and exits 77 (ctest: skipped, never passed) when every one
of them was skipped, as on a machine without a GPU."""
import pytest

_outcomes = {"passed": 0, "skipped": 0}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (and torch); run by kvq:python_gpu")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _outcomes["passed"] += 1
    if report.skipped:
        _outcomes["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    if session.config.option.markexpr == "gpu" and exitstatus in (0, 5) and _outcomes["passed"] == 0:
        print("\nkvq: no GPU test ran (no CUDA device or no torch): reported as skipped")
        session.exitstatus = 77
