// mesh dashboard: reads GET /dashboard/events (SSE over fetch, so a bearer token can be
// sent) and draws the last frame. No dependencies. Tests read window.meshDashboard.
(function () {
  "use strict";
  var WINDOW_S = 300, MAX_SERIES = 32, MAX_FRAMES = 20;
  var TOKEN_KEY = "meshDashboardToken";
  var state = { frames: [], last: null, history: {}, connected: false };
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
    var workers = cap.workers || [];
    rows("workersTable", workers, function (w) {
      return [w.id, w.state, w.decodeTps, w.dutyCycle, w.privateCells, w.ageS];
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
    var nodes = frame.nodes;
    $("nodes").hidden = !nodes;
    if (nodes) renderNodes(nodes);
    record(frame.t, workers);
    draw(cap.floor_tps, frame.t);
  }

  function renderNodes(nodes) {
    var box = $("nodesList");
    box.textContent = "";
    nodes.forEach(function (n, i) {
      var c = n.capacity || {}, kv = c.kv_cells || {}, s = c.sessions || {};
      var p = document.createElement("p");
      p.id = "node-" + i;
      p.textContent = (n.name || n.url || "node " + i) + ": " + fmt(c.verdict) +
        " · workers " + fmt(s.total) + " · queue " + fmt(c.queue_len) +
        " · KV " + fmt(kv.used) + "/" + fmt(kv.total) + " · reduction " + fmt(kv.reduction) +
        (n.error ? " · " + n.error : "");
      box.appendChild(p);
    });
  }

  function record(t, workers) {
    workers.forEach(function (w) {
      if (w.decodeTps === null || w.decodeTps === undefined) return;
      var h = state.history[w.id] || (state.history[w.id] = []);
      h.push([t, w.decodeTps]);
    });
    Object.keys(state.history).forEach(function (id) {
      var h = state.history[id];
      while (h.length && h[0][0] < t - WINDOW_S) h.shift();
      if (!h.length) delete state.history[id];
    });
    var ids = Object.keys(state.history);
    if (ids.length > MAX_SERIES) {
      ids.sort(function (a, b) {
        var ha = state.history[a], hb = state.history[b];
        return ha[ha.length - 1][0] - hb[hb.length - 1][0];
      });
      ids.slice(0, ids.length - MAX_SERIES).forEach(function (id) { delete state.history[id]; });
    }
  }

  function color(id) {
    var h = 0;
    for (var i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return "hsl(" + (h % 360) + ",70%,60%)";
  }

  function draw(floor, now) {
    var cv = $("chart"), ctx = cv.getContext("2d");
    var W = cv.width, H = cv.height, L = 44, B = 20;
    ctx.clearRect(0, 0, W, H);
    var top = floor ? floor * 1.5 : 1;
    Object.keys(state.history).forEach(function (id) {
      state.history[id].forEach(function (p) { if (p[1] > top) top = p[1]; });
    });
    top *= 1.1;
    // The last 5 minutes, or since the page opened if that is shorter (at least 30 s).
    var first = state.frames.length ? state.frames[0].t : now;
    if (state.since === undefined) state.since = first;
    var span = Math.min(WINDOW_S, Math.max(30, now - state.since));
    function x(t) { return L + (W - L - 8) * (1 - (now - t) / span); }
    function y(v) { return (H - B) * (1 - v / top) + 2; }
    ctx.strokeStyle = "#2c3640"; ctx.fillStyle = "#8a96a3"; ctx.font = "11px sans-serif";
    for (var k = 0; k <= 4; k++) {
      var v = top * k / 4;
      ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(W, y(v)); ctx.stroke();
      ctx.fillText(v.toFixed(1), 2, y(v) + 4);
    }
    var step = span > 120 ? 60 : (span > 60 ? 20 : 10);
    for (var a = step; a <= span; a += step) {
      ctx.fillText("-" + (a >= 60 && a % 60 === 0 ? a / 60 + "m" : a + "s"), x(now - a) - 10, H - 4);
    }
    ctx.fillText("now", W - 26, H - 4);
    Object.keys(state.history).forEach(function (id) {
      var h = state.history[id];
      ctx.strokeStyle = color(id); ctx.lineWidth = 1.5; ctx.beginPath();
      h.forEach(function (p, i) { if (i) ctx.lineTo(x(p[0]), y(p[1])); else ctx.moveTo(x(p[0]), y(p[1])); });
      ctx.stroke();
      var end = h[h.length - 1];
      ctx.fillStyle = color(id);
      ctx.fillRect(x(end[0]) - 2, y(end[1]) - 2, 4, 4);
    });
    if (floor) {
      ctx.strokeStyle = "#e8574c"; ctx.lineWidth = 2; ctx.setLineDash([6, 4]);
      ctx.beginPath(); ctx.moveTo(L, y(floor)); ctx.lineTo(W, y(floor)); ctx.stroke();
      ctx.setLineDash([]);
    }
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

  function connect() {
    var token = sessionStorage.getItem(TOKEN_KEY);
    var headers = { Accept: "text/event-stream" };
    if (token) headers.Authorization = "Bearer " + token;
    status("connecting", "");
    fetch("dashboard/events", { headers: headers, cache: "no-store" }).then(function (r) {
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
            block.split("\n").forEach(function (line) {
              if (line.indexOf("event:") === 0) ev = line.slice(6).trim();
              else if (line.indexOf("data:") === 0) data.push(line.slice(5).trim());
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
