"""A bad ``CRAWLMESH_*`` value is one clear line naming the variable, before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.settings import SettingsProblem, check_settings


@pytest.mark.parametrize(("name", "value", "says"), [
    ("CRAWLMESH_FETCHER_HOST_RULES", '{"127.0.0.*": {delay_s: 0}', "not valid JSON"),
    ("CRAWLMESH_FETCHER_HOST_RULES", '{"127.0.0.*": {"delay_s": -1}}', "greater than or equal to 0"),
    ("CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT", "0", "must be -1 (no cap) or at least 1"),
    ("CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT", "abc", "valid integer"),
    ("CRAWLMESH_PARSER_MAX_BODY_BYTES", "-5", "greater than 0"),
])
def test_check_settings_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str,
                                           value: str, says: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsProblem) as problem:
        check_settings()
    assert str(problem.value).startswith(f"{name}: ") and says in str(problem.value)
    assert repr(value) in str(problem.value)


def test_check_settings_accepts_the_defaults() -> None:
    check_settings()


def test_a_command_with_a_bad_setting_exits_2_with_one_line() -> None:
    env = {"CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT": "-7", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "shared.cli.main", "service", "fetcher"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "crawlmesh: invalid setting: CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT: Value error, must be "
        "-1 (no cap) or at least 1 (JetStream reads 0 as no cap) (got '-7')"]
