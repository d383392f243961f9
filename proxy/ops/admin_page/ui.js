// The admin port's live page: polls /status, keeps the last minutes of samples in this tab,
// draws them as inline SVG. No build step, no external assets, no innerHTML (vendor names
// and whatever /status carries reach the DOM only as text).
"use strict";

(() => {
  const params = new URLSearchParams(location.search);
  const EVERY_S = clamp(Number(params.get("every")) || 2, 0.25, 60);
  const KEEP_MS = 10 * 60 * 1000;
  const TOKEN_KEY = "quota-proxy.admin-token";
  const HISTORY_KEY = "quota-proxy.history";
  const SVG = "http://www.w3.org/2000/svg";

  let history = loadHistory(); // vendor name -> [{t, rate, tokens, held, deferred, v429, inflight}]
  let renders = 0;
  let timer = 0;
  let lastOk = 0;

  const $ = (id) => document.getElementById(id);

  function clamp(x, lo, hi) {
    return Math.min(hi, Math.max(lo, x));
  }

  function num(x) {
    return typeof x === "number" && Number.isFinite(x) ? x : null;
  }

  // What a number looks like on the page (tests/test_admin_page.py mirrors this rule).
  function fmt(x) {
    if (num(x) === null) return "—";
    if (Number.isInteger(x)) return String(x);
    const a = Math.abs(x);
    const digits = a >= 100 ? 0 : a >= 10 ? 1 : 2;
    return String(Number(x.toFixed(digits)));
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c !== null && c !== undefined) node.append(c);
    }
    return node;
  }

  // A number the test (and a curious person) can read back exactly: the raw value in data-value.
  function field(name, value, suffix) {
    const span = el("span", { "data-field": name, "data-value": num(value) === null ? "" : String(value) }, fmt(value));
    return suffix ? el("span", {}, span, suffix) : span;
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (e) {
      return "";
    }
  }

  function loadHistory() {
    try {
      const kept = JSON.parse(sessionStorage.getItem(HISTORY_KEY) || "{}");
      return kept && typeof kept === "object" ? kept : {};
    } catch (e) {
      return {};
    }
  }

  function saveHistory() {
    try {
      sessionStorage.setItem(HISTORY_KEY, JSON.stringify(history));
    } catch (e) {
      // full or disabled: the graphs just start afresh on reload
    }
  }

  function schedule(seconds) {
    clearTimeout(timer);
    timer = setTimeout(poll, seconds * 1000);
  }

  async function poll() {
    clearTimeout(timer);
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    const abort = new AbortController();
    const give_up = setTimeout(() => abort.abort(), Math.max(5000, EVERY_S * 2000));
    let answer;
    try {
      answer = await fetch("status", { headers, cache: "no-store", credentials: "omit", signal: abort.signal });
    } catch (e) {
      clearTimeout(give_up);
      stale("no answer from the proxy");
      return schedule(EVERY_S);
    }
    clearTimeout(give_up);
    if (answer.status === 401) {
      askToken(t ? "That token was refused." : "");
      return rendered("token");
    }
    let body = null;
    try {
      body = await answer.json();
    } catch (e) {
      body = null;
    }
    if (!answer.ok || !body || !Array.isArray(body.vendors)) {
      const why = body && typeof body.message === "string" ? body.message : "";
      stale(`/status answered ${answer.status}${why ? ": " + why : ""}`);
      return schedule(EVERY_S);
    }
    show(body, Date.now());
    schedule(EVERY_S);
  }

  function rendered(state) {
    renders += 1;
    document.documentElement.dataset.state = state;
    document.documentElement.dataset.renders = String(renders);
    document.dispatchEvent(new Event("qp-render"));
  }

  function stale(why) {
    const ago = lastOk ? `; last update ${Math.round((Date.now() - lastOk) / 1000)} s ago` : "";
    $("state").textContent = `stale: ${why}${ago}`;
    $("problem").textContent = why;
    $("problem").hidden = false;
    document.body.classList.add("stale");
    rendered("stale");
  }

  function askToken(problem) {
    clearTimeout(timer);
    $("token-problem").textContent = problem;
    $("token-form").hidden = false;
    $("state").textContent = "needs the admin token";
    document.body.classList.add("stale");
    $("token").focus();
  }

  function record(vendor, now) {
    const r = vendor.recent || {};
    const c = vendor.concurrency || {};
    const sample = {
      t: now,
      rate: num(r.forwarded_per_second),
      tokens: num(vendor.tokens_available),
      held: num(vendor.held_now),
      deferred: num(r.deferred_per_second),
      v429: num(r.vendor_429_last_minute),
      inflight: num(c.inflight),
    };
    const kept = (history[vendor.name] || []).filter((s) => s && now - s.t <= KEEP_MS && s.t <= now);
    kept.push(sample);
    history[vendor.name] = kept;
  }

  function show(status, now) {
    lastOk = now;
    const names = new Set(status.vendors.map((v) => v.name));
    for (const name of Object.keys(history)) if (!names.has(name)) delete history[name];
    status.vendors.forEach((v) => record(v, now));
    saveHistory();

    $("token-form").hidden = true;
    $("problem").hidden = true;
    $("forget").hidden = !token();
    document.body.classList.remove("stale");
    $("version").textContent = status.version || "";
    $("state").textContent = "live";
    const store = status.store || {};
    $("store").textContent = store.url || "—";
    $("store-breaker").textContent = store.breaker || "—";
    const conns = status.connections;
    $("connections").textContent = "";
    if (conns && typeof conns === "object") {
      $("connections").append(field("connections_open", conns.open), conns.max !== undefined ? " of " : "");
      if (conns.max !== undefined) $("connections").append(field("connections_max", conns.max));
    } else {
      $("connections").textContent = "—";
    }
    $("updated").textContent = new Date(now).toLocaleTimeString();

    const cards = status.vendors.map((v) => card(v, now));
    $("vendors").replaceChildren(...cards);
    rendered("live");
  }

  function card(v, now) {
    const r = v.recent || {};
    const c = v.concurrency && typeof v.concurrency === "object" ? v.concurrency : null;
    const series = history[v.name] || [];
    const quota = num(v.sizing && v.sizing.configured_rate_per_second);
    const tightest = tightestBucket(v.buckets);

    const head = el("h2", {}, el("span", { class: "name" }, v.name));
    const breaker = v.breaker || "closed";
    head.append(" ", el("span", { class: `badge ${breaker === "closed" ? "ok" : "bad"}`, "data-field": "breaker" }, breaker));
    if (num(v.blocked_for_seconds)) {
      head.append(" ", el("span", { class: "badge bad" }, "blocked ", field("blocked", v.blocked_for_seconds), " s"));
    }
    if (v.store_error) head.append(" ", el("span", { class: "badge bad" }, "store unavailable"));

    const tiles = [
      tile("rate", "forwarded /s", field("rate", r.forwarded_per_second), quota === null ? null : el("span", {}, "of ", field("quota", quota), " /s quota"), spark(series, "rate", now, quota), gauge(r.forwarded_per_second, quota)),
      tile("tokens", "tokens", field("tokens", v.tokens_available), tightest ? el("span", {}, "of ", field("burst", tightest.burst), " burst") : null, spark(series, "tokens", now, tightest ? tightest.burst : null)),
      tile("held", "held now", field("held", v.held_now), el("span", {}, field("held_rate", r.held_per_second), " /s held"), spark(series, "held", now, null)),
      tile("deferred", "deferred /s", field("deferred", r.deferred_per_second), el("span", {}, field("deferred_minute", r.deferred_last_minute), " last min · ", field("shed", r.shed_per_second), " shed /s"), spark(series, "deferred", now, null)),
      tile("vendor_429", "vendor 429s, last min", field("vendor_429", r.vendor_429_last_minute), null, spark(series, "v429", now, null)),
      inflightTile(v, c, series, now),
    ];
    const article = el("article", { class: "vendor", "data-vendor": v.name }, head, el("div", { class: "tiles" }, ...tiles));
    const where = [v.route ? `route ${v.route}` : null, (v.hosts || []).join(", ") || null, v.on_limit ? `on limit: ${v.on_limit.action}` : null]
      .filter(Boolean)
      .join(" · ");
    if (where) article.append(el("p", { class: "where" }, where));
    if (Array.isArray(v.buckets) && v.buckets.length) article.append(bucketTable(v.buckets));
    if (v.endpoints !== undefined && v.endpoints !== null) article.append(generic("Endpoints", v.endpoints, "endpoints"));
    if (v.learned !== undefined && v.learned !== null) article.append(generic("Learned from the vendor", v.learned, "learned"));
    return article;
  }

  function inflightTile(v, c, series, now) {
    if (c) {
      const cap = num(c.cap);
      const sub = el("span", {}, cap === null ? "no cap" : el("span", {}, "of ", field("inflight_cap", cap), " cap"));
      if (c.held_for_slot !== undefined) sub.append(" · ", field("held_for_slot", c.held_for_slot), " waiting");
      return tile("inflight", "in flight", field("inflight", c.inflight), sub, spark(series, "inflight", now, cap), gauge(c.inflight, cap));
    }
    if (v.tunnels) {
      return tile("inflight", "tunnels open", field("tunnels", v.tunnels.open), el("span", {}, "of ", field("tunnels_max", v.tunnels.max)), null);
    }
    return tile("inflight", "in flight", field("inflight", null), el("span", {}, "no concurrency cap"), null);
  }

  function tightestBucket(buckets) {
    if (!Array.isArray(buckets) || !buckets.length) return null;
    return buckets.reduce((a, b) => ((num(b.tokens) ?? Infinity) < (num(a.tokens) ?? Infinity) ? b : a));
  }

  function tile(metric, label, value, sub, graph, bar) {
    return el("section", { class: "tile", "data-metric": metric }, el("h3", {}, label), el("p", { class: "value" }, value), sub ? el("p", { class: "sub" }, sub) : null, bar || null, graph || null);
  }

  // A bar of value against its limit (rate against quota, in flight against the cap).
  function gauge(value, limit) {
    const x = num(value);
    const lim = num(limit);
    if (x === null || !lim) return null;
    const meter = el("meter", { min: "0", max: String(lim), high: String(lim * 0.9), value: String(Math.min(x, lim)) });
    meter.title = `${fmt((100 * x) / lim)} % of ${fmt(lim)}`;
    return meter;
  }

  // The series over the kept window: x is time (gaps stay gaps), y from min(0, lowest) to
  // the highest value or the reference line (quota, burst, cap), drawn dashed.
  function spark(series, key, now, reference) {
    const W = 120;
    const H = 30;
    const points = series.filter((s) => num(s[key]) !== null);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("class", "spark");
    svg.setAttribute("role", "img");
    const values = points.map((s) => s[key]);
    const ref = num(reference);
    const hi = Math.max(...values, ref ?? 0, 1e-9);
    const lo = Math.min(0, ...values);
    const y = (v) => (H - 1 - ((v - lo) / (hi - lo || 1)) * (H - 2)).toFixed(2);
    // The time axis spans what this tab has seen (at least a minute, at most KEEP_MS), so a
    // page opened a moment ago still draws across its width.
    const span = clamp(now - (series.length ? series[0].t : now), 60 * 1000, KEEP_MS);
    const x = (t) => ((W * (t - (now - span))) / span).toFixed(2);
    const title = document.createElementNS(SVG, "title");
    const minutes = fmt(span / 60000);
    title.textContent = points.length ? `last ${minutes} min: max ${fmt(Math.max(...values))}, now ${fmt(values[values.length - 1])}` : "no samples yet";
    svg.append(title);
    if (ref !== null) {
      const line = document.createElementNS(SVG, "line");
      for (const [k, v] of [["x1", 0], ["x2", W], ["y1", y(ref)], ["y2", y(ref)]]) line.setAttribute(k, v);
      line.setAttribute("class", "ref");
      svg.append(line);
    }
    if (points.length) {
      const coords = points.map((s) => `${x(s.t)},${y(s[key])}`);
      if (points.length === 1) coords.unshift(`${(Number(x(points[0].t)) - 1).toFixed(2)},${y(values[0])}`);
      const area = document.createElementNS(SVG, "polygon");
      const base = y(Math.max(lo, 0));
      const first = coords[0].split(",")[0];
      const last = coords[coords.length - 1].split(",")[0];
      area.setAttribute("points", [`${first},${base}`, ...coords, `${last},${base}`].join(" "));
      area.setAttribute("class", "area");
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", coords.join(" "));
      line.setAttribute("class", "line");
      svg.append(area, line);
    }
    return svg;
  }

  function bucketTable(buckets) {
    const rows = buckets.map((b) =>
      el("tr", {}, el("td", {}, String(b.bucket ?? "")), el("td", {}, field("bucket_tokens", b.tokens)), el("td", {}, fmt(num(b.burst))), el("td", {}, fmt(num(b.rate_per_second)))),
    );
    const head = el("tr", {}, el("th", {}, "bucket"), el("th", {}, "tokens"), el("th", {}, "burst"), el("th", {}, "rate /s"));
    return el("div", { class: "scroll" }, el("table", { class: "buckets" }, el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  // Fields other parts of /status may carry (endpoints, learned limits): their scalars as
  // "key value" pairs, nested objects one level down ("concurrency.inflight"), whatever the shape.
  function generic(title, value, kind) {
    const items = Array.isArray(value) ? value : [value];
    const box = el("div", { class: "generic", "data-kind": kind }, el("h4", {}, title));
    for (const item of items) {
      if (item === null || typeof item !== "object") {
        box.append(el("p", {}, fmt(num(item)) !== "—" ? fmt(item) : String(item)));
        continue;
      }
      const pairs = flatten(item);
      const name = typeof item.name === "string" ? item.name : null;
      const dl = el("dl", name ? { "data-name": name } : {});
      if (name) dl.append(el("div", { class: "title" }, el("dt", {}, name)));
      for (const [k, v] of pairs) {
        if (k === "name") continue;
        dl.append(el("div", {}, el("dt", {}, k), el("dd", { "data-key": k }, typeof v === "number" ? fmt(v) : String(v))));
      }
      box.append(dl);
    }
    return box;
  }

  function flatten(obj) {
    const out = [];
    for (const [k, v] of Object.entries(obj)) {
      if (v === null || v === undefined) continue;
      if (Array.isArray(v)) {
        if (v.every((x) => x === null || typeof x !== "object")) out.push([k, v.join(", ")]);
        continue;
      }
      if (typeof v === "object") {
        for (const [k2, v2] of Object.entries(v)) {
          if (v2 !== null && typeof v2 !== "object") out.push([`${k}.${k2}`, v2]);
        }
        continue;
      }
      out.push([k, v]);
    }
    return out;
  }

  function start() {
    $("every").textContent = fmt(EVERY_S);
    $("minutes").textContent = String(KEEP_MS / 60000);
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      try {
        sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      } catch (err) {
        // no sessionStorage: nothing to keep it in
      }
      $("token").value = "";
      poll();
    });
    $("forget").addEventListener("click", () => {
      try {
        sessionStorage.removeItem(TOKEN_KEY);
      } catch (err) {
        // nothing kept
      }
      poll();
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && $("token-form").hidden) poll();
    });
    poll();
  }

  start();
})();
