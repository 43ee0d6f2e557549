"""pytest configuration for the repository's Python tests under tests/ (quality, load, faults,
scale, bench): the marker the client package's tests also use."""


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
