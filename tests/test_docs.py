"""docs/configuration.md's flag tables are generated from the config dataclasses; they must not drift."""

import pathlib

from specdec_tools.cli import SERVICES, _service
from specdec.serving.config import markdown_table

CONFIGURATION = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_tables_match_the_code():
    text = CONFIGURATION.read_text()
    for name in SERVICES:
        cls, prefix, _ = _service(name)
        assert markdown_table(cls, prefix) in text, f"docs/configuration.md table for {name} is stale: run `specdec config-table`"


def test_config_from_flags_and_environment():
    from specdec.serving.config import from_argv
    from target_service.config import TargetConfig

    config = from_argv(TargetConfig, ["--port", "6000"], "SPECDEC_TARGET_", "t", env={"SPECDEC_TARGET_PORT": "7000", "SPECDEC_TARGET_DEVICE": "cpu"})
    assert config.port == 6000 and config.device == "cpu"  # the flag beats the env var; env beats default
    from coordinator.config import CoordinatorConfig

    assert from_argv(CoordinatorConfig, [], "SPECDEC_COORDINATOR_", "c", env={"SPECDEC_COORDINATOR_ADAPTIVE": "false"}).adaptive is False
    assert from_argv(CoordinatorConfig, ["--no-adaptive"], "SPECDEC_COORDINATOR_", "c", env={}).adaptive is False
