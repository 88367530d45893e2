// mesh dashboard: at load reads GET /dashboard/history (the server's last 5 minutes of
// samples) and draws it, then reads GET /dashboard/events (SSE over fetch, so a bearer
// token can be sent) and draws each frame. No dependencies. Tests read window.meshDashboard.
(function () {
  "use strict";
  var WINDOW_S = 300, MAX_SERIES = 32, MAX_FRAMES = 20, MAX_SAMPLES = 2000;
  var TOKEN_KEY = "meshDashboardToken";
  // samples: the server's history then one per live frame, oldest first (see sampleOf).
  // historyLoaded: samples the last history read gave; drawnBeforeLive: points each chart
  // drew from history alone, before the first live frame (the browser test reads both).
  var state = { frames: [], last: null, samples: [], connected: false,
                historyLoaded: null, drawnBeforeLive: { tps: 0, load: 0 }, drawn: null };
  window.meshDashboard = state;

  function $(id) { return document.getElementById(id); }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(2);
    return String(v);
  }
  function put(id, v) {
    var el = $(id);
    if (!el) return;
    el.textContent = fmt(v);
    el.dataset.v = JSON.stringify(v === undefined ? null : v);
  }
  function status(text, cls) {
    var el = $("status");
    el.textContent = text;
    el.className = "pill " + (cls || "");
  }
  function rows(tbody, items, cells) {
    var el = $(tbody);
    el.textContent = "";
    items.forEach(function (item) {
      var tr = document.createElement("tr");
      cells(item).forEach(function (c) {
        var td = document.createElement("td");
        td.textContent = fmt(c);
        tr.appendChild(td);
      });
      el.appendChild(tr);
    });
  }

  function render(frame) {
    var cap = frame.capacity || {};
    put("policy", cap.policy);
    put("floor", cap.floor_tps);
    // --floor-tps auto: the floor shown is the per-row rate at the knee the gate chose.
    put("floorMode", cap.floor_mode === "auto" ? " (auto: the knee it measured)" : "");
    var v = $("verdict");
    put("verdict", cap.verdict);
    v.className = cap.verdict || "";
    var ul = $("reasons");
    ul.textContent = "";
    (cap.reasons || []).forEach(function (r) {
      var li = document.createElement("li");
      li.textContent = r;
      ul.appendChild(li);
    });
    put("projNext", cap.projected_tps_next);
    put("projNow", cap.projected_tps_now);
    put("headroom", cap.headroom);
    put("admitted", cap.admitted_total);
    put("refused", cap.refused_total);
    put("refused429", cap.refused_total);
    var s = cap.sessions || {};
    put("wPrefilling", s.prefilling);
    put("wDecoding", s.decoding);
    put("wIdle", s.idle);
    put("wTotal", s.total);
    put("queueLen", cap.queue_len);
    put("maxQueue", cap.max_queue);
    // Turns waiting for a decode slot: only where /capacity reports them.
    var waiting = cap.turns && typeof cap.turns === "object" ? cap.turns.waiting : undefined;
    $("turnsRow").hidden = $("turnsWaiting").hidden = waiting === undefined;
    put("turnsWaiting", waiting);
    var kv = cap.kv_cells || {};
    var total = kv.total || 0, prefix = kv.prefix || 0, used = kv.used || 0;
    var priv = Math.max(used - prefix, 0), free = Math.max(total - used, 0);
    put("kvPrefix", prefix);
    put("kvPrivate", priv);
    put("kvFree", free);
    put("kvTotal", total);
    put("kvNaive", kv.naive_equivalent);
    put("kvReduction", kv.reduction);
    function pct(n) { return total ? (100 * n / total) + "%" : "0%"; }
    $("kvBarPrefix").style.width = pct(prefix);
    $("kvBarPrivate").style.width = pct(priv);
    $("kvBarFree").style.width = pct(free);
    renderParking(cap, s, kv);
    var workers = cap.workers || [];
    rows("workersTable", workers, function (w) {
      // A held turn shows its place in the decode gate's line: "waiting (#2)".
      var state = w.turnPlace ? w.state + " (#" + w.turnPlace + ")" : w.state;
      return [w.id, state, w.decodeTps, w.dutyCycle, w.privateCells, w.ageS];
    });
    var t = frame.tasks;
    if (t) {
      put("tasksRunning", t.running);
      put("tasksQueued", t.queued);
      put("tasksFinished", t.finishedTotal);
      rows("tasksTable", (t.live || []).concat(t.recent || []).slice(0, 30), function (r) {
        return [r.id, r.state, r.ageS];
      });
    }
    keep([sampleOf(frame)]);
    drawAll();
  }

  // Parking (issue 28): attached = resident + parked; the host RAM swapped suffixes take
  // against --park-memory (shown where /capacity reports parking.park_memory).
  function renderParking(cap, sessions, kv) {
    var p = cap.parking && typeof cap.parking === "object" ? cap.parking : {};
    put("pAttached", sessions.total);
    put("pMaxAttached", p.max_attached);
    put("pResident", p.resident);
    put("pParked", p.parked);
    put("pResidentCells", kv.used);
    put("pParkedCells", p.parked_tokens);
    put("pParks", p.parks);
    put("pResumes", p.resumes);
    put("pSwaps", p.swaps);
    var bytes = num(p.parked_bytes), limit = num(p.park_memory);
    put("pBytes", bytes === null ? null : Math.round(bytes / 1e4) / 100);
    put("pMemory", limit === null ? null : Math.round(limit / 1e4) / 100);
    $("pMemUsed").style.width = limit ? Math.min(100, 100 * (bytes || 0) / limit) + "%" : "0%";
  }

  function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }

  // A live frame as a history sample: the same shape the server keeps
  // (mesh/api/dashboard.py, sample_of).
  function sampleOf(frame) {
    var cap = frame.capacity || {}, kv = cap.kv_cells || {};
    var turns = cap.turns && typeof cap.turns === "object" ? cap.turns : {};
    var park = cap.parking && typeof cap.parking === "object" ? cap.parking : {};
    var workers = [];
    (cap.workers || []).forEach(function (w) {
      if (num(w.decodeTps) !== null) workers.push([String(w.id), w.decodeTps]);
    });
    return { t: frame.t, floor: num(cap.floor_tps), verdict: cap.verdict || null,
             admitted: num(cap.admitted_total), refused: num(cap.refused_total),
             queue: num(cap.queue_len), maxQueue: num(cap.max_queue),
             waiting: num(turns.waiting),
             cells: { used: num(kv.used), prefix: num(kv.prefix), total: num(kv.total) },
             parking: { attached: num((cap.sessions || {}).total), resident: num(park.resident),
                        parked: num(park.parked), parkedCells: num(park.parked_tokens),
                        parkedBytes: num(park.parked_bytes) },
             workers: workers };
  }

  // Add samples (oldest first), keep the last WINDOW_S seconds and at most MAX_SAMPLES.
  function keep(samples) {
    var all = state.samples;
    samples.forEach(function (s) {
      if (typeof s.t !== "number") return;
      if (all.length && s.t <= all[all.length - 1].t) return;  // time only moves forward
      all.push(s);
    });
    if (!all.length) return;
    var now = all[all.length - 1].t;
    while (all.length && (all[0].t < now - WINDOW_S || all.length > MAX_SAMPLES)) all.shift();
  }

  // Per-worker series [[t, tok/s], ...] from the samples, at most MAX_SERIES (the most
  // recently seen kept).
  function series() {
    var out = {}, seen = {};
    state.samples.forEach(function (s) {
      (s.workers || []).forEach(function (w) {
        (out[w[0]] || (out[w[0]] = [])).push([s.t, w[1]]);
        seen[w[0]] = s.t;
      });
    });
    var ids = Object.keys(out);
    if (ids.length > MAX_SERIES) {
      ids.sort(function (a, b) { return seen[a] - seen[b]; });
      ids.slice(0, ids.length - MAX_SERIES).forEach(function (id) { delete out[id]; });
    }
    return out;
  }

  function color(id) {
    var h = 0;
    for (var i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return "hsl(" + (h % 360) + ",70%,60%)";
  }

  // The time axis both charts share: the last 5 minutes, or since the first sample if that
  // is shorter (at least 30 s).
  function axis(cv, top) {
    var all = state.samples, ctx = cv.getContext("2d");
    var W = cv.width, H = cv.height, L = 44, B = 20;
    var now = all[all.length - 1].t;
    var span = Math.min(WINDOW_S, Math.max(30, now - all[0].t));
    var a = {
      ctx: ctx, W: W, H: H, L: L, now: now,
      x: function (t) { return L + (W - L - 8) * (1 - (now - t) / span); },
      y: function (v) { return (H - B) * (1 - v / top) + 2; }
    };
    ctx.clearRect(0, 0, W, H);
    ctx.strokeStyle = "#2c3640"; ctx.fillStyle = "#8a96a3"; ctx.font = "11px sans-serif";
    ctx.lineWidth = 1; ctx.setLineDash([]);
    for (var k = 0; k <= 4; k++) {
      var v = top * k / 4;
      ctx.beginPath(); ctx.moveTo(L, a.y(v)); ctx.lineTo(W, a.y(v)); ctx.stroke();
      ctx.fillText(v.toFixed(1), 2, a.y(v) + (k === 4 ? 11 : 4));  // the top label inside
    }
    var step = span > 120 ? 60 : (span > 60 ? 20 : 10);
    for (var d = step; d <= span; d += step) {
      ctx.fillText("-" + (d >= 60 && d % 60 === 0 ? d / 60 + "m" : d + "s"), a.x(now - d) - 10, H - 4);
    }
    ctx.fillText("now", W - 26, H - 4);
    return a;
  }

  // One line through points [[t, v], ...]; returns how many points it drew.
  function line(a, pts, style, width, dash) {
    if (!pts.length) return 0;
    var ctx = a.ctx;
    ctx.strokeStyle = style; ctx.lineWidth = width; ctx.setLineDash(dash || []);
    ctx.beginPath();
    pts.forEach(function (p, i) {
      if (i) ctx.lineTo(a.x(p[0]), a.y(p[1])); else ctx.moveTo(a.x(p[0]), a.y(p[1]));
    });
    ctx.stroke();
    ctx.setLineDash([]);
    return pts.length;
  }

  function drawAll() {
    if (!state.samples.length) return;
    var drawn = { tps: drawTps(), load: drawLoad(), park: drawPark() };
    if (!state.frames.length) state.drawnBeforeLive = drawn;
    state.drawn = drawn;
  }

  // Tokens/s per worker, and the floor (dashed) as it was at each sample.
  function drawTps() {
    var cv = $("chart"), by = series(), floor = [], top = 1;
    state.samples.forEach(function (s) {
      if (s.floor !== null) { floor.push([s.t, s.floor]); top = Math.max(top, s.floor * 1.5); }
    });
    Object.keys(by).forEach(function (id) {
      by[id].forEach(function (p) { if (p[1] > top) top = p[1]; });
    });
    var a = axis(cv, top * 1.1), n = 0;
    Object.keys(by).forEach(function (id) {
      var h = by[id];
      n += line(a, h, color(id), 1.5);
      var end = h[h.length - 1];
      a.ctx.fillStyle = color(id);
      a.ctx.fillRect(a.x(end[0]) - 2, a.y(end[1]) - 2, 4, 4);
    });
    line(a, floor, "#e8574c", 2, [6, 4]);
    return n;
  }

  // KV cells used and the queue, each as a % of its maximum; the gate's verdict as a
  // strip along the top (green admit, yellow queue, red refuse).
  function drawLoad() {
    var cv = $("loadChart"), kv = [], queue = [], waiting = [], n = 0;
    var a = axis(cv, 100);
    state.samples.forEach(function (s) {
      var c = s.cells || {};
      if (c.total) kv.push([s.t, 100 * (c.used || 0) / c.total]);
      if (s.maxQueue) queue.push([s.t, 100 * (s.queue || 0) / s.maxQueue]);
      if (s.waiting !== null && s.waiting !== undefined && s.maxQueue) {
        waiting.push([s.t, Math.min(100, 100 * s.waiting / s.maxQueue)]);
      }
    });
    n += line(a, kv, "#4c9be8", 1.5);
    n += line(a, queue, "#e8c84c", 1.5);
    n += line(a, waiting, "#c77dff", 1.5, [3, 3]);
    var colors = { admit: "#5fd07a", queue: "#e8c84c", refuse: "#e8574c" };
    state.samples.forEach(function (s, i) {
      var next = state.samples[i + 1], c = colors[s.verdict];
      if (!c) return;
      a.ctx.fillStyle = c;
      var x0 = a.x(s.t), x1 = next ? a.x(next.t) : x0 + 2;
      a.ctx.fillRect(x0, 0, Math.max(1, x1 - x0), 4);
    });
    $("legendWaiting").hidden = !waiting.length;
    return n;
  }

  // Sessions over time: resident, parked and attached (every session), as counts.
  function drawPark() {
    var cv = $("parkChart"), res = [], parked = [], att = [], top = 1, n = 0;
    state.samples.forEach(function (s) {
      var p = s.parking || {};
      if (p.resident !== null && p.resident !== undefined) res.push([s.t, p.resident]);
      if (p.parked !== null && p.parked !== undefined) parked.push([s.t, p.parked]);
      if (p.attached !== null && p.attached !== undefined) att.push([s.t, p.attached]);
      top = Math.max(top, p.attached || 0, (p.resident || 0) + (p.parked || 0));
    });
    var a = axis(cv, Math.ceil(top * 1.1 / 4) * 4);  // whole sessions on every grid line
    n += line(a, att, "#8a96a3", 3);
    n += line(a, res, "#4c9be8", 1.5);
    n += line(a, parked, "#e8a14c", 1.5);
    return n;
  }

  function onFrame(data) {
    var frame = JSON.parse(data);
    state.last = frame;
    state.frames.push(frame);
    if (state.frames.length > MAX_FRAMES) state.frames.shift();
    render(frame);
  }

  function askToken() {
    var form = $("auth");
    form.hidden = false;
    status("token needed", "error");
    form.onsubmit = function (ev) {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("tokenInput").value.trim());
      form.hidden = true;
      connect();
    };
  }

  function later(ms) { setTimeout(connect, ms); }

  function headers(accept) {
    var token = sessionStorage.getItem(TOKEN_KEY);
    var h = { Accept: accept };
    if (token) h.Authorization = "Bearer " + token;
    return h;
  }

  // The server's history first (drawn before any live frame), then the live stream. A
  // history that cannot be read is not fatal: the stream still draws from now on.
  function connect() {
    status("connecting", "");
    fetch("dashboard/history", { headers: headers("application/json"), cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) return "auth";
        if (!r.ok) return null;
        return r.json().then(function (doc) {
          var samples = (doc && doc.samples) || [];
          state.historyLoaded = samples.length;
          // History the page already holds stays; older history fills in before it.
          var mine = state.samples;
          state.samples = [];
          keep(samples.filter(function (s) { return !mine.length || s.t < mine[0].t; }));
          keep(mine);
          drawAll();
          return null;
        });
      })
      .catch(function () { return null; })
      .then(function (outcome) {
        if (outcome === "auth") { sessionStorage.removeItem(TOKEN_KEY); askToken(); return; }
        stream();
      });
  }

  function stream() {
    fetch("dashboard/events", { headers: headers("text/event-stream"), cache: "no-store" }).then(function (r) {
      if (r.status === 401) { sessionStorage.removeItem(TOKEN_KEY); askToken(); return; }
      if (r.status === 429) {
        var s = parseFloat(r.headers.get("Retry-After") || "2");
        status("busy, retry in " + s + " s", "error");
        later(s * 1000);
        return;
      }
      if (!r.ok || !r.body) { status("HTTP " + r.status, "error"); later(2000); return; }
      status("live", "live");
      var reader = r.body.getReader(), dec = new TextDecoder(), buf = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) { status("reconnecting", ""); later(500); return; }
          buf += dec.decode(chunk.value, { stream: true });
          var cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            var block = buf.slice(0, cut); buf = buf.slice(cut + 2);
            var ev = "message", data = [];
            block.split("\n").forEach(function (ln) {
              if (ln.indexOf("event:") === 0) ev = ln.slice(6).trim();
              else if (ln.indexOf("data:") === 0) data.push(ln.slice(5).trim());
            });
            if (ev === "message" && data.length) onFrame(data.join("\n"));
          }
          return pump();
        });
      }
      return pump();
    }).catch(function () { status("disconnected", "error"); later(2000); });
  }

  connect();
})();
