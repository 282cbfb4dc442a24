"""The Grafana dashboard, the Prometheus config and the alert rules under ``compose/``.

Every metric they query must be one the services export (:mod:`shared.telemetry.metrics`),
with labels it has; the rules and config must pass ``promtool`` (Debian's ``prometheus``
package), and the rules' own unit tests (``alerts_test.yml``) must pass.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from shared.telemetry import metrics

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "crawlmesh.json"
DATASOURCES = COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = COMPOSE / "grafana" / "provisioning" / "dashboards" / "crawlmesh.yml"
PROMETHEUS = COMPOSE / "prometheus"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}

# Labels Prometheus adds to every scraped series (prometheus.yml: job, instance, service).
TARGET_LABELS = frozenset({"job", "instance", "service"})
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                   "summary": ("", "_sum", "_count")}


def exported_families() -> dict[str, dict[str, frozenset[str]]]:
    """``{metric: {sample name: its label names}}`` for every collector in
    shared.telemetry.metrics (a Counter ``x`` exports ``x_total``; a Histogram ``x_bucket``
    with ``le``, ``x_sum`` and ``x_count``)."""
    families: dict[str, dict[str, frozenset[str]]] = {}
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        labels = frozenset(collector._labelnames)
        for family in collector.describe():
            families[family.name] = {
                family.name + suffix: labels | ({"le"} if suffix == "_bucket" else set())
                for suffix in SAMPLE_SUFFIXES[family.type]
            }
    return families


FAMILIES = exported_families()
EXPORTED = {name: labels for samples in FAMILIES.values() for name, labels in samples.items()}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_queries() -> list[str]:
    queries = [target["expr"] for panel in panels(dashboard()) for target in panel.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        queries.append(query["query"] if isinstance(query, dict) else query or "")
    return queries


def rule_queries() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def without_strings(expr: str) -> str:
    """``expr`` with its string literals emptied (label values never name metrics)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", '""', expr)


def queried_metrics(expr: str) -> set[str]:
    return set(re.findall(r"(?<![\w:])crawlmesh_[A-Za-z0-9_:]*", without_strings(expr)))


def label_problems(expr: str) -> list[str]:
    """Matchers naming a label their metric lacks; ``by``/``on`` labels no metric has."""
    code = without_strings(expr)
    problems = []
    for name, matchers in re.findall(r"(?<![\w:])(crawlmesh_\w+)\s*\{([^}]*)\}", code):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            if label not in EXPORTED.get(name, frozenset()) | TARGET_LABELS:
                problems.append(f"{name} has no label {label!r}")
    known = TARGET_LABELS.union(*(EXPORTED.get(name, frozenset()) for name in queried_metrics(expr)))
    for grouping in re.findall(r"\b(?:by|on|ignoring|without)\s*\(([^)]*)\)", code):
        problems += [f"no queried metric has label {label!r}" for label in
                     re.findall(r"\w+", grouping) if label not in known]
    return problems


@pytest.mark.parametrize("source", ["dashboard", "alert rules"])
def test_every_queried_metric_is_one_the_services_export(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    assert queries
    unknown = {name: expr for expr in queries for name in queried_metrics(expr)
               if name not in EXPORTED}
    assert not unknown, (f"the {source} query metrics not defined in shared/telemetry/metrics.py "
                         f"(known: {sorted(EXPORTED)}): {unknown}")
    problems = {expr: label_problems(expr) for expr in queries if label_problems(expr)}
    assert not problems, problems


def test_the_dashboard_shows_every_exported_metric() -> None:
    queried = set().union(*(queried_metrics(expr) for expr in dashboard_queries()))
    missing = sorted(family for family, samples in FAMILIES.items() if not queried & samples.keys())
    assert not missing, f"exported but on no dashboard panel: {missing}"


def test_the_metric_name_check_sees_through_promql() -> None:
    expr = ('histogram_quantile(0.9, sum by (le) (rate(crawlmesh_fetch_duration_seconds_bucket'
            '{status_class="crawlmesh_x"}[5m]))) / on (tenant) crawlmesh_nope:rate5m')
    assert queried_metrics(expr) == {"crawlmesh_fetch_duration_seconds_bucket",
                                     "crawlmesh_nope:rate5m"}
    assert label_problems('crawlmesh_messages_total{outcom="ack"}') == [
        "crawlmesh_messages_total has no label 'outcom'"]
    assert label_problems("sum by (tenat) (crawlmesh_messages_total)") == [
        "no queried metric has label 'tenat'"]
    assert "crawlmesh_messages_total" in EXPORTED and "crawlmesh_messages" not in EXPORTED
    assert "crawlmesh_fetch_duration_seconds_bucket" in EXPORTED
    assert "crawlmesh_fetch_duration_seconds" not in EXPORTED


def test_the_dashboard_is_valid_and_every_panel_queries_the_provisioned_datasource() -> None:
    board = dashboard()
    assert board["uid"] == "crawlmesh" and board["title"]
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queries = [panel for panel in panels(board) if panel["type"] != "row"]
    assert len(queries) >= 12
    for panel in queries:
        assert panel.get("datasource") == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, panel["title"]
            assert target["expr"].strip() and target["refId"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
    for variable in board["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE, variable["name"]


def test_grafana_provisions_that_datasource_and_the_dashboards_folder() -> None:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert (source["uid"], source["type"]) == (DATASOURCE["uid"], DATASOURCE["type"])
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_prometheus_scrapes_every_replica_of_the_five_services() -> None:
    """DNS discovery of each compose service name (one A record per replica), on the metrics
    port, labelled with the service name; a service with no replica left is an alert."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert "static_configs" not in job
    (discovery,) = job["dns_sd_configs"]
    assert discovery["names"] == ["seeder", "dedup", "fetcher", "parser", "sink"]
    assert (discovery["type"], discovery["port"]) == ("A", 9460)
    assert {"source_labels": ["__meta_dns_name"], "target_label": "service"} in job["relabel_configs"]
    assert config["rule_files"] == ["alerts.yml"]
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    (missing,) = [rule for group in rules["groups"] for rule in group["rules"]
                  if rule["alert"] == "CrawlmeshServiceMissing"]
    assert set(re.findall(r'service="(\w+)"', missing["expr"])) == set(discovery["names"])


def test_every_alert_has_a_severity_and_says_what_and_why() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in alerts} >= {
        "CrawlmeshServiceDown", "CrawlmeshBacklogGrowing", "CrawlmeshDeadLettersHigh",
        "CrawlmeshJobStalled", "CrawlmeshTenantNearQuota"}
    for rule in alerts:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: it comes with Debian's prometheus package "
                    "(apt-get install -y --no-install-recommends prometheus)", pytrace=False)
    return subprocess.run([path, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args", [
    ("check", "rules", "alerts.yml"),
    ("check", "config", "prometheus.yml"),
    ("test", "rules", "alerts_test.yml"),
], ids=" ".join)
def test_promtool_accepts_the_config_and_rules(args: tuple[str, ...]) -> None:
    done = promtool(*args)
    assert done.returncode == 0, done.stdout + done.stderr
