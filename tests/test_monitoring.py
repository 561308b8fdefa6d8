"""The Grafana dashboard and the Prometheus alerts in deploy/k8s/components/monitoring.

Nothing here needs a Prometheus or a Grafana: every metric a panel or an alert queries must be one
the services export (a renamed metric would leave an empty panel or an alert that never fires), the
files must have the shapes Grafana and prometheus-operator read, and, where promtool is installed
(Debian's `prometheus` package), the rules must load and each alert must fire on series made for it
and stay quiet on healthy ones (`promtool test rules`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import prometheus_client
import pytest
import yaml

from tests.test_deploy import K8S, K8S_VERSION, needs_kubectl, render

MONITORING = K8S / "components" / "monitoring"
DASHBOARD = MONITORING / "specdec-dashboard.json"
RULES = MONITORING / "prometheus-rules.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")

# What the alerts must cover (the list), by alert name.
REQUIRED_ALERTS = {"SpecdecHighErrorRate", "SpecdecHighTimeToFirstToken", "SpecdecQueueBackingUp", "SpecdecAcceptanceCollapsed",
                   "SpecdecBackendUnavailable", "SpecdecServiceDown", "SpecdecKVCacheNearlyFull"}
# Suffixes Prometheus' exposition adds to a family's name, by the family's type.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def exported_series() -> set[str]:
    """Every series name the three services can expose: family names with their type's suffixes."""
    from specdec.serving import metrics

    metrics.coordinator(), metrics.target(), metrics.draft()
    names = set()
    for family in prometheus_client.REGISTRY.collect():
        if family.name.startswith("specdec:"):
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def metric_names(expr: str) -> set[str]:
    """The specdec metric names an expression queries (specdec's names all start `specdec:`)."""
    return set(re.findall(r"specdec:[a-zA-Z0-9_:]+", expr))


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs(board: dict) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


def rules() -> list[dict]:
    manifest = yaml.safe_load(RULES.read_text())
    return [rule for group in manifest["spec"]["groups"] for rule in group["rules"]]


def unknown_metrics(exprs: list[str], exported: set[str]) -> list[str]:
    return sorted({name for expr in exprs for name in metric_names(expr)} - exported)


def test_every_metric_the_dashboard_and_alerts_query_is_exported():
    exported = exported_series()
    board_exprs, rule_exprs = dashboard_exprs(dashboard()), [rule["expr"] for rule in rules()]
    assert unknown_metrics(board_exprs, exported) == []
    assert unknown_metrics(rule_exprs, exported) == []
    # The check is not vacuous: each file queries many metrics, and a misspelt one is caught.
    assert len({n for e in board_exprs for n in metric_names(e)}) >= 15
    assert unknown_metrics(["rate(specdec:request_sucess_total[5m])", "specdec:target_num_sequences_total"], exported) == [
        "specdec:request_sucess_total", "specdec:target_num_sequences_total"]


def test_dashboard_is_a_grafana_dashboard_over_a_chosen_prometheus():
    board = dashboard()
    panels = board["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "model_name"}
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["description"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            if "histogram_quantile" in expr:  # a quantile over summed buckets must keep `le`
                assert "_bucket" in expr and re.search(r"by \(le\b", expr), expr
            if any(name.startswith(("specdec:request", "specdec:spec_decode", "specdec:num_requests", "specdec:time_to",
                                    "specdec:e2e", "specdec:inter_token", "specdec:generation", "specdec:prompt"))
                   for name in metric_names(expr)):
                assert 'model_name=~"$model_name"' in expr, expr  # the coordinator's metrics follow the Model picker
    titles = " ".join(panel["title"] for panel in panels).lower()
    for topic in ("finish reason", "failed", "end-to-end", "first token", "inter-token", "waiting", "acceptance",
                  "tokens / s", "kv cache", "queue, prefill, decode"):
        assert topic in titles, topic


def test_alert_rules_cover_the_failure_modes_and_say_what_to_do():
    manifest = yaml.safe_load(RULES.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    alerts = {rule["alert"]: rule for rule in rules()}
    assert set(alerts) >= REQUIRED_ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name  # a blip does not page anyone


@needs_kubectl
def test_the_component_adds_the_rules_and_the_dashboard_configmap():
    import kubernetes_validate

    from tests.test_deploy import TARGETS

    TARGETS.setdefault("monitoring", ("overlays/cpu", ("components/monitoring",)))  # rendered here only: kubernetes-validate knows no PrometheusRule
    docs = render("monitoring")
    rule = [d for d in docs if d["kind"] == "PrometheusRule"]
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "specdec-dashboard"]
    assert len(rule) == 1 and rule[0]["spec"] == yaml.safe_load(RULES.read_text())["spec"]
    assert len(maps) == 1 and maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["specdec-dashboard.json"]) == dashboard()
    kubernetes_validate.validate(maps[0], K8S_VERSION, strict=True)
    # The default renders stay as they were: monitoring is opt-in.
    assert not [d for d in render("cpu") if d["kind"] == "PrometheusRule" or d["metadata"]["name"] == "specdec-dashboard"]


def plain_rules_file(tmp_path, annotations: bool = True):
    """The PrometheusRule's spec as the rules file a plain Prometheus (and promtool) reads."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    if not annotations:  # promtool's unit tests compare rendered annotations too; the firing test checks expressions
        for group in spec["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    path = tmp_path / "specdec-rules.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


@needs_promtool
def test_promtool_loads_the_rules(tmp_path):
    result = subprocess.run([PROMTOOL, "check", "rules", str(plain_rules_file(tmp_path))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def firing_tests(rules_file: str) -> dict:
    """promtool unit tests: each alert fires on series made for it, and none fires on a healthy model."""
    bad, good = {"model_name": "bad"}, {"model_name": "good"}

    def series(name: str, values: str, **labels) -> dict:
        return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "values": values}

    target_pod = {"app_kubernetes_io_name": "specdec", "app_kubernetes_io_component": "target", "pod": "target-0", "job": "kubernetes-pods"}
    inputs = [
        # "bad": 10% of requests fail, all UNAVAILABLE; TTFT between 2.5 and 5 s; 3 queued throughout;
        # 10% of 2 draft tokens/s accepted. "good": no failure, TTFT under 0.5 s, no queue, 70% accepted.
        series("specdec:request_success_total", "0+54x40", finished_reason="length", **bad),
        series("specdec:request_failure_total", "0+6x40", code="UNAVAILABLE", **bad),
        series("specdec:request_success_total", "0+60x40", finished_reason="length", **good),
        series("specdec:request_failure_total", "0+0x40", code="UNAVAILABLE", **good),
        series("specdec:request_failure_total", "0+30x40", code="INVALID_ARGUMENT", **good),  # the clients' fault: no alert
        *[series("specdec:time_to_first_token_seconds_bucket", values, le=le, **bad)
          for le, values in (("0.5", "0+0x40"), ("2.5", "0+0x40"), ("5.0", "0+10x40"), ("+Inf", "0+10x40"))],
        *[series("specdec:time_to_first_token_seconds_bucket", "0+10x40", le=le, **good) for le in ("0.5", "2.5", "5.0", "+Inf")],
        series("specdec:num_requests_waiting", "3x40", **bad),
        series("specdec:num_requests_waiting", "0x40", **good),
        series("specdec:spec_decode_num_draft_tokens_total", "0+120x40", **bad),
        series("specdec:spec_decode_num_accepted_tokens_total", "0+12x40", **bad),
        series("specdec:spec_decode_num_draft_tokens_total", "0+120x40", **good),
        series("specdec:spec_decode_num_accepted_tokens_total", "0+84x40", **good),
        series("up", "0x40", **target_pod),
        series("up", "1x40", **{**target_pod, "app_kubernetes_io_component": "draft", "pod": "draft-0"}),
        series("specdec:target_kv_cache_usage_perc", "0.95x40", pod="target-0"),
        series("specdec:draft_kv_cache_usage_perc", "0.25x40", pod="draft-0"),
    ]
    severity = {rule["alert"]: rule["labels"]["severity"] for rule in rules()}

    def fired(alert: str, *label_sets: dict) -> dict:
        return {"eval_time": "30m", "alertname": alert,
                "exp_alerts": [{"exp_labels": {"severity": severity[alert], **labels}} for labels in label_sets]}

    return {
        "rule_files": [rules_file],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": inputs,
            "alert_rule_test": [
                fired("SpecdecHighErrorRate", bad),
                fired("SpecdecHighTimeToFirstToken", bad),
                fired("SpecdecQueueBackingUp", bad),
                fired("SpecdecAcceptanceCollapsed", bad),
                fired("SpecdecBackendUnavailable", bad),
                fired("SpecdecServiceDown", target_pod),
                fired("SpecdecKVCacheNearlyFull", {"pod": "target-0"}),
                # Before their `for` has passed, nothing fires.
                {"eval_time": "1m", "alertname": "SpecdecQueueBackingUp", "exp_alerts": []},
                {"eval_time": "1m", "alertname": "SpecdecServiceDown", "exp_alerts": []},
            ],
        }],
    }


@needs_promtool
def test_each_alert_fires_on_its_failure_and_not_on_a_healthy_model(tmp_path):
    rules_file = plain_rules_file(tmp_path, annotations=False)
    tests = tmp_path / "tests.yml"
    tests.write_text(yaml.safe_dump(firing_tests(rules_file.name)))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # And the unit tests can fail: an alert that should fire but was not written so does.
    broken = firing_tests(rules_file.name)
    broken["tests"][0]["alert_rule_test"][0]["exp_alerts"] = []
    tests.write_text(yaml.safe_dump(broken))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode != 0 and "SpecdecHighErrorRate" in result.stdout + result.stderr
