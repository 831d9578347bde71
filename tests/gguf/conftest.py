"""The tiny model zoo of tests/model, shared with the GGUF tests."""

from tests.model.conftest import zoo  # noqa: F401 - a session fixture re-exported here
