"""The embedded mesh's metrics ports: one per service process, recorded in mesh.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.launcher import Child, EmbeddedMesh, state_file
from shared.settings import MeshSettings


def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replicas: dict[str, int],
            **settings: object) -> EmbeddedMesh:
    spawned: list[tuple[str, int]] = []

    def spawn(self: EmbeddedMesh, child: Child) -> None:
        spawned.append((child.name, child.metrics_port))

    monkeypatch.setattr(EmbeddedMesh, "spawn", spawn)
    mesh = EmbeddedMesh(MeshSettings(home=tmp_path, **settings), replicas=replicas)  # type: ignore[arg-type]
    mesh.start_services()
    assert spawned == [(c.name, c.metrics_port) for c in mesh.children]
    return mesh


def test_each_service_gets_base_plus_its_index_and_replicas_the_ports_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = started(tmp_path, monkeypatch, {"fetcher": 3}, metrics_base_port=9460)
    ports = {c.name: c.metrics_port for c in mesh.children}
    assert ports == {"seeder": 9460, "dedup": 9461, "fetcher": 9462, "fetcher#1": 9465,
                     "fetcher#2": 9466, "parser": 9463, "sink": 9464}
    recorded = json.loads(state_file(tmp_path).read_text())["metrics"]
    assert recorded["seeder"] == "http://127.0.0.1:9460"
    assert recorded["fetcher#2"] == "http://127.0.0.1:9466"


def test_base_port_zero_turns_the_endpoints_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = started(tmp_path, monkeypatch, {}, metrics_base_port=0)
    assert {c.metrics_port for c in mesh.children} == {0}
    assert json.loads(state_file(tmp_path).read_text())["metrics"] == {}


def test_a_wildcard_listen_address_is_recorded_as_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = started(tmp_path, monkeypatch, {}, metrics_host="0.0.0.0", metrics_base_port=9000)
    assert mesh.metrics_urls()["sink"] == "http://127.0.0.1:9004"
