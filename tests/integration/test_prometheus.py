"""Prometheus configuration, alert rules and the Grafana dashboard against a real Prometheus.

``promtool`` checks the committed config and rules and runs the rules' unit tests
(deploy/prometheus/rnnserve.rules.test.yml). The end-to-end test starts Debian's ``prometheus``
on a free loopback port with deploy/prometheus/prometheus.yml (targets rewritten to loopback,
1 s scrapes), a real ``rnnserve`` under a few dozen requests (good, bad and a burst that fills
its queue), and a stand-in DCGM exporter; then it runs every dashboard panel expression and
every rule through Prometheus's HTTP API: each must parse and return data. ``prometheus`` and
``promtool`` come from ``scripts/install.sh --test``; these tests fail, not skip, without them.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.server import Server, free_port, start_server, stop

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "rnnserve.rules.yml"
RULES_TEST = PROM_DIR / "rnnserve.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rnnserve.json"
TOKEN = "prometheus-test-token"

# What Grafana substitutes before it sends a panel's query: the whole time range's rate window
# (1 s scrapes here) and "All" for the multi-value variables.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$job": "rnnserve",
    "$instance": ".*",
    "$dcgm_job": "dcgm",
}
# A stand-in for NVIDIA's DCGM exporter: its metric names and labels for one GPU (no GPU here).
FAKE_DCGM = (
    b"# TYPE DCGM_FI_DEV_FB_USED gauge\n"
    b'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100",'
    b'Hostname="gpu-host"} 1234\n'
    b"# TYPE DCGM_FI_DEV_FB_FREE gauge\n"
    b'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100",'
    b'Hostname="gpu-host"} 80000\n'
    b"# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
    b'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100",'
    b'Hostname="gpu-host"} 42\n'
)


def tool(name: str) -> str:
    """``prometheus`` or ``promtool``: installed by ``scripts/install.sh --test`` (Debian's
    ``prometheus`` package). Missing is a failure, not a skip."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else "")
    if not found:
        pytest.fail(f"{name} not found: run scripts/install.sh --test (apt-get install prometheus)")
    return found


def promtool(*args: str, cwd: Path = PROM_DIR) -> str:
    proc = subprocess.run(
        [tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


# -- promtool ---------------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    out = promtool("check", "rules", RULES.name)
    assert "SUCCESS" in out
    assert promtool("check", "rules", "--lint=all", "--lint-fatal", RULES.name)


def test_the_overload_rule_counts_every_503_of_the_error_catalogue() -> None:
    """The overload alert's reasons are the catalogue's 503 types, no more, no fewer: a 503
    type added to the service without it would shed load unnoticed."""
    from rnnserve.service.http import errors

    (rule,) = [r for r in rules() if r.get("record") == "rnnserve:overload_rejections:ratio_rate5m"]
    (listed,) = re.findall(r'reason=~"([a-z_|]+)"', rule["expr"])
    assert set(listed.split("|")) == set(errors.types_of(503))
    (failing,) = [r for r in rules() if r.get("record") == "rnnserve:request_errors:ratio_rate5m"]
    assert 'code!~"503|504"' in failing["expr"]  # shed load and passed deadlines are no fault


def with_token_file(config: dict[str, Any], token_file: Path) -> dict[str, Any]:
    """The config with every job's ``authorization.credentials_file`` at ``token_file``: the
    committed path is a compose secret, present only inside the container."""
    for job in config["scrape_configs"]:
        if "credentials_file" in job.get("authorization", {}):
            job["authorization"]["credentials_file"] = str(token_file)
    return config


def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    config = yaml.safe_load(PROM_CONFIG.read_text())
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    token_file = tmp_path / "token"
    token_file.write_text("a-token")
    (tmp_path / PROM_CONFIG.name).write_text(yaml.safe_dump(with_token_file(config, token_file)))
    assert "SUCCESS" in promtool("check", "config", PROM_CONFIG.name, cwd=tmp_path)


def test_alert_rules_fire_on_made_up_series() -> None:
    """Every alert has a unit test in which it fires, and each test passes."""
    assert "SUCCESS" in promtool("test", "rules", RULES_TEST.name)
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert tested == {r["alert"] for r in rules() if "alert" in r}


# -- the pieces of the end-to-end check -------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of the committed dashboard."""
    data = yaml.safe_load(DASHBOARD.read_text())  # JSON is YAML
    out = []
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def grafana_expand(expr: str) -> str:
    for name in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARS[name])
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


COMPARISON = re.compile(
    r"^(?P<lhs>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>[0-9.e+-]+)\s*$", re.S
)


def split_alert(expr: str) -> tuple[str, str, float]:
    """``lhs > 0.5`` -> (lhs, ">", 0.5): every alert here compares one signal to a threshold."""
    match = COMPARISON.match(expr.strip())
    assert match, f"alert expression is not '<signal> <op> <threshold>': {expr}"
    return match["lhs"], match["op"], float(match["value"])


class Prometheus:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200, f"{expr}\n-> {body}"
        assert body["status"] == "success", f"{expr}\n-> {body}"
        result = body["data"]["result"]
        assert isinstance(result, list)
        return result

    def wait_for(self, expr: str, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)


def serve_fake_dcgm() -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(FAKE_DCGM)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, int(httpd.server_address[1])


def scrape_config_for(rnnserve: str, dcgm: str, prom: str, token_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with 1 s intervals, every job's targets on loopback and
    the bearer token read from ``token_file``."""
    config: dict[str, Any] = with_token_file(yaml.safe_load(PROM_CONFIG.read_text()), token_file)
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    targets = {"rnnserve": rnnserve, "dcgm": dcgm, "prometheus": prom}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
            del job[key]
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        job["scrape_interval"] = "1s"
    return config


def start_prometheus(tmp_path: Path, config: dict[str, Any], port: int) -> Prometheus:
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return Prometheus(proc, url, log)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"prometheus did not become ready:\n{log.read_text()}")


async def load(url: str, token: str, rounds: int = 12) -> dict[int, int]:
    """Real requests: good ones to both endpoints, bad ones (4xx), then a burst that overflows
    a queue of 2 (503 queue_full). Returns how many of each status code."""
    steps = [[[0.1 * (i % 7)] * 6 for i in range(n)] for n in (3, 17, 40)]
    smooth = {"sequences": [[[0.5] * 16] * n for n in (1, 5, 12)]}
    codes: dict[int, int] = {}
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:

        async def post(path: str, body: Any) -> None:
            r = await client.post(path, json=body)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

        for _ in range(rounds):
            await post("/smooth", smooth)
            await post("/rollout", {"inputs": steps})
        for _ in range(max(1, rounds // 3)):
            await post("/smooth", {"sequences": [[[0.5] * 15]]})  # 422 wrong_feature_count
            await post("/rollout", {"inputs": []})  # 422 empty
        await post("/smooth", {"sequences": [[[0.5] * 16]], "model": "nope"})  # 404
        burst = [post("/rollout", {"inputs": steps}) for _ in range(24)]
        burst += [post("/smooth", smooth) for _ in range(24)]
        await asyncio.gather(*burst)
    return codes


# -- the end-to-end check ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, Server]]:
    tmp = tmp_path_factory.mktemp("prometheus")
    # authentication on, as every deployment runs it: Prometheus must scrape with the token
    token_file = tmp / "api-token"
    token_file.write_text(TOKEN)
    server = start_server(
        tmp,
        "--max-queue-size",
        "2",
        "--max-delay-ms",
        "20",
        env={"RNNSERVE_API_TOKEN_FILE": str(token_file)},
    )
    httpd, dcgm_port = serve_fake_dcgm()
    prom_port = free_port()
    rnnserve_target = server.url.removeprefix("http://")
    config = scrape_config_for(
        rnnserve_target, f"127.0.0.1:{dcgm_port}", f"127.0.0.1:{prom_port}", token_file
    )
    prom = None
    try:
        prom = start_prometheus(tmp, config, prom_port)
        assert prom.wait_for('up{job="rnnserve"} == 1'), prom.log.read_text()
        # A labelled counter appears at its first increment, and rate() sees no increase in a
        # series' first sample: one round first, scraped, so the main load's rejections count.
        asyncio.run(load(server.url, TOKEN, rounds=1))
        time.sleep(2.5)
        codes = asyncio.run(load(server.url, TOKEN))
        assert codes.get(200, 0) >= 24, codes
        assert codes.get(422) == 8, codes
        assert codes.get(404) == 1, codes
        assert codes.get(503, 0) >= 1, f"the burst did not fill the queue: {codes}"
        # Two more scrapes after the load, so every counter's rate sees it.
        time.sleep(2.5)
        yield prom, server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
        httpd.shutdown()
        if prom is not None:
            prom.proc.terminate()
            prom.proc.wait(timeout=30)


@pytest.mark.e2e
def test_every_dashboard_panel_returns_data(stack: tuple[Prometheus, Server]) -> None:
    prom, _ = stack
    queries = dashboard_queries()
    assert len(queries) >= 15
    empty = []
    for title, expr in queries:
        if not prom.wait_for(grafana_expand(expr), timeout=5):
            empty.append(f"{title}: {expr}")
    assert empty == [], "panels without data:\n" + "\n".join(empty)


@pytest.mark.e2e
def test_dashboard_variables_find_their_values(stack: tuple[Prometheus, Server]) -> None:
    prom, server = stack
    data = yaml.safe_load(DASHBOARD.read_text())
    wanted = {"job": "rnnserve", "instance": server.url.removeprefix("http://"), "dcgm_job": "dcgm"}
    for var in data["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
        assert match, var["query"]
        series, label = grafana_expand(match[1]), match[2]
        r = httpx.get(f"{prom.url}/api/v1/label/{label}/values", params={"match[]": series})
        assert r.json()["status"] == "success", r.text
        assert wanted[var["name"]] in r.json()["data"], (var["name"], r.json()["data"])


@pytest.mark.e2e
def test_prometheus_loads_and_evaluates_every_rule(stack: tuple[Prometheus, Server]) -> None:
    prom, _ = stack
    expected = rules()
    deadline = time.monotonic() + 10
    while True:  # until every rule has been evaluated once
        groups = httpx.get(f"{prom.url}/api/v1/rules").json()["data"]["groups"]
        loaded = [rule for group in groups for rule in group["rules"]]
        evaluated = all(not r["lastEvaluation"].startswith("0001") for r in loaded)
        if (loaded and evaluated) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(loaded) == len(expected)
    bad = [(r["name"], r["health"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    assert bad == []
    for rule in expected:
        if "record" in rule:
            assert prom.wait_for(rule["record"], timeout=10), f"{rule['record']} recorded nothing"


# Alerts whose whole expression the load makes true (the burst overflows a queue of 2: far more
# than 1% of the requests get 503 queue_full).
ALERTS_THAT_FIRE_HERE = {"RnnserveOverloadRejections"}


@pytest.mark.e2e
def test_every_alert_expression_parses_and_has_a_signal(stack: tuple[Prometheus, Server]) -> None:
    """Each alert's full expression runs; its signal (the side compared with the threshold)
    returns data. Those the load makes true return data as a whole. A 500 (a model failing)
    and a p99 above 500 ms cannot be produced honestly here: their firing is covered by
    promtool's unit tests (test_alert_rules_fire_on_made_up_series)."""
    prom, _ = stack
    for rule in (r for r in rules() if "alert" in r):
        expr = rule["expr"]
        full = prom.query(expr)  # parses and evaluates
        lhs, _, _ = split_alert(expr)
        assert prom.wait_for(lhs, timeout=10), f"{rule['alert']}: no data for {lhs}"
        if rule["alert"] in ALERTS_THAT_FIRE_HERE:
            assert prom.wait_for(expr, timeout=10), rule["alert"]
        elif rule["alert"] == "RnnserveTargetDown":
            assert full == [], "rnnserve is up"


@pytest.mark.e2e
def test_target_down_alert_fires_when_rnnserve_stops(stack: tuple[Prometheus, Server]) -> None:
    """Run last (module order): stops rnnserve and waits for its `up == 0`."""
    prom, server = stack
    (rule,) = [r for r in rules() if r.get("alert") == "RnnserveTargetDown"]
    stop(server)
    result = prom.wait_for(rule["expr"], timeout=15)
    assert [r["metric"]["instance"] for r in result] == [server.url.removeprefix("http://")]
