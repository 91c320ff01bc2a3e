"""The web console in a real browser: Playwright's Python API driving Debian's chromium (its own
browser download is not reachable here, so the system executable is named). A mixed burst moves
the queue numbers on the page, which match Router.Stats within one refresh; Low's KV bar never
shows more than its cap; finished requests appear in the recent list; the page logs no error.
With auth on, the page asks for a key: the admin key sees the cluster, a tenant's only itself.

Screenshots are taken during the burst (desktop and phone width) into $QOS_CONSOLE_SHOTS (the
README's are made so: QOS_CONSOLE_SHOTS=docs), else into the test's temporary folder."""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
from services.local.cluster import LocalCluster
from services.store.store import Store, Tenant
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run

pytestmark = pytest.mark.slow
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.txt)")
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)", allow_module_level=True)

DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}
ADMIN = "console-admin-key"


@pytest.fixture
def browser():
    # Per test, and asked for after the clusters: Playwright's sync API runs an event loop in this
    # thread while it is open, and the launcher's readiness check runs its own.
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_console(browser, cluster, viewport=DESKTOP, key: str | None = ADMIN):
    """The page, with `key` already entered (kept in the tab's session storage, as the page does)."""
    page = browser.new_page(viewport=viewport)
    if key:
        page.add_init_script(f"sessionStorage.setItem('qos-console-key', {key!r})")
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    router = cluster.config.router
    page.goto(f"http://{router.host}:{router.http_port}/console")
    return page, errors


async def mixed_burst(cluster, per_class: int = 10, max_tokens: int = 200) -> list[str]:
    """30 requests on 4 running slots: several seconds of queues for the page's 1 s refresh to
    follow (40 tokens each lasted ~3 refreshes while sampling was slow, and one once it was not)."""
    async def one(stub, priority, i):
        request = chat_request(f"Tell me story number {i}.", sampling_params(max_tokens=max_tokens, ignore_eos=True))
        request_id = ""
        async for chunk in stub.Generate(request, metadata=[("x-priority", priority)]):
            request_id = chunk.request_id or request_id
        return request_id
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await asyncio.gather(*(one(stub, p, i) for i in range(per_class) for p in ("low", "medium", "high")))


class StatsSampler(threading.Thread):
    """Router.Stats every 50 ms: (time, waiting per class summed over pools)."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.samples, self.stop = address, [], threading.Event()

    def run(self):
        with grpc.insecure_channel(self.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while not self.stop.wait(0.05):
                stats = stub.Stats(router_pb2.StatsRequest(), timeout=5)
                waiting = {1: 0, 2: 0, 3: 0}
                for pool in stats.pools:
                    for c in pool.classes:
                        waiting[c.priority] += c.waiting
                self.samples.append((time.time(), (waiting[1], waiting[2], waiting[3])))


@pytest.fixture(scope="module")
def cluster():
    config = cluster_config(max_running=4, model=bench_model())
    config.auth.admin_key = ADMIN          # auth off, yet the cluster view needs the admin key
    with LocalCluster(config, quiet=True) as running:
        yield running


@pytest.fixture
def auth_cluster(tmp_path):
    url = f"sqlite:///{tmp_path}/store.db"
    store = Store(url)
    store.add_tenant(Tenant("acme"))
    acme_key = store.create_key("acme")[0]
    store.close()
    config = cluster_config(model=bench_model())
    config.store.url, config.auth.required, config.auth.admin_key = url, True, ADMIN
    with LocalCluster(config, quiet=True) as running:
        running.acme_key = acme_key
        yield running


def read_page(page) -> dict:
    return page.evaluate("""() => ({
        t: Number(document.body.dataset.updated || 0),
        queues: ["high", "medium", "low"].map((p) => Number(document.getElementById(`queue-${p}`)?.textContent ?? -1)),
        lowBars: [...document.querySelectorAll(".kvbar")].filter((b) => b.querySelector(".fill.low"))
                   .map((b) => [Number(b.dataset.kvShare), Number(b.dataset.kvCap)]),
        recent: [...document.querySelectorAll("#recent tbody tr")].map((r) => r.dataset.requestId),
    })""")


def test_the_console_follows_a_mixed_burst(cluster, browser, tmp_path):
    shots = Path(os.environ.get("QOS_CONSOLE_SHOTS") or tmp_path)
    sampler = StatsSampler(cluster.router_address)
    sampler.start()
    page, errors = open_console(browser, cluster)
    phone, phone_errors = open_console(browser, cluster, PHONE)
    page.wait_for_selector("#queue-high")
    time.sleep(1.5)
    result: dict = {}
    burst = threading.Thread(target=lambda: result.setdefault("ids", run(mixed_burst(cluster))))
    burst.start()
    seen, shot = [], False
    while burst.is_alive():
        seen.append(read_page(page))
        if not shot and sum(seen[-1]["queues"]) >= 3 and len(seen[-1]["recent"]) >= 4:   # mid-burst
            page.screenshot(path=str(shots / "console-desktop.png"))
            phone.screenshot(path=str(shots / "console-phone.png"), full_page=True)
            shot = True
        time.sleep(0.25)
    burst.join()
    time.sleep(2.5)                                          # two more refreshes after the last answer
    seen.append(read_page(page))
    sampler.stop.set()
    sampler.join()

    queues = [tuple(s["queues"]) for s in seen if s["t"]]
    assert len(set(queues)) >= 3 and max(max(q) for q in queues) > 0, queues   # the numbers moved
    assert queues[-1] == (0, 0, 0)
    for s in seen:       # each page snapshot equals Router.Stats within one refresh (1 s) of its time
        if s["t"]:
            near = {waiting for at, waiting in sampler.samples if abs(at - s["t"]) <= 1.0}
            assert tuple(s["queues"]) in near, (s, sorted(near))
        for share, cap in s["lowBars"]:
            assert share <= cap + 1e-9, s
    assert all(s["lowBars"] for s in seen if s["t"])                 # Low's bars were there to check
    assert set(result["ids"]) & set(seen[-1]["recent"])                # our requests in the recent list
    assert errors == [] and phone_errors == []
    assert shot and (shots / "console-desktop.png").stat().st_size > 10_000
    # Auth off, the cluster view is still the admin's: without the key the page asks for it.
    stranger, _ = open_console(browser, cluster, key=None)
    stranger.wait_for_selector("#login:not([hidden])")
    assert "admin key" in stranger.inner_text("#login")


def test_with_auth_on_the_admin_sees_the_cluster_and_a_tenant_only_itself(auth_cluster, browser):
    cluster = auth_cluster
    page, errors = open_console(browser, cluster, key=None)
    page.wait_for_selector("#login:not([hidden])")
    assert "API key" in page.inner_text("#login")
    page.fill("#key", "qsk_not_a_key")
    page.click("#login button")
    page.wait_for_selector("#login-why:has-text('unknown or revoked')")
    page.fill("#key", ADMIN)
    page.click("#login button")
    page.wait_for_selector("#queue-high")
    assert page.inner_text("#view") == "admin" and page.is_visible("#pools-section")

    page.click("#logout")
    page.wait_for_selector("#login:not([hidden])")
    page.fill("#key", cluster.acme_key)
    page.click("#login button")
    page.wait_for_selector("#view:has-text('tenant acme')")
    assert not page.is_visible("#pools-section") and not page.is_visible("#classes-section")
    assert page.is_visible("#tenants-section")
    # The feed itself refuses a missing key (the page is only a page).
    router = cluster.config.router
    response = page.request.get(f"http://{router.host}:{router.http_port}/console/events")
    assert response.status == 401
    # 401s the page asked for on purpose are the only errors it logged.
    assert all("401" in error for error in errors), errors
