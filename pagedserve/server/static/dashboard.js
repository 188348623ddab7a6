// pagedserve live engine view: reads /dashboard/stream (server-sent events over fetch, so
// that the API key can travel in the Authorization header), falls back to polling
// /dashboard/state. No external code: served by pagedserve itself.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const STATE = { NULL: -1, FREE: 0, CACHED: 1, USED: 2, SHARED: 3 };
  const COLORS = { free: "#262c38", cached: "#59657d", shared: "#ffffff", bg: "#1a1e28" };
  const HISTORY = 300;
  const dash = (window.pagedserveDashboard = { doc: null, layout: null, updates: 0, history: [] });

  // -- the key ---------------------------------------------------------------------------------
  function readKey() {
    const m = /(?:^|[#&])key=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem("pagedserve-key", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem("pagedserve-key");
  }
  let apiKey = readKey();
  const headers = () => (apiKey ? { Authorization: "Bearer " + apiKey } : {});
  function askKey(msg) {
    $("keyform").hidden = false;
    $("keyerr").textContent = msg || "";
    setConn("API key needed", "bad");
    $("key").focus();
  }
  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key").value.trim();
    sessionStorage.setItem("pagedserve-key", apiKey);
    $("keyform").hidden = true;
    connect();
  });
  function setConn(text, cls) {
    const c = $("conn");
    c.textContent = text;
    c.className = "pill " + (cls || "");
  }

  // -- transport -------------------------------------------------------------------------------
  let generation = 0;
  async function connect() {
    const gen = ++generation;
    let failures = 0;
    while (gen === generation) {
      try {
        const resp = await fetch("/dashboard/stream", { headers: headers(), cache: "no-store" });
        if (resp.status === 401 || resp.status === 403) {
          askKey(apiKey ? "that key was refused" : "");
          return;
        }
        if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
        setConn("live", "ok");
        failures = 0;
        const reader = resp.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done || gen !== generation) break;
          buf += dec.decode(value, { stream: true });
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const ev = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const data = ev.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
            if (data) update(JSON.parse(data));
          }
        }
      } catch (err) {
        failures += 1;
        setConn("reconnecting…", "bad");
        if (failures >= 3) return poll(gen);
      }
      await sleep(Math.min(500 * failures + 200, 3000));
    }
  }
  async function poll(gen) {
    // Fallback when streaming is not possible (a proxy that buffers): poll the state.
    while (gen === generation) {
      try {
        const resp = await fetch("/dashboard/state", { headers: headers(), cache: "no-store" });
        if (resp.status === 401 || resp.status === 403) return askKey(apiKey ? "that key was refused" : "");
        if (resp.ok) {
          update(await resp.json());
          setConn("live (polling)", "ok");
        }
      } catch (err) {
        setConn("server unreachable", "bad");
      }
      await sleep((dash.doc && dash.doc.interval_ms) || 500);
    }
  }
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // -- helpers ---------------------------------------------------------------------------------
  function hashHue(s) {
    let h = 2166136261;
    for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619);
    h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b); h ^= h >>> 13; h = Math.imul(h, 0xc2b2ae35); h ^= h >>> 16;
    return (h >>> 0) % 360;
  }
  const reqColor = (id) => `hsl(${hashHue(id)}, 72%, 56%)`;
  const fmt = (v, d = 1) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(d));
  const ms = (s) => (s === null || s === undefined ? "–" : (s * 1e3).toFixed(s < 0.1 ? 1 : 0));
  function sizeCanvas(cv) {
    const dpr = window.devicePixelRatio || 1;
    const w = cv.clientWidth, h = cv.clientHeight;
    if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) {
      cv.width = Math.round(w * dpr);
      cv.height = Math.round(h * dpr);
    }
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx, w, h, dpr };
  }

  // -- rendering -------------------------------------------------------------------------------
  function update(doc) {
    dash.doc = doc;
    dash.updates += 1;
    $("model").textContent = doc.model || "";
    if (!doc.ready) {
      $("step").textContent = "waiting for the engine's first snapshot…";
      renderTiles(doc);
      return;
    }
    $("step").textContent = `step ${doc.step} · snapshot ${fmt(doc.age_s * 1e3, 0)} ms old`;
    dash.history.push({
      t: doc.time,
      running: doc.queues.running,
      waiting: doc.queues.waiting,
      preempted: doc.queues.preempted,
      usage: doc.kv.usage,
    });
    if (dash.history.length > HISTORY) dash.history.shift();
    render(doc);
  }
  function render(doc) {
    renderTiles(doc);
    renderMap(doc);
    renderTimeline(doc);
    renderHistory();
    renderRequests(doc);
  }

  function tile(k, v, s) {
    return `<div class="tile"><div class="k">${k}</div><div class="v">${v}</div><div class="s">${s || ""}</div></div>`;
  }
  function renderTiles(doc) {
    if (!doc.ready) {
      $("tiles").innerHTML = tile("engine", "starting", "");
      return;
    }
    const q = doc.queues, kv = doc.kv, t = doc.throughput, lat = doc.latency || {};
    const p = (x) => (x ? `${ms(x.p50)} / ${ms(x.p90)} / ${ms(x.p99)}` : "–");
    const n = (x) => (x ? `p50 / p90 / p99 ms · n=${x.count}${x.window ? " · " + x.window : ""}` : "");
    $("tiles").innerHTML = [
      tile("running", q.running, "in the batch"),
      tile("waiting", q.waiting, "not yet admitted"),
      tile("preempted", q.preempted, `waiting to resume · ${doc.stats.num_preemptions} total`),
      tile("KV blocks used", `${kv.used} / ${kv.num_blocks}`, `${fmt(kv.usage * 100)} % of the cache`),
      tile("KV utilization", `${fmt(kv.utilization * 100)} %`, "stored tokens / allocated slots"),
      tile("shared · cached", `${kv.shared} · ${kv.cached_free}`, "ref>1 · free with a prefix"),
      tile("prefill tok/s", fmt(t.prefill_tokens_per_s, 0), `last ${t.window_s} s`),
      tile("decode tok/s", fmt(t.decode_tokens_per_s, 0), `${fmt(t.steps_per_s)} steps/s`),
      tile("step time", `${fmt(t.mean_step_ms)} ms`, `mean, last ${t.window_s} s`),
      tile("TTFT", p(lat.ttft), n(lat.ttft)),
      tile("TPOT", p(lat.tpot), n(lat.tpot)),
      tile("disk KV tier", doc.stats.kv_offload_enabled ? `${doc.stats.kv_offload_hit_blocks} hits` : "off", doc.stats.kv_offload_enabled ? `${doc.stats.kv_offload_stored_blocks} blocks stored · ${doc.stats.kv_offload_miss_blocks} misses` : "--kv-offload-dir"),
      tile("prefix cache hits", `${fmt(doc.stats.prefix_cache_queries ? (100 * doc.stats.prefix_cache_hits) / doc.stats.prefix_cache_queries : 0)} %`, `${doc.stats.prefix_cache_hits} of ${doc.stats.prefix_cache_queries} tokens`),
    ].join("");
  }

  function mapLayout(n, w, maxH) {
    for (const cell of [16, 14, 12, 10, 9, 8, 7, 6, 5, 4, 3, 2]) {
      const cols = Math.max(1, Math.floor(w / cell));
      const rows = Math.ceil(n / cols);
      if (rows * cell <= maxH || cell === 2) return { cell, cols, rows, gap: cell >= 6 ? 1 : 0 };
    }
  }
  function renderMap(doc) {
    const cv = $("map");
    const n = doc.kv.num_blocks; // cells for block ids 1..n (0 is the null block)
    const w = cv.clientWidth;
    let L = mapLayout(n, w, 480);
    cv.style.height = Math.max(L.rows * L.cell, 20) + "px";
    const { ctx, dpr } = sizeCanvas(cv);
    L = Object.assign(L, { dpr, n });
    dash.layout = L;
    ctx.fillStyle = COLORS.bg;
    ctx.fillRect(0, 0, cv.clientWidth, cv.clientHeight);
    const b = doc.blocks, reqs = doc.requests;
    // with LoRA adapters in play, a block takes its adapter's colour (the base model's: "base")
    const byAdapter = reqs.some((r) => r.adapter);
    const colors = reqs.map((r) => reqColor(byAdapter ? "adapter:" + (r.adapter || "base") : r.id));
    const restored = new Set(b.restored || []);
    const s = L.cell - L.gap;
    for (let id = 1; id <= n; id++) {
      const k = id - 1, x = (k % L.cols) * L.cell, y = Math.floor(k / L.cols) * L.cell;
      const st = b.state[id];
      if (st >= STATE.USED) ctx.fillStyle = colors[b.owner[id]] || "#ff00ff";
      else if (st === STATE.CACHED) ctx.fillStyle = COLORS.cached;
      else ctx.fillStyle = COLORS.free;
      ctx.fillRect(x, y, s, s);
      if (st === STATE.SHARED) {
        // shared: a white corner (ref count > 1)
        const c = Math.max(2, Math.ceil(s / 2));
        ctx.fillStyle = COLORS.shared;
        ctx.beginPath();
        ctx.moveTo(x, y);
        ctx.lineTo(x + c, y);
        ctx.lineTo(x, y + c);
        ctx.closePath();
        ctx.fill();
      }
      if (restored.has(id) && s >= 4) {
        // restored from the disk tier: a green dot in the lower right corner
        const d = Math.max(2, Math.floor(s / 3));
        ctx.fillStyle = "#3ddc84";
        ctx.fillRect(x + s - d, y + s - d, d, d);
      }
    }
    $("mapinfo").textContent = `· ${n} blocks of ${doc.block_size} tokens · ${doc.kv.stored_tokens} tokens stored · hover a cell`;
  }

  function blockAt(ev) {
    const L = dash.layout, doc = dash.doc;
    if (!L || !doc || !doc.ready) return null;
    const r = $("map").getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / L.cell), row = Math.floor((ev.clientY - r.top) / L.cell);
    if (col < 0 || col >= L.cols || row < 0) return null;
    const id = row * L.cols + col + 1;
    return id >= 1 && id <= L.n ? id : null;
  }
  function describe(id) {
    const doc = dash.doc, b = doc.blocks, st = b.state[id];
    const name = { "-1": "null", 0: "free", 1: "cached, free", 2: "held", 3: "shared" }[st];
    let html = `<b>block ${id}</b> · ${name}`;
    if (st >= STATE.USED) {
      const owners = (b.owners[id] || [b.owner[id]]).map((k) => doc.requests[k]);
      html += ` · ref count ${b.ref[id]}<br>${b.tokens[id]} / ${doc.block_size} tokens`;
      html += "<br>" + owners.map((r) => `<span style="color:${reqColor(r.id)}">■</span> ${escapeHtml(r.id)} (${r.state})`).join("<br>");
    } else if (st === STATE.CACHED) {
      html += `<br>holds a cached prefix (${doc.block_size} tokens); reused on a prefix hit until evicted`;
    }
    if ((b.restored || []).includes(id)) html += "<br>K/V restored from the disk KV tier";
    return html;
  }
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  $("map").addEventListener("mousemove", (ev) => {
    const id = blockAt(ev), tip = $("tip");
    if (id === null) return (tip.hidden = true);
    tip.innerHTML = describe(id);
    tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 300) + "px";
    tip.style.top = ev.clientY + 14 + "px";
  });
  $("map").addEventListener("mouseleave", () => ($("tip").hidden = true));
  dash.describe = describe;

  function renderTimeline(doc) {
    const cv = $("timeline");
    const { ctx, w, h } = sizeCanvas(cv);
    ctx.fillStyle = COLORS.bg;
    ctx.fillRect(0, 0, w, h);
    const s = doc.steps, n = s.time.length;
    if (!n) return;
    const slots = 300, bw = w / slots, top = 14, bottom = h - 12, ph = bottom - top;
    let maxTok = 1, maxT = 1e-6;
    for (let i = 0; i < n; i++) {
      maxTok = Math.max(maxTok, s.prefill_tokens[i] + s.decode_tokens[i]);
      maxT = Math.max(maxT, s.seconds[i]);
    }
    const x0 = w - n * bw;
    for (let i = 0; i < n; i++) {
      const x = x0 + i * bw, pf = s.prefill_tokens[i], dc = s.decode_tokens[i];
      const hd = (dc / maxTok) * ph, hp = (pf / maxTok) * ph;
      ctx.fillStyle = "#4aa3f0";
      ctx.fillRect(x, bottom - hd, Math.max(bw - 0.5, 1), hd);
      ctx.fillStyle = "#f0a040";
      ctx.fillRect(x, bottom - hd - hp, Math.max(bw - 0.5, 1), hp);
      const sh = s.short_tokens ? (s.short_tokens[i] / maxTok) * ph : 0;
      if (sh > 0) { // the short lane's share of the step (length_aware), a stripe on the left
        ctx.fillStyle = "#2ec4b6";
        ctx.fillRect(x, bottom - sh, Math.max((bw - 0.5) * 0.4, 1), sh);
      }
      if (s.preempted[i]) {
        ctx.fillStyle = "#ff4d4d";
        ctx.fillRect(x, 0, Math.max(bw, 2), 6);
      }
      if (s.joined[i]) {
        ctx.fillStyle = "#54d17a";
        ctx.fillRect(x, bottom + 2, Math.max(bw, 2), 4);
      }
      if (s.finished[i]) {
        ctx.fillStyle = "#b48cf0";
        ctx.fillRect(x, bottom + 7, Math.max(bw, 2), 4);
      }
    }
    ctx.strokeStyle = "#f2f2f2";
    ctx.lineWidth = 1.2;
    ctx.beginPath();
    for (let i = 0; i < n; i++) {
      const x = x0 + (i + 0.5) * bw, y = bottom - (s.seconds[i] / maxT) * ph;
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    }
    ctx.stroke();
    ctx.fillStyle = "#8a93a6";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(`max ${maxTok} tokens/step · max step ${(maxT * 1e3).toFixed(1)} ms`, 4, 11);
    const last = n - 1;
    $("stepinfo").textContent = `· last ${n} steps · now: ${s.num_reqs[last]} requests, ${s.prefill_tokens[last]} prefill + ${s.decode_tokens[last]} decode tokens, ${(s.seconds[last] * 1e3).toFixed(1)} ms`;
  }

  function renderHistory() {
    const cv = $("history");
    const { ctx, w, h } = sizeCanvas(cv);
    ctx.fillStyle = COLORS.bg;
    ctx.fillRect(0, 0, w, h);
    const H = dash.history, n = H.length;
    if (n < 2) return;
    const top = 6, ph = h - 12;
    let maxQ = 1;
    for (const e of H) maxQ = Math.max(maxQ, e.running, e.waiting, e.preempted);
    const line = (key, color, scale) => {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      H.forEach((e, i) => {
        const x = (i / (HISTORY - 1)) * w + (HISTORY - n) * (w / (HISTORY - 1));
        const y = top + ph - (e[key] / scale) * ph;
        i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
      });
      ctx.stroke();
    };
    line("usage", "#4aa3f0", 1);
    line("running", "#54d17a", maxQ);
    line("waiting", "#f0c040", maxQ);
    line("preempted", "#ff4d4d", maxQ);
    ctx.fillStyle = "#8a93a6";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(`requests: max ${maxQ}`, 4, 11);
  }

  function renderRequests(doc) {
    const rows = doc.requests.slice(0, 64).map((r) => {
      const cells = [
        `<span style="color:${reqColor(r.id)}">■</span>`,
        escapeHtml(r.id),
        r.state,
        r.prompt_tokens,
        r.output_tokens,
        r.computed_tokens,
        r.cached_tokens,
        r.num_blocks,
        r.preemptions,
        fmt(r.age_s) + " s",
        r.lane || "",
        escapeHtml(r.adapter || ""),
        r.deadline_slack_s === null || r.deadline_slack_s === undefined ? "" : fmt(r.deadline_slack_s) + " s",
      ];
      return `<tr class="${r.state}">` + cells.map((c, i) => `<td${i === 1 ? ' class="id"' : ""}>${c}</td>`).join("") + "</tr>";
    });
    $("requests").tBodies[0].innerHTML = rows.join("");
    const more = doc.requests.length - rows.length;
    $("reqinfo").textContent = `· ${doc.queues.running} running, ${doc.queues.waiting} waiting, ${doc.queues.preempted} preempted${more > 0 ? ` (first 64 shown)` : ""}`;
  }

  window.addEventListener("resize", () => dash.doc && dash.doc.ready && render(dash.doc));
  connect();
})();
