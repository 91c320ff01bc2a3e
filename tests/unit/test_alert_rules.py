"""The Prometheus alerting rules: deploy/prometheus/alerts.yml is what `qos-serve alerts --rules`
makes from the default config; Prometheus' own `promtool` accepts them and, fed series like the
router's, fires them when the built-in evaluation would (and not otherwise)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import ClusterConfig, SlaConfig
from services.control.alert_rules import rules_yaml

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package "
                                    "`prometheus`; .ci/run installs it)")


def test_the_shipped_rules_are_the_default_configs():
    assert SHIPPED.read_text() == rules_yaml(ClusterConfig()), \
        "deploy/prometheus/alerts.yml is stale: run `qos-serve alerts --rules > deploy/prometheus/alerts.yml`"


@needs_promtool
def test_promtool_accepts_the_rules(tmp_path):
    config = ClusterConfig(sla=[SlaConfig(priority="high", ttft_p99_ms=200, success_rate=0.999),
                                SlaConfig(priority="low", tenant="acme", e2e_p99_ms=30000, tpot_p99_ms=100)])
    path = tmp_path / "rules.yml"
    path.write_text(rules_yaml(config))
    for file in (SHIPPED, path):
        result = subprocess.run([PROMTOOL, "check", "rules", str(file)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def _series(per_scrape: dict[str, int], labels: str, scrapes: int = 40) -> list[dict]:
    """A histogram's counter series, scraped every 15 s: `per_scrape` more requests each time in
    each bucket (made cumulative here)."""
    out, total = [], 0
    for le, count in per_scrape.items():
        total += count
        out.append({"series": f'qos_ttft_seconds_bucket{{{labels},le="{le}"}}', "values": f"0+{total}x{scrapes}"})
    out.append({"series": f"qos_ttft_seconds_count{{{labels}}}", "values": f"0+{total}x{scrapes}"})
    return out


@needs_promtool
def test_promtool_fires_the_ttft_rule_only_on_a_breach(tmp_path):
    (tmp_path / "rules.yml").write_text(SHIPPED.read_text())
    slow = _series({"0.1": 0, "0.2": 0, "0.3": 15, "+Inf": 0}, 'priority="high",pool="gpu"')
    fast = _series({"0.1": 15, "0.2": 0, "0.3": 0, "+Inf": 0}, 'priority="high",pool="gpu"')
    # The scheduler's series of the same name (no pool label) must not count.
    scheduler = _series({"0.1": 0, "0.2": 0, "0.3": 150, "+Inf": 0}, 'priority="high"')
    alert = {"exp_labels": {"severity": "page", "priority": "high", "tenant": "*", "objective": "ttft_p99_ms"},
             "exp_annotations": {"summary": "High TTFT P99 breaks its SLA (<= 200 ms over 60s)",
                                 "observed": "299", "objective": "200"}}
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [
        {"interval": "15s", "input_series": slow,
         "alert_rule_test": [{"eval_time": "30s", "alertname": "QosSlaBreached", "exp_alerts": []},  # pending: < for
                             {"eval_time": "5m", "alertname": "QosSlaBreached", "exp_alerts": [alert]}]},
        {"interval": "15s", "input_series": fast + scheduler,
         "alert_rule_test": [{"eval_time": "5m", "alertname": "QosSlaBreached", "exp_alerts": []}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
