"""The live view: the engine snapshot, /dashboard/state (against its JSON schema), the key,
the SSE stream, and the page in a real headless Chromium (Debian's chromium +
chromium-driver, driven by Selenium from PyPI; `make setup` installs them)."""

import json
import os
import pathlib
import re
import shutil
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.core.snapshot import STEP_FIELDS  # noqa: E402
from pagedserve.engine.live_view import block_view, state_view  # noqa: E402
from tests.server.test_server import Server  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "dashboard-state.schema.json").read_text())
KEY = "dash-secret"
BS = 64  # big blocks: the page map changes only every 64 tokens, so it can be compared with /metrics
DASH_KW = dict(block_size=BS, num_kv_blocks=48, max_model_len=512, snapshot_interval_ms=100)
PREFIX = [(7 * i) % 200 + 3 for i in range(BS)]  # one full shared block


def validate(doc, schema, path="$"):
    """A small JSON-schema subset: type, properties, required, items, additionalProperties,
    enum, minimum."""
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        py = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
            "integer": int,
            "number": (int, float),
        }
        ok = any(isinstance(doc, py[t]) and not (t in ("integer", "number") and isinstance(doc, bool)) for t in types)
        assert ok, f"{path}: {doc!r:.80} is not {types}"
    if "enum" in schema:
        assert doc in schema["enum"], f"{path}: {doc!r} not in {schema['enum']}"
    if "minimum" in schema and isinstance(doc, (int, float)):
        assert doc >= schema["minimum"], f"{path}: {doc} < {schema['minimum']}"
    if isinstance(doc, dict):
        for k in schema.get("required", ()):
            assert k in doc, f"{path}: missing {k!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in doc.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                validate(v, extra, f"{path}.{k}")
            else:
                assert extra, f"{path}: unexpected key {k!r}"
    if isinstance(doc, list) and "items" in schema:
        for i, v in enumerate(doc[:50]):
            validate(v, schema["items"], f"{path}[{i}]")


def prompt(i: int) -> list[int]:
    return PREFIX + [300 + i, 301 + i, 302 + i]


# -- the engine side, in process (a fake executor: milliseconds) ------------------------------------
class FakeExecutor:
    dtype_name, device = "float32", "cpu"

    def __init__(self) -> None:
        from tests.fake_model import FakeRunner

        self.runner = FakeRunner(block_size=BS)

    def initialize_kv_cache(self, num_blocks, block_size) -> None:
        pass

    def compile_or_warm_up(self, *a) -> None:
        pass

    def execute_model(self, so):
        return self.runner.execute(so)

    def shutdown(self) -> None:
        pass


def test_snapshot_blocks_match_the_pool_and_schema(checkpoint):
    from pagedserve.core.engine_core import EngineCore
    from pagedserve.engine_args import EngineArgs
    from pagedserve.lora import LoRARequest
    from pagedserve.messages import EngineCoreRequest

    core = EngineCore(EngineArgs(model=checkpoint("llama"), **DASH_KW).create_engine_config(), FakeExecutor())
    sp = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    for i in range(3):
        core.add_request(EngineCoreRequest(f"r{i}", prompt(i), sp, 70))
    for _ in range(4):
        core.step()
    snap = core.snapshot()
    pool = core.scheduler.kv.pool
    view = block_view(snap)
    assert [b.ref_cnt for b in pool.blocks] == view["ref"]
    assert sum(1 for s in view["state"] if s >= 2) == pool.num_used_blocks == snap["stats"]["kv_blocks_used"]
    shared = [bid for bid, s in enumerate(view["state"]) if s == 3]
    assert len(shared) == 1 and sorted(view["owners"][shared[0]]) == [0, 1, 2]  # the common prefix
    assert view["tokens"][shared[0]] == BS
    for k, req in enumerate(snap["requests"]):  # each request's own block holds its computed tail
        assert req[4] == BS + 3 + 3 and view["tokens"][req[8][1]] == 6 and view["owner"][req[8][1]] == k
    rec = snap["steps"]
    assert len(rec) == 4 and len(rec[0]) == len(STEP_FIELDS)
    assert rec[0][4] == 3 and rec[0][1] == BS + 3 * 3 and rec[0][2] == 0  # 3 joined; 1 prefill + 2 hits
    assert rec[1][1] == 0 and rec[1][2] == 3  # then decodes
    core.scheduler.running[0].lora_request = LoRARequest("a1", 1, "/adapters/a1")  # the view names adapters
    doc = json.loads(json.dumps(state_view(core.snapshot(), {}, time.time())))
    validate(doc, SCHEMA)
    assert [r["adapter"] for r in doc["requests"]] == ["a1", None, None]
    core.scheduler.running[0].lora_request = None
    assert doc["kv"]["used"] == 4 and doc["kv"]["shared"] == 1 and doc["queues"]["running"] == 3
    core.abort_requests(["r2"])
    while core.has_unfinished_requests():
        core.step()
    doc = state_view(core.snapshot())
    assert doc["kv"]["used"] == 0 and doc["kv"]["cached_free"] >= 1  # the prefix stays cached
    fin = doc["steps"]["finished"]
    assert sum(fin) == 3 and fin[4] == 1 and fin[-1] == 2  # the abort shows in the next step


# -- the server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dash_server(checkpoint):
    # each step takes at least 10 ms, so the map holds still for 64 steps (0.64 s) between
    # changes on any machine: on a fast one a step took well under the 100 ms snapshot
    # interval, and the page never caught a steady map to compare with /metrics
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_TEST_SLOW_ENGINE", "0:0.01")
        s = Server(checkpoint("llama"), engine_kw=DASH_KW, api_key=KEY)
    yield s
    s.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_state_requires_the_key_page_does_not(dash_server):
    url = dash_server.url
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    srcs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert srcs and all(s.startswith("/dashboard/static/") for s in srcs)  # nothing from elsewhere
    for s in srcs:
        assert httpx.get(url + s).status_code == 200
    assert httpx.get(url + "/dashboard/static/api_server.py").status_code == 404
    for path in ("/dashboard/state", "/dashboard/stream"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(url + "/dashboard/state", headers=AUTH)
    assert r.status_code == 200 and r.json()["version"] == 1


def test_state_schema_and_stream(dash_server):
    url = dash_server.url
    deadline = time.time() + 10
    while not (doc := httpx.get(url + "/dashboard/state", headers=AUTH).json())["ready"]:
        assert time.time() < deadline, "no snapshot published while idle"
        time.sleep(0.05)
    validate(doc, SCHEMA)
    assert doc["model"] == "tiny" and doc["interval_ms"] == 100
    assert doc["kv"]["num_blocks"] == DASH_KW["num_kv_blocks"] - 1
    with httpx.stream("GET", url + "/dashboard/stream", headers=AUTH, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        validate(json.loads(first[6:]), SCHEMA)


def _find_browser():
    try:
        from selenium import webdriver  # noqa: F401
    except ImportError:
        return None, "selenium is not installed (pip install -e '.[dev]')"
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chrome or not driver:
        return None, "Chromium not found: apt-get install -y chromium chromium-driver (make setup does, as root)"
    return (chrome, driver), None


# Counts the page map's cells by their pixels (no help from the page): a cell is coloured
# when its centre is saturated (free and cached cells are greys), shared when its top-left
# corner is white.
COUNT_CELLS_JS = """
const L = window.pagedserveDashboard.layout, cv = document.getElementById('map');
const px = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height);
const at = (x, y) => { const i = (Math.floor(y * L.dpr) * cv.width + Math.floor(x * L.dpr)) * 4;
  return [px.data[i], px.data[i + 1], px.data[i + 2]]; };
let coloured = 0; const shared = [];
for (let id = 1; id <= L.n; id++) {
  const x = ((id - 1) % L.cols) * L.cell, y = Math.floor((id - 1) / L.cols) * L.cell, s = L.cell - L.gap;
  const c = at(x + s * 0.75, y + s * 0.75);
  if (Math.max(...c) - Math.min(...c) > 60) coloured++;
  const k = at(x + 1, y + 1);
  if (Math.min(...k) > 235) shared.push(id);
}
return {coloured, shared, step: window.pagedserveDashboard.doc.step,
        used: window.pagedserveDashboard.doc.stats.kv_blocks_used, updates: window.pagedserveDashboard.updates};
"""


def test_page_in_headless_chromium(dash_server, tmp_path):
    found, why = _find_browser()
    if found is None:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from tests.server.test_server import metric

    chrome, driver_path = found
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    url = dash_server.url
    stop = threading.Event()
    errors: list = []

    done_loading = threading.Event()

    def load():  # long generations sharing a one-block prefix, in rounds until the test has seen them
        try:
            with httpx.Client(timeout=120) as c:
                body = {"model": "tiny", "prompt": None, "max_tokens": 440, "temperature": 0, "ignore_eos": True}
                while not stop.is_set():  # a round takes about 4.4 s (440 steps of 10 ms)
                    threads = []
                    for i in range(3):
                        b = dict(body, prompt=prompt(i))
                        t = threading.Thread(target=lambda b=b: c.post(url + "/v1/completions", json=b, headers=AUTH))
                        t.start()
                        threads.append(t)
                    for t in threads:
                        t.join()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done_loading.set()

    try:
        driver.get(url + "/dashboard")  # no key: the page asks for it
        deadline = time.time() + 15
        while not driver.find_element(By.ID, "keyform").is_displayed():
            assert time.time() < deadline, "the page did not ask for the key"
            time.sleep(0.05)
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#keyform button").click()
        while not driver.execute_script("return (window.pagedserveDashboard.doc || {}).ready === true"):
            assert time.time() < deadline, "the page shows no state"
            time.sleep(0.05)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        # compare with /metrics while the map is steady (it changes every 64 tokens)
        matched = None
        deadline = time.time() + 40
        while matched is None and time.time() < deadline:
            before = metric(url, "pagedserve:kv_blocks_used", AUTH)
            seen = driver.execute_script(COUNT_CELLS_JS)
            after = metric(url, "pagedserve:kv_blocks_used", AUTH)
            if before and before == after == seen["coloured"] == seen["used"] and seen["shared"]:
                matched = seen
                break
            time.sleep(0.05)
        assert matched is not None, f"page cells never matched /metrics: last {seen}, metrics {before}/{after}"
        assert len(matched["shared"]) == 1  # the common prompt block, shown as shared
        # hovering the shared cell names its requests and ref count (retried: on a fast
        # machine a round of requests may end, and the next one start, between two reads)
        L = driver.execute_script("return window.pagedserveDashboard.layout")
        cv = driver.find_element(By.ID, "map")
        tip, sid, deadline = "", None, time.time() + 30
        while time.time() < deadline:
            doc = driver.execute_script("return window.pagedserveDashboard.doc")
            refs, states = doc["blocks"]["ref"], doc["blocks"]["state"]
            shared = [i for i in range(len(refs)) if refs[i] == 3 and states[i] == 3]
            if shared:
                sid = shared[0]
                x = ((sid - 1) % L["cols"]) * L["cell"] + L["cell"] // 2 - cv.size["width"] // 2
                y = ((sid - 1) // L["cols"]) * L["cell"] + L["cell"] // 2 - cv.size["height"] // 2
                ActionChains(driver).move_to_element_with_offset(cv, x, y).perform()
                tip = driver.find_element(By.ID, "tip").text
                if (
                    f"block {sid}" in tip
                    and "ref count 3" in tip
                    and f"{BS} / {BS} tokens" in tip
                    and (tip.count("cmpl-") == 3 or tip.count("running") == 3)
                ):
                    break
            time.sleep(0.1)
        assert sid is not None and f"block {sid}" in tip and "ref count 3" in tip, tip
        assert f"{BS} / {BS} tokens" in tip and (tip.count("cmpl-") == 3 or tip.count("running") == 3), tip
        time.sleep(0.3)  # let the timeline fill a little
        out = tmp_path / "dashboard.png"
        driver.save_screenshot(str(out))
        assert out.stat().st_size > 10_000
        if os.environ.get("PAGEDSERVE_UPDATE_SCREENSHOT"):
            shutil.copy(out, ROOT / "docs" / "dashboard.png")
        assert not errors, errors
    finally:
        stop.set()  # the load ends after its current round (the server's teardown ends it too)
        driver.quit()


def test_grafana_dashboard_uses_only_exported_metrics():
    from pagedserve.messages import EngineStats
    from pagedserve.server.metrics import ServerMetrics

    m = ServerMetrics(lambda: EngineStats(*([0] * 16)), "m", lambda: (0, 1))
    m.rejected("overloaded")
    exported = set(re.findall(r"^(pagedserve:[a-z_]+)", m.render().decode(), re.M))
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "pagedserve.json").read_text())
    used = {name for p in dash["panels"] for t in p["targets"] for name in re.findall(r"pagedserve:[a-z_]+", t["expr"])}
    assert used and used <= exported, used - exported
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
