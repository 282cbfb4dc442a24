"""``crawlmesh tenant …`` run as a real command against a nats-server in operator mode:
every lifecycle step checked by its output and by what a tenant's creds can then do."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.errors import Error as NatsError

from shared import streams, subjects
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.settings import MeshSettings
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(240)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run(env: dict[str, str], *args: str, stdin: str = "") -> Run:
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args], cwd=REPO_ROOT,
        env={**env, "COLUMNS": "250"}, capture_output=True, timeout=90, input=stdin.encode(),
    )
    return Run(done.returncode, done.stdout.decode(), done.stderr.decode())


def ok(env: dict[str, str], *args: str) -> Run:
    done = run(env, *args)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def show(env: dict[str, str], name: str) -> dict:
    return json.loads(ok(env, "tenant", "show", name, "--json").stdout)


def refused(env: dict[str, str], creds: Path) -> bool:
    """True if the server does not accept the user of ``creds`` (``status --creds``)."""
    done = run(env, "status", "--creds", str(creds))
    if done.returncode == 0:
        return False
    assert "did not accept the user" in done.stderr, done.stderr
    return True


async def _results_config(settings: MeshSettings, creds: Path) -> dict:
    tnc = await connect(settings, "test-tenant", persistent=False, creds=creds)
    try:
        info = await tnc.jetstream().stream_info(streams.RESULTS)
        return {"max_bytes": info.config.max_bytes, "messages": info.state.messages}
    finally:
        await tnc.close()


async def _publish_results(settings: MeshSettings, tenant: str, count: int, size: int) -> int:
    """Publish ``count`` results of ``size`` bytes as MESH; how many the tenant accepted."""
    nc = await connect(settings, "test-mesh", persistent=False)
    stored = 0
    try:
        js = nc.jetstream()
        for _ in range(count):
            try:
                ack = await js.publish(subjects.results(tenant, "job1"), b"x" * size,
                                       headers={"Nats-Msg-Id": subjects.new_job_id()})
                stored += not ack.duplicate
            except NatsError:
                pass
    finally:
        await nc.close()
    return stored


def test_tenant_lifecycle(settings: MeshSettings, child_env: dict[str, str],
                          tmp_path: Path) -> None:
    env = child_env
    keys = KeyStore(settings.home)
    init = ok(env, "init")
    assert "tenant default: A" in init.stderr
    assert keys.tenant_creds("default").exists()

    added = ok(env, "tenant", "add", "acme", "--storage", "1MiB", "--max-pages-per-job", "50",
               "--max-concurrent-jobs", "2")
    creds = keys.tenant_creds("acme")
    assert "tenant acme: A" in added.stdout and "(active)" in added.stdout
    assert "storage:             1.0MiB (1048576 bytes)" in added.stdout
    assert "max pages per job:   50" in added.stdout
    assert f"creds: {creds}" in added.stdout
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    tenant_id = added.stdout.split("tenant acme: ", 1)[1].split()[0]

    again = run(env, "tenant", "add", "acme")
    assert again.returncode == 1 and f"tenant 'acme' exists ({tenant_id})" in again.stderr

    listing = ok(env, "tenant", "list").stdout.splitlines()
    assert listing[0].split() == ["NAME", "STATUS", "STORAGE", "ID"]
    assert ["acme", "active", "1.0MiB", tenant_id] in [line.split() for line in listing]
    assert any(line.split()[0] == "default" for line in listing[1:])

    shown = show(env, "acme")
    assert shown["id"] == tenant_id and shown["status"] == "active"
    assert shown["quota"]["storage_bytes"] == 1 << 20
    assert shown["quota"]["max_pages_per_job"] == 50
    assert shown["usage"]["streams"] == 2
    assert shown["usage"]["RESULTS"]["messages"] == 0
    assert shown["creds"] == str(creds)
    text = ok(env, "tenant", "show", "acme").stdout
    assert "storage:   0B of 1.0MiB (0.0%)" in text and "streams:   2 of 10" in text

    # The tenant's creds work: an empty job list from its EVENTS.
    assert ok(env, "status", "--creds", str(creds)).stdout == ""

    # Raise the quota: RESULTS grows with it, live.
    updated = ok(env, "tenant", "update", "acme", "--storage", "2MiB",
                 "--max-concurrent-jobs", "3")
    assert "storage:             2.0MiB (2097152 bytes)" in updated.stdout
    assert "max concurrent jobs: 3" in updated.stdout
    expected = streams.tenant_stream_config(streams.RESULTS, settings, 2 << 20).max_bytes
    assert asyncio.run(_results_config(settings, creds))["max_bytes"] == expected

    # Lower it below use: allowed; stored results are kept, new ones refused.
    assert asyncio.run(_publish_results(settings, tenant_id, 3, 1000)) == 3
    ok(env, "tenant", "update", "acme", "--storage", "2000")
    shown = show(env, "acme")
    assert shown["quota"]["storage_bytes"] == 2000
    assert shown["usage"]["RESULTS"]["messages"] == 3
    assert shown["usage"]["storage_used_bytes"] > 2000
    assert asyncio.run(_publish_results(settings, tenant_id, 1, 1000)) == 0
    ok(env, "tenant", "update", "acme", "--storage", "1MiB")
    assert asyncio.run(_publish_results(settings, tenant_id, 1, 10)) == 1

    # Suspend: the creds are refused; resume: they work again.
    assert "tenant acme suspended" in ok(env, "tenant", "suspend", "acme").stdout
    assert ["acme", "suspended"] == ok(env, "tenant", "list").stdout.splitlines()[1].split()[:2]
    assert refused(env, creds)
    assert "tenant acme resumed" in ok(env, "tenant", "resume", "acme").stdout
    assert not refused(env, creds)

    # Rotate: the old creds are refused; the new ones, written where asked and over the
    # home folder's copy, work.
    old = tmp_path / "acme-old.creds"
    old.write_bytes(creds.read_bytes())
    new = tmp_path / "acme-new.creds"
    rotated = ok(env, "tenant", "rotate-creds", "acme", "--output", str(new))
    assert f"new creds for tenant acme: {new}" in rotated.stdout
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    assert creds.read_bytes() == new.read_bytes()
    assert refused(env, old)
    assert not refused(env, new)

    # Remove: asks first; with --yes the account goes and its creds are refused.
    kept = run(env, "tenant", "remove", "acme", stdin="n\n")
    assert kept.returncode == 1 and "not removed" in kept.stderr
    assert show(env, "acme")["id"] == tenant_id
    removed = ok(env, "tenant", "remove", "acme", "--yes")
    assert f"tenant acme removed ({tenant_id})" in removed.stdout
    assert "acme" not in ok(env, "tenant", "list").stdout
    gone = run(env, "tenant", "show", "acme")
    assert gone.returncode == 1 and "unknown tenant 'acme'" in gone.stderr
    assert not creds.exists() and not keys.has_key(tenant_id)
    assert refused(env, new)


def test_tenant_errors(settings: MeshSettings, child_env: dict[str, str],
                       tmp_path: Path) -> None:
    env = child_env
    ok(env, "init")
    unknown = run(env, "tenant", "suspend", "nope")
    assert unknown.returncode == 1 and "unknown tenant 'nope'" in unknown.stderr
    bad = run(env, "tenant", "add", "Bad")
    assert bad.returncode == 1 and "invalid tenant name 'Bad'" in bad.stderr
    size = run(env, "tenant", "add", "x", "--storage", "lots")
    assert size.returncode == 2 and "not a size: 'lots'" in size.stderr
    streams_ = run(env, "tenant", "add", "x", "--max-streams", "1")
    assert streams_.returncode == 2 and "--max-streams" in streams_.stderr
    empty = run(env, "tenant", "add", "x", "--storage", "0")  # 0 would mean no JetStream
    assert empty.returncode == 2 and "--storage-bytes: Input should be greater" in empty.stderr
    assert "x " not in run(env, "tenant", "list").stdout  # nothing half made
    nothing = run(env, "tenant", "update", "default")
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr
    no_operator = run({**env, "CRAWLMESH_HOME": str(tmp_path / "empty")}, "tenant", "list")
    assert no_operator.returncode == 1 and "run `crawlmesh init`" in no_operator.stderr
    missing = run(env, "status", "--creds", str(tmp_path / "none.creds"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    garbage = tmp_path / "garbage.creds"
    garbage.write_text("hello\n")
    for creds in (garbage, tmp_path):
        wrong = run(env, "submit", "--creds", str(creds), "http://127.0.0.1:9/")
        assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
        assert "is not a NATS user creds file" in wrong.stderr or "cannot read" in wrong.stderr
    mesh = run(env, "submit", "--creds", str(KeyStore(settings.home).mesh_creds),
               "http://127.0.0.1:9/")
    assert mesh.returncode == 1 and "not a tenant's creds" in mesh.stderr, mesh.stderr
    tenant_creds = str(KeyStore(settings.home).tenant_creds("default"))
    seeds = [f"http://127.0.0.1:9/{'x' * 1100}/{n}" for n in range(1000)]
    big = run(env, "submit", "--creds", tenant_creds, *seeds)
    assert big.returncode == 1 and "over the server's limit of 1,048,576 bytes" in big.stderr, \
        big.stderr
