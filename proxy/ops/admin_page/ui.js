// The admin port's live page: polls /status and /status/history, draws them as inline SVG.
// The graphs are the proxy's own record of the last five minutes (/status/history), so a
// page opened now shows them at once. No build step, no external assets, no innerHTML
// (vendor names and whatever /status carries reach the DOM only as text).
"use strict";

(() => {
  const params = new URLSearchParams(location.search);
  const EVERY_S = clamp(Number(params.get("every")) || 2, 0.25, 60);
  const BIN_S = 5; // the requests graph: 5-second averages of the proxy's per-second counts
  const TOKEN_KEY = "quota-proxy.admin-token";
  const SVG = "http://www.w3.org/2000/svg";

  const BREAKER = {
    closed: ["normal", "every request asks the store"],
    "half-open": ["probing", "the store failed; one request tries it again, the rest are handled as when open"],
    open: [
      "store failing",
      "the store failed repeatedly: it is not asked until the cool-off ends, and on_failure decides (closed: defer, open: forward unlimited, local: this replica's share)",
    ],
  };
  const REASONS = {
    tenant: ["tenant limit", "the tenant's own limits (tenant_limits), or no free tenant.max_active seat"],
    global: ["vendor quota", "the vendor's global buckets are empty"],
    endpoint: ["endpoint limit", "the endpoint class's own limits"],
    concurrency: ["concurrency cap", "as many requests in flight as the cap allows (concurrency, max_tunnels)"],
    vendor_block: ["vendor block", "the vendor answered 429: every replica waits out its Retry-After"],
    drain: ["drain", "the vendor said its quota is nearly spent (low_watermark): buckets emptied, refilling"],
    store_unavailable: ["store unavailable", "the store cannot be reached and on_failure is closed"],
  };
  const SERIES = ["forwarded", "held", "deferred", "shed"];

  let renders = 0;
  let timer = 0;
  let lastOk = 0;
  let charts = []; // [container, spec]: drawn once the cards are in the page (their width known)

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

  function pct(fill) {
    return num(fill) === null ? "—" : `${fmt(Math.round(fill * 1000) / 10)}%`;
  }

  function duration(seconds) {
    const s = num(seconds);
    if (s === null) return "—";
    if (s < 120) return `${fmt(s)} s`;
    if (s < 7200) return `${fmt(s / 60)} min`;
    return `${fmt(s / 3600)} h`;
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

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
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

  function schedule(seconds) {
    clearTimeout(timer);
    timer = setTimeout(poll, seconds * 1000);
  }

  // A request given up after a while (a proxy that stopped answering must not hang the page).
  async function bounded(send) {
    const abort = new AbortController();
    const give_up = setTimeout(() => abort.abort(), Math.max(5000, EVERY_S * 2000));
    try {
      return await send(abort.signal);
    } finally {
      clearTimeout(give_up);
    }
  }

  async function poll() {
    clearTimeout(timer);
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    let answer;
    try {
      answer = await bounded((signal) => fetch("status", { headers, cache: "no-store", credentials: "omit", signal }));
    } catch (e) {
      stale("no answer from the proxy");
      return schedule(EVERY_S);
    }
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
    show(body, await pastMinutes(headers), Date.now());
    schedule(EVERY_S);
  }

  // The proxy's last minutes (/status/history), or null (an older proxy, or no answer): the
  // requests graph then says so, the rest of the page is drawn all the same.
  async function pastMinutes(headers) {
    try {
      const answer = await bounded((signal) => fetch("status/history", { headers, cache: "no-store", credentials: "omit", signal }));
      if (!answer.ok) return null;
      const body = await answer.json();
      return body && Array.isArray(body.vendors) ? body : null;
    } catch (e) {
      return null;
    }
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

  function show(status, past, now) {
    lastOk = now;

    $("token-form").hidden = true;
    $("problem").hidden = true;
    $("forget").hidden = !token();
    document.body.classList.remove("stale");
    $("version").textContent = status.version || "";
    $("state").textContent = "live";
    const store = status.store || {};
    $("store").textContent = store.url ? `${store.url}${store.on_failure ? ` (on failure: ${store.on_failure})` : ""}` : "—";
    $("store-breaker").replaceChildren(breakerText(store.breaker));
    const conns = status.connections;
    $("connections").textContent = "";
    if (conns && typeof conns === "object") {
      $("connections").append(field("connections_open", conns.open), conns.max !== undefined ? " of " : "");
      if (conns.max !== undefined) $("connections").append(field("connections_max", conns.max));
    } else {
      $("connections").textContent = "—";
    }
    $("updated").textContent = new Date(now).toLocaleTimeString();

    const pasts = new Map(((past && past.vendors) || []).map((p) => [p.name, p]));
    charts = [];
    const cards = status.vendors.map((v) => card(v, pasts.get(v.name) || null));
    $("vendors").replaceChildren(...cards);
    for (const [box, spec] of charts) drawChart(box, spec);
    rendered("live");
  }

  function breakerText(state) {
    const s = typeof state === "string" ? state : "closed";
    const [short, long] = BREAKER[s] || ["", ""];
    const node = el("span", { "data-field": "store_breaker", "data-state": s }, el("strong", { class: s === "closed" ? "ok" : "bad" }, s));
    if (short) node.append(` (${short})`);
    if (long) node.title = long;
    return node;
  }

  function card(v, past) {
    const r = v.recent || {};
    const c = v.concurrency && typeof v.concurrency === "object" ? v.concurrency : null;
    const quota = num(v.sizing && v.sizing.configured_rate_per_second);
    const st = statuses(v);
    const tightest = tightestBucket(v.buckets);

    const head = el("h2", {}, el("span", { class: "name" }, v.name));
    const breaker = v.breaker || "closed";
    if (breaker !== "closed") {
      head.append(" ", el("span", { class: "badge bad", "data-field": "breaker" }, `store circuit breaker ${breaker}`));
    }
    if (num(v.blocked_for_seconds)) {
      head.append(" ", el("span", { class: "badge bad", title: "the vendor answered 429: no replica sends it anything until then" }, "blocked by the vendor for ", field("blocked", v.blocked_for_seconds), " s"));
    }
    if (v.store_error) head.append(" ", el("span", { class: "badge bad" }, "store unavailable"));

    const tiles = [
      tile("rate", "sent /s", field("rate", r.forwarded_per_second), quota === null ? null : el("span", {}, "of ", field("quota", quota), " /s long-run quota", boundBy(v)), gauge(r.forwarded_per_second, quota)),
      tile("tokens", "tokens left", field("tokens", v.tokens_available), tightest ? el("span", {}, "of ", field("burst", tightest.burst), " burst (the bucket nearest empty)") : null),
      tile("held", "held now", field("held", v.held_now), el("span", {}, field("held_rate", r.held_per_second), " /s held")),
      tile("deferred", "deferred /s", field("deferred", r.deferred_per_second), el("span", {}, field("deferred_minute", r.deferred_last_minute), " last min · ", field("shed", r.shed_per_second), " shed /s")),
      tile("vendor_429", "vendor 429s", field("vendor_429", r.vendor_429_last_minute), el("span", {}, "last minute")),
      inflightTile(v, c),
    ];
    const article = el("article", { class: "vendor", "data-vendor": v.name }, head);
    const where = [v.route ? `route ${v.route}` : null, (v.hosts || []).join(", ") || null, onLimit(v.on_limit, st), answersText(v, st)].filter(Boolean).join(" · ");
    if (where) article.append(el("p", { class: "where" }, where));
    article.append(el("div", { class: "tiles" }, ...tiles));
    article.append(quotaSection(v));
    article.append(requestsChart(v, past, quota, st));
    article.append(refusalsSection(v, st));
    if (v.share && typeof v.share === "object") article.append(shareSection(v.share));
    article.append(eventsSection(past));
    article.append(readingCharts(v, c, past, tightest));
    if (v.endpoints !== undefined && v.endpoints !== null) article.append(generic("Endpoints", v.endpoints, "endpoints"));
    if (Array.isArray(v.meters)) article.append(generic("Meters (in their own currency)", v.meters, "meters"));
    if (v.learned !== undefined && v.learned !== null) article.append(generic("Learned from the vendor", v.learned, "learned"));
    return article;
  }

  function onLimit(o, st) {
    if (!o || typeof o.action !== "string") return null;
    if (o.action === "hold") return `on limit: hold up to ${duration(o.max_hold)}, then defer`;
    if (o.action === "defer") return `on limit: defer (${st.defer} + Retry-After)`;
    if (o.action === "shed") return `on limit: shed (${st.shed})`;
    return `on limit: ${o.action}`;
  }

  function answersText(v, st) {
    if (!v.answers || typeof v.answers.preset !== "string") return null;
    return `answers: ${v.answers.preset} (defer ${st.defer}, long defer ${st.longDefer}, shed ${st.shed})`;
  }

  // Which of the policy's limits makes the long-run quota what it is: for 80/1s and
  // 4000/1m, 66.7/s is 4000/1m's refill (an older /status names only the bucket).
  function boundLimit(v) {
    const longRun = v.quota && v.quota.long_run;
    if (!longRun) return null;
    return typeof longRun.limit === "string" ? longRun.limit : limitText(longRun.bucket);
  }

  function boundBy(v) {
    const limit = boundLimit(v);
    if (limit === null) return null;
    return el("span", {}, ", bound by ", el("strong", { "data-field": "quota_bound", "data-bucket": v.quota.long_run.bucket }, limit));
  }

  function inflightTile(v, c) {
    if (c) {
      const cap = num(c.cap);
      const sub = el("span", {}, cap === null ? "no cap" : el("span", {}, "of ", field("inflight_cap", cap), " cap"));
      if (c.held_for_slot !== undefined) sub.append(" · ", field("held_for_slot", c.held_for_slot), " waiting");
      return tile("inflight", "in flight", field("inflight", c.inflight), sub, gauge(c.inflight, cap));
    }
    if (v.tunnels) {
      return tile("inflight", "tunnels open", field("tunnels", v.tunnels.open), el("span", {}, "of ", field("tunnels_max", v.tunnels.max)));
    }
    return tile("inflight", "in flight", field("inflight", null), el("span", {}, "no concurrency cap"));
  }

  function tightestBucket(buckets) {
    if (!Array.isArray(buckets) || !buckets.length) return null;
    return buckets.reduce((a, b) => ((num(b.tokens) ?? Infinity) < (num(a.tokens) ?? Infinity) ? b : a));
  }

  function tile(metric, label, value, sub, bar) {
    return el("section", { class: "tile", "data-metric": metric }, el("h3", {}, label), el("p", { class: "value" }, value), sub ? el("p", { class: "sub" }, sub) : null, bar || null);
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

  function section(kind, title, ...children) {
    return el("section", { class: "part", "data-part": kind }, el("h4", {}, title), ...children);
  }

  function limitText(label) {
    return String(label ?? "").replace(/^global /, "");
  }

  // The statuses this vendor's workers get (its answers preset may say 403 or 409, not
  // 429 and 503); a proxy whose /status does not say gives the generic ones.
  function statuses(v) {
    const s = (v.answers && v.answers.status) || {};
    const defer = num(s.defer) ?? 429;
    return { defer, longDefer: num(s.long_defer) ?? defer, shed: num(s.shed) ?? 503 };
  }

  function deferredText(st) {
    return st.longDefer === st.defer ? `deferred (${st.defer})` : `deferred (${st.defer}; ${st.longDefer} when long)`;
  }

  function seriesLabel(key, st) {
    if (key === "forwarded") return "sent to the vendor";
    if (key === "held") return "of which held first";
    if (key === "deferred") return deferredText(st);
    return `shed (${st.shed})`;
  }

  // -- the quota: every bucket's rate, which binds now, which in the long run -----------------

  // /status says whether the bucket binds; an older proxy's does not: under one token, it does.
  function bindsAlready(now) {
    if (typeof now.binds === "boolean") return now.binds;
    return num(now.tokens) !== null && now.tokens < 1;
  }

  function quotaSection(v) {
    const q = v.quota || {};
    const longRun = q.long_run || null;
    const nowBinding = q.now || null;
    const box = section("quota", "Vendor quota: the fleet's shared buckets");
    const lines = el("p", { class: "binding" });
    if (longRun) {
      lines.append(
        el("span", { "data-field": "binds_long_run", "data-bucket": longRun.bucket }, "In the long run ", el("strong", {}, limitText(longRun.bucket)), " binds: ", el("strong", {}, `${fmt(longRun.rate_per_second)}/s`), " (the slowest refill)."),
      );
    }
    // The bucket with the fewest tokens binds only when it cannot grant a request now
    // (under one token); before that it is merely the nearest to binding.
    const bindsNow = nowBinding !== null && bindsAlready(nowBinding);
    if (nowBinding && bindsNow) {
      lines.append(
        " ",
        el(
          "span",
          { "data-field": "binds_now", "data-bucket": nowBinding.bucket },
          "Now ",
          el("strong", {}, limitText(nowBinding.bucket)),
          " binds, the fewest tokens: ",
          `${fmt(nowBinding.tokens)} of ${fmt(nowBinding.burst)} (${pct(nowBinding.fill)} full)`,
          num(nowBinding.tokens) !== null && nowBinding.tokens < 0
            ? ", below zero: owed to held requests or a vendor block."
            : ": requests wait for its refill.",
        ),
      );
    } else if (nowBinding) {
      lines.append(
        " ",
        el(
          "span",
          { "data-field": "nearest_now", "data-bucket": nowBinding.bucket },
          "Nothing binds now: the fewest tokens are ",
          el("strong", {}, limitText(nowBinding.bucket)),
          `'s, ${fmt(nowBinding.tokens)} of ${fmt(nowBinding.burst)} (${pct(nowBinding.fill)} full): up to ${Math.floor(nowBinding.tokens)} more can go at once.`,
        ),
      );
    }
    if (lines.childNodes.length) box.append(lines);
    if (Array.isArray(v.buckets) && v.buckets.length) {
      const items = v.buckets.map((b) => {
        const tags = [];
        if (bindsNow && b.bucket === nowBinding.bucket) tags.push(el("span", { class: "tag now" }, "binds now"));
        if (longRun && b.bucket === longRun.bucket) tags.push(el("span", { class: "tag long" }, `binds in the long run: ${fmt(b.rate_per_second)}/s`));
        const fill = num(b.fill);
        const meter = fill === null ? null : el("meter", { min: "0", max: "1", low: "0.2", optimum: "1", value: String(fill) });
        return el(
          "li",
          { "data-bucket": b.bucket, "data-binds": tags.map((t) => (t.classList.contains("now") ? "now" : "long_run")).join(" ") },
          el("span", { class: "limit" }, limitText(b.bucket)),
          " — ",
          el("span", { "data-field": "bucket_fill", "data-value": fill === null ? "" : String(fill) }, `${pct(fill)} full`),
          " (",
          field("bucket_tokens", b.tokens),
          ` of ${fmt(num(b.burst))} tokens), refills `,
          el("span", { "data-field": "bucket_rate", "data-value": String(b.rate_per_second) }, `${fmt(num(b.rate_per_second))}/s`),
          ...tags.flatMap((t) => [" ", t]),
          meter,
        );
      });
      box.append(el("ul", { class: "buckets" }, ...items));
    } else if (Array.isArray(v.limits) && v.limits.length) {
      box.append(el("p", { class: "muted" }, v.buckets === null ? "The store cannot be asked now: levels unknown. Limits: " : "Limits: ", v.limits.map((l) => `${fmt(l.rate)}/${fmt(l.per)}s (${fmt(l.rate_per_second)}/s)`).join(", ")));
    } else {
      box.append(el("p", { class: "muted" }, "No global limits: only tenant, endpoint or concurrency limits apply."));
    }
    return box;
  }

  // -- refusals: why requests were deferred or shed, and whose ---------------------------------

  function refusalsSection(v, st) {
    const rf = v.refusals && typeof v.refusals === "object" ? v.refusals : null;
    const box = section("refusals", "Deferred and shed, last minute, by reason");
    if (!rf) {
      box.append(el("p", { class: "muted" }, "This proxy does not count refusals by reason."));
      return box;
    }
    const rows = [];
    for (const [reason, counts] of Object.entries(rf.by_reason || {})) {
      const d = num(counts && counts.deferred) || 0;
      const s = num(counts && counts.shed) || 0;
      if (!d && !s) continue;
      const [label, why] = REASONS[reason] || [reason, ""];
      rows.push(
        el("tr", { "data-reason": reason }, el("td", {}, el("span", { class: "reason" }, label), why ? el("small", {}, why) : null), el("td", {}, field("reason_deferred", d)), el("td", {}, field("reason_shed", s))),
      );
    }
    if (rows.length) {
      const head = el("tr", {}, el("th", {}, "reason"), el("th", { title: `${st.defer} + Retry-After: the worker retries later` }, "deferred"), el("th", { title: `${st.shed}: the work is dropped` }, "shed"));
      box.append(el("div", { class: "scroll" }, el("table", { class: "reasons" }, el("thead", {}, head), el("tbody", {}, ...rows))));
    } else {
      box.append(el("p", { class: "muted", "data-field": "no_refusals" }, "No request deferred or shed in the last minute."));
    }
    const top = Array.isArray(rf.top_tenants) ? rf.top_tenants : [];
    if (top.length) {
      const items = top.map((t) =>
        el("li", { "data-tenant": String(t.tenant) }, el("code", {}, String(t.tenant)), " ", field("tenant_refused", t.refused), ` refused (last: ${(REASONS[t.reason] || [t.reason])[0]})`),
      );
      box.append(el("p", { class: "sub-title" }, "Tenants refused most"), el("ol", { class: "tenants" }, ...items));
    }
    return box;
  }

  // -- a shared quota (share:): each class's and each tenant's part, the last 10 s --------------

  // A fraction as a percentage the test can read back (the raw value in data-value).
  function fraction(name, value) {
    return el("span", { "data-field": name, "data-value": num(value) === null ? "" : String(value) }, pct(value));
  }

  function waitingTag(waiting) {
    return waiting ? el("span", { class: "tag wait", title: "had requests held, deferred or shed in the window" }, "waiting") : null;
  }

  function shareSection(sh) {
    const window_s = num(sh.window_seconds) ?? 10;
    const box = section("share", `Sharing the quota, last ${fmt(window_s)} s`);
    const classes = Array.isArray(sh.classes) ? sh.classes : [];
    const rows = classes.map((c, i) =>
      el(
        "tr",
        { "data-class": String(c.name) },
        el("td", {}, el("span", { class: "reason" }, String(c.name)), " ", waitingTag(c.waiting), el("small", {}, i === 0 ? "highest priority" : `priority ${i + 1}`)),
        el("td", {}, field("share_class_rate", c.granted_per_second)),
        el("td", {}, fraction("share_class_share", c.share)),
        el("td", {}, c.min_share === null || c.min_share === undefined ? "—" : fraction("share_class_min", c.min_share)),
      ),
    );
    const head = el(
      "tr",
      {},
      el("th", {}, "class"),
      el("th", { title: "tokens granted per second (requests/s when each costs 1)" }, "sent /s"),
      el("th", { title: "its part of what the vendor's shared quota granted" }, "share"),
      el("th", { title: "min_share: what a lower class with requests waiting always receives" }, "min share"),
    );
    box.append(el("div", { class: "scroll" }, el("table", { class: "share classes" }, el("thead", {}, head), el("tbody", {}, ...rows))));

    const tenants = Array.isArray(sh.tenants) ? sh.tenants : [];
    if (!tenants.length) {
      box.append(el("p", { class: "muted", "data-field": "no_share_tenants" }, `No request of a shared class in the last ${fmt(window_s)} s.`));
      return box;
    }
    const trows = tenants.map((t) => {
      const ratio = num(t.ratio);
      const meter = ratio === null ? null : el("meter", { min: "0", max: "1", low: "0.9", optimum: "1", value: String(Math.min(ratio, 1)) });
      if (meter) meter.title = `${pct(ratio)} of its fair share`;
      return el(
        "tr",
        { "data-share-tenant": String(t.tenant), "data-class": String(t.class) },
        el("td", {}, el("code", {}, String(t.tenant)), " ", waitingTag(t.waiting), el("small", {}, `${t.class} · weight ${fmt(num(t.weight))}`)),
        el("td", {}, field("share_tenant_rate", t.granted_per_second)),
        el("td", {}, field("share_tenant_fair", t.fair_per_second)),
        el("td", {}, fraction("share_tenant_ratio", t.ratio), meter),
      );
    });
    const thead = el(
      "tr",
      {},
      el("th", {}, "tenant"),
      el("th", { title: "tokens granted per second" }, "sent /s"),
      el("th", { title: "its class's rate × its weight ÷ the weights of the class's active tenants" }, "fair /s"),
      el("th", { title: "sent ÷ fair share: below 100% matters while it is waiting" }, "of fair"),
    );
    const active = num(sh.active_tenants);
    const title = active !== null && active > tenants.length ? `Tenants, the ${tenants.length} most active of ${fmt(active)}` : "Tenants";
    box.append(
      el("p", { class: "sub-title" }, title),
      el("div", { class: "scroll" }, el("table", { class: "share tenants" }, el("thead", {}, thead), el("tbody", {}, ...trows))),
    );
    return box;
  }

  // -- events: the vendor's own signals --------------------------------------------------------

  function eventLabel(kind, e) {
    if (kind === "vendor_429") return "vendor 429";
    if (kind === "vendor_block") return `blocked ${duration(e.seconds)}`;
    if (kind === "drain") return "drained (quota low)";
    return kind;
  }

  // Events of the same second as one: a 429 and the block it caused are one moment.
  function groupedEvents(past) {
    const groups = [];
    for (const e of (past && past.events) || []) {
      const ago = num(e.seconds_ago);
      if (ago === null) continue;
      const last = groups[groups.length - 1];
      if (last && Math.abs(last.ago - ago) < 1) {
        last.kinds.push(e.kind);
        last.labels.push(eventLabel(e.kind, e));
      } else {
        groups.push({ ago, at: e.at, kinds: [e.kind], labels: [eventLabel(e.kind, e)] });
      }
    }
    return groups;
  }

  function clockTime(at, ago) {
    const d = typeof at === "string" ? new Date(at) : new Date(Date.now() - ago * 1000);
    return Number.isNaN(d.getTime()) ? "" : d.toLocaleTimeString();
  }

  function eventsSection(past) {
    const box = section("events", "Vendor signals, last 5 minutes");
    if (!past) {
      box.append(el("p", { class: "muted" }, "No history from the proxy (/status/history)."));
      return box;
    }
    const groups = groupedEvents(past);
    if (!groups.length) {
      box.append(el("p", { class: "muted" }, "No vendor 429, block or drain."));
      return box;
    }
    const items = groups
      .slice()
      .reverse()
      .map((g) => el("li", { "data-event": g.kinds.join(" ") }, el("time", {}, clockTime(g.at, g.ago)), ` (${fmt(Math.round(g.ago))} s ago) `, g.labels.join(" · ")));
    box.append(el("ul", { class: "events" }, ...items));
    return box;
  }

  // -- graphs ----------------------------------------------------------------------------------

  // The proxy's per-second counts as 5-second averages, newest bin ending now.
  function binned(values, seconds) {
    const out = [];
    const n = values.length;
    for (let end = n; end - BIN_S >= 0; end -= BIN_S) {
      let sum = 0;
      for (let i = end - BIN_S; i < end; i++) sum += num(values[i]) || 0;
      out.push([(n - end) * (seconds / n) + BIN_S / 2, sum / BIN_S]);
    }
    return out.reverse();
  }

  function requestsChart(v, past, quota, st) {
    const box = section("requests", "Requests per second, last 5 minutes");
    if (!past || !past.series) {
      box.append(el("p", { class: "muted" }, "No history from the proxy (/status/history): only the figures above."));
      return box;
    }
    const seconds = Math.max(60, (past.series.forwarded || []).length || 300);
    const series = SERIES.map((key) => ({ key, label: seriesLabel(key, st), points: binned(past.series[key] || [], seconds) }));
    const events = groupedEvents(past).map((g) => ({ ago: g.ago, label: g.labels.join(" · "), time: clockTime(g.at, g.ago), kinds: g.kinds.join(" ") }));
    return chartBox(box, "requests", {
      unit: "requests/s",
      span: seconds,
      height: 190,
      series,
      ref: quota === null ? null : { value: quota, label: `long-run quota ${fmt(quota)}/s${boundLimit(v) === null ? "" : `, bound by ${boundLimit(v)}`}` },
      events,
      note: `${BIN_S}-second averages, kept by the proxy`,
    });
  }

  // Readings the proxy samples each second (the last one this second's): [seconds ago, value].
  function readings(past, key) {
    const values = (past && past.gauges && past.gauges[key]) || [];
    const out = [];
    values.forEach((val, i) => {
      if (num(val) !== null) out.push([values.length - 1 - i, val]);
    });
    return out;
  }

  function readingCharts(v, c, past, tightest) {
    const wrap = el("div", { class: "pair" });
    if (!past || !past.gauges) return wrap;
    const span = Math.max(60, ((past.gauges.held_now || []).length || 300) - 1);
    const points = (key) => readings(past, key);
    if (Array.isArray(v.buckets) && v.buckets.length) {
      const box = section("tokens", "Tokens left, last 5 minutes");
      wrap.append(
        chartBox(box, "tokens", {
          unit: "tokens",
          span,
          height: 130,
          series: [{ key: "tokens", label: "tokens left (fewest of any bucket)", points: points("tokens") }],
          ref: tightest && num(tightest.burst) !== null ? { value: tightest.burst, label: `burst ${fmt(tightest.burst)}` } : null,
          events: [],
          note: "below 0: owed to held requests or to a vendor block",
        }),
      );
    }
    const cap = c ? num(c.cap) : null;
    const box = section("waiting", "Requests held and in flight, last 5 minutes");
    const series = [{ key: "held", label: "held in this proxy", points: points("held_now") }];
    if (c && num(c.cap) !== null) series.push({ key: "inflight", label: "in flight, fleet-wide", points: points("inflight") });
    wrap.append(chartBox(box, "waiting", { unit: "requests", span, height: 130, whole: true, series, ref: cap === null ? null : { value: cap, label: `cap ${fmt(cap)}` }, events: [] }));
    return wrap;
  }

  // A chart's frame now (its legend, a box for the SVG); its drawing once the box has a width.
  function chartBox(box, name, spec) {
    const plot = el("div", { class: "plot", "data-chart": name });
    box.append(plot);
    const legend = el("ul", { class: "legend" });
    for (const s of spec.series) legend.append(el("li", {}, el("span", { class: `swatch s-${s.key}` }), s.label));
    if (spec.ref) legend.append(el("li", {}, el("span", { class: "swatch ref" }), spec.ref.label));
    if (spec.events.length) legend.append(el("li", {}, el("span", { class: "swatch event" }), "vendor signal (429, block, drain)"));
    if (spec.note) legend.append(el("li", { class: "note" }, spec.note));
    box.append(legend);
    charts.push([plot, spec]);
    return box;
  }

  // The y axis: from the lowest value (or 0) to the highest (or the reference), in four or
  // five round steps (whole ones for a count of requests).
  function yScale(values, ref, whole) {
    let lo = Math.min(0, ...values);
    let hi = Math.max(0, ref ?? 0, ...values);
    if (hi - lo < (whole ? 4 : 1e-9)) hi = lo + (whole ? 4 : 1);
    const rough = (hi - lo) / 4;
    const p = Math.pow(10, Math.floor(Math.log10(rough)));
    let step = 10 * p;
    for (const m of whole ? [1, 2, 5] : [1, 2, 2.5, 5]) {
      if (rough <= m * p + 1e-12) {
        step = m * p;
        break;
      }
    }
    if (whole) step = Math.max(1, step);
    lo = Math.floor(lo / step + 1e-9) * step;
    hi = Math.ceil(hi / step - 1e-9) * step;
    return { lo, hi, step };
  }

  function timeTicks(span) {
    const step = [10, 15, 30, 60, 120, 300, 600].find((s) => span / s <= 6) || 600;
    const ticks = [];
    for (let t = 0; t <= span + 1e-9; t += step) ticks.push(t);
    return ticks;
  }

  // Axes (y in the unit, x in seconds ago), each series a line, the reference dashed,
  // events as marked vertical lines with their label and time.
  function drawChart(plot, spec) {
    const W = Math.max(240, Math.floor(plot.clientWidth || 300));
    const H = spec.height;
    const rows = spec.events.length ? 2 : 0;
    const m = { l: 40, r: 10, t: 18 + rows * 12, b: 30 };
    const pw = W - m.l - m.r;
    const ph = H - m.t - m.b;
    const values = spec.series.flatMap((s) => s.points.map((p) => p[1]));
    const { lo, hi, step } = yScale(values, spec.ref ? spec.ref.value : null, spec.whole);
    const x = (ago) => m.l + pw * (1 - clamp(ago, 0, spec.span) / spec.span);
    const y = (val) => m.t + ph * (1 - (val - lo) / (hi - lo || 1));
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chart", role: "img" });
    const peak = values.length ? Math.max(...values) : null;
    root.append(svg("title", {}, values.length ? `last ${fmt(spec.span)} s: highest ${fmt(peak)} ${spec.unit}` : "no samples yet"));

    const axes = svg("g", { class: "axes" });
    for (let i = 0; lo + i * step <= hi + step * 1e-6; i++) {
      const val = Number((lo + i * step).toPrecision(12));
      axes.append(svg("line", { class: val === 0 ? "axis" : "grid", x1: m.l, x2: W - m.r, y1: y(val), y2: y(val) }));
      axes.append(svg("text", { class: "tick", x: m.l - 4, y: y(val) + 3.5, "text-anchor": "end" }, fmt(val)));
    }
    axes.append(svg("line", { class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph }));
    for (const t of timeTicks(spec.span)) {
      axes.append(svg("line", { class: "axis", x1: x(t), x2: x(t), y1: m.t + ph, y2: m.t + ph + 4 }));
      const anchor = t === 0 ? "end" : t >= spec.span - 1e-9 ? "start" : "middle";
      axes.append(svg("text", { class: "tick", x: x(t), y: m.t + ph + 14, "text-anchor": anchor }, t === 0 ? "now" : String(t)));
    }
    axes.append(svg("text", { class: "axis-title", "data-axis": "y", x: 2, y: m.t - 6 }, spec.unit));
    axes.append(svg("text", { class: "axis-title", "data-axis": "x", x: m.l + pw / 2, y: H - 3, "text-anchor": "middle" }, "seconds ago"));
    root.append(axes);

    if (spec.ref) {
      root.append(svg("line", { class: "ref", x1: m.l, x2: W - m.r, y1: y(spec.ref.value), y2: y(spec.ref.value) }));
    }
    for (const s of spec.series) {
      const pts = s.points.filter((p) => p[0] <= spec.span).sort((a, b) => b[0] - a[0]);
      if (!pts.length) continue;
      const coords = pts.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
      if (pts.length === 1) coords.unshift(`${(x(pts[0][0]) - 1).toFixed(1)},${y(pts[0][1]).toFixed(1)}`);
      if (s.key === "forwarded" || s.key === "tokens") {
        const first = coords[0].split(",")[0];
        const last = coords[coords.length - 1].split(",")[0];
        const base = y(Math.max(lo, 0)).toFixed(1);
        root.append(svg("polygon", { class: `area s-${s.key}`, points: [`${first},${base}`, ...coords, `${last},${base}`].join(" ") }));
      }
      const top = Math.max(...pts.map((p) => p[1]));
      root.append(svg("polyline", { class: `line s-${s.key}`, "data-series": s.key, "data-max": top, points: coords.join(" ") }));
    }
    let lastX = -Infinity;
    let row = 0;
    for (const e of spec.events) {
      if (e.ago > spec.span) continue;
      const ex = x(e.ago);
      row = ex - lastX < 150 ? (row + 1) % 2 : 0;
      lastX = ex;
      const g = svg("g", { class: "event", "data-kind": e.kinds });
      g.append(svg("line", { x1: ex, x2: ex, y1: m.t - 2 - row * 12, y2: m.t + ph }));
      const right = ex > m.l + pw * 0.6;
      g.append(svg("text", { x: right ? ex - 3 : ex + 3, y: 10 + row * 12, "text-anchor": right ? "end" : "start" }, `${e.label} ${e.time}`));
      root.append(g);
    }
    plot.replaceChildren(root);
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
