// The page: its state lives in the URL (so a link reproduces the view), and
// each change of selection asks the API again; zoom, search, view and the
// top table work on the tree already loaded.

import { ApiError, answersWithoutToken, apiUrl, get, setToken, token } from "./api.js";
import { Flamegraph, Tree, amount, binaryHsl, binaryLegend, functionKey, weight } from "./flamegraph.js";
import { QueryBar, matcherValue, setMatcher } from "./query.js";
import { Timeline, localTime, utcOffset } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const PICKERS = ["pick-node", "pick-container", "pick-pod", "pick-comm"];
const TOP_ROWS = 200;

// What tests (and curious people) can read from the page without reading
// pixels: see tests/tests/e2e/ui.rs.
const hook = {
  state: "loading",
  error: "",
  loads: 0,
  root: "",
  zoom: [],
  nodes: 0,
  drawn: 0,
  searchShare: null,
  searchError: "",
  searchMatches: 0,
  topFirst: "",
  timings: {},
  lastDownload: null,
  drawnNames: () => [...new Set(flame.rects.filter((r) => r.node >= 0).map((r) => tree.name(r.node)))],
  benchZoom: (steps) => benchZoom(steps),
  /** Where to click on the first drawn frame named `name` (viewport pixels), scrolled into view. */
  frameBox: (name) => {
    const r = drawnRect(name);
    if (!r) return null;
    const top = $("flamegraph").getBoundingClientRect().top;
    window.scrollTo(0, window.scrollY + top + r.y - window.innerHeight / 2);
    return hook.framePoint(name);
  },
  /** Where the first drawn frame named `name` is, in viewport pixels (no scrolling). */
  framePoint: (name) => {
    const r = drawnRect(name);
    if (!r) return null;
    const box = $("flamegraph").getBoundingClientRect();
    return { x: Math.round(box.left + r.x + Math.min(r.w / 2, 40)), y: Math.round(box.top + r.y + 9) };
  },
  /** Where the root frame of the drawing is, in viewport pixels (no scrolling). */
  rootBox: () => {
    const r = flame.rects.find((rect) => rect.node >= 0 && rect.depth === 0);
    if (!r) return null;
    const box = $("flamegraph").getBoundingClientRect();
    return { top: Math.round(box.top + r.y), drawingTop: Math.round(box.top), viewport: window.innerHeight };
  },
  /** The colour the first drawn frame named `name` was filled with. */
  frameFill: (name) => drawnRect(name)?.fill ?? null,
  /** The frame the keyboard is on, if any. */
  focused: () => (flame.focused >= 0 ? tree.name(flame.focused) : null),
};

function drawnRect(name) {
  return flame.rects.find((r) => r.node >= 0 && tree.name(r.node) === name) || null;
}
window.stackscope = hook;

/** The page state, as the URL's query string carries it. */
function readUrl() {
  const q = new URLSearchParams(location.search);
  let zoom = [];
  try {
    zoom = JSON.parse(q.get("zoom") || "[]");
  } catch {
    zoom = [];
  }
  return {
    match: q.get("match") || "",
    // The profile type; empty is CPU.
    type: q.get("type") === "cpu" ? "" : q.get("type") || "",
    since: q.get("since") || "",
    start: q.get("start") || "",
    end: q.get("end") || "",
    group_by: q.get("group_by") || "",
    search: q.get("search") || "",
    zoom: Array.isArray(zoom) ? zoom.map(String) : [],
    // Icicle by default, as Pyroscope and Parca open: the root is at the
    // top, in view, however deep the stacks.
    view: q.get("view") === "flame" ? "flame" : "icicle",
    fn: q.get("fn") || "",
    sort: ["total", "name", "delta"].includes(q.get("sort")) ? q.get("sort") : "self",
    // The sorted column's natural order (names A-Z, figures largest first)
    // unless reversed.
    reversed: q.get("reversed") === "1" ? "1" : "",
    filter: q.get("filter") || "",
    base_start: q.get("base_start") || "",
    base_end: q.get("base_end") || "",
    base_match: q.get("base_match") || "",
  };
}

let state = readUrl();

function writeUrl({ push = false } = {}) {
  const q = new URLSearchParams();
  for (const [name, value] of Object.entries(state)) {
    if (name === "zoom") {
      if (value.length) q.set("zoom", JSON.stringify(value));
    } else if (name === "view") {
      if (value !== "icicle") q.set(name, value);
    } else if (name === "sort") {
      if (value !== "self") q.set(name, value);
    } else if (value) {
      q.set(name, value);
    }
  }
  const url = `${location.pathname}${q.toString() ? `?${q}` : ""}`;
  if (url === `${location.pathname}${location.search}`) return;
  if (push) history.pushState(null, "", url);
  else history.replaceState(null, "", url);
}

function comparing() {
  return Boolean(state.base_start && state.base_end);
}

/** The time range and the profile type every query of the page reads. */
function rangeParams() {
  const type = state.type ? { type: state.type } : {};
  if (state.start && state.end) return { ...type, start: state.start, end: state.end };
  return { ...type, since: state.since || "1h" };
}

function selectionParams() {
  return { match: state.match, ...rangeParams() };
}

function baseParams() {
  const type = state.type ? { type: state.type } : {};
  return { ...type, match: state.base_match || state.match, start: state.base_start, end: state.base_end };
}

const UNITS = { s: 1, m: 60, h: 3600, d: 86400, w: 604800 };

/** The selection's range in unix seconds, as the collector will resolve it. */
function rangeSeconds() {
  if (state.start && state.end) return [Number(state.start), Number(state.end)];
  const end = Date.now() / 1000;
  const found = /^(\d+(?:\.\d+)?)\s*([smhdw])$/.exec(state.since || "1h");
  const span = found ? Number(found[1]) * UNITS[found[2]] : 3600;
  return [end - span, end];
}

// ---- status and errors ----

function showStatus(text, kind = "info") {
  const status = $("status");
  status.textContent = text;
  status.className = `status ${kind}`;
}

function showError(err) {
  if (err && err.name === "AbortError") return;
  console.error(err);
  hook.error = err.message || String(err);
  showStatus(hook.error, "error");
  if (err instanceof ApiError && err.status === 401) $("token-form").hidden = false;
}

function setPanelState(value, message = "") {
  if (value !== "ready") $("side-by-side").hidden = true;
  hook.state = value;
  $("flame-panel").dataset.state = value;
  const empty = $("flame-empty");
  empty.hidden = !message;
  empty.textContent = message;
  $("flamegraph").hidden = Boolean(message);
}

// ---- the flamegraph ----

let tree = null;
const flame = new Flamegraph($("flamegraph"), $("tooltip"), {
  onZoom: (node) => {
    state.zoom = tree.path(node);
    writeUrl({ push: true });
    afterDraw();
  },
});

// When comparing: the selection and the baseline side by side, each
// zoomable on its own, under the differential flamegraph.
const sides = {
  current: new Flamegraph($("side-current"), $("tip-current")),
  baseline: new Flamegraph($("side-baseline"), $("tip-baseline")),
};

function showSides(selected, baseline) {
  $("side-by-side").hidden = !baseline;
  if (!baseline) return;
  for (const [side, t] of [
    [sides.current, selected],
    [sides.baseline, baseline],
  ]) {
    side.setTree(t);
    side.icicle = state.view === "icicle";
    side.draw();
  }
  hook.sides = {
    current: sides.current.rects.filter((r) => r.node >= 0).length,
    baseline: sides.baseline.rects.filter((r) => r.node >= 0).length,
  };
}

// The chosen function's sandwich: its callers drawn as a flame above it,
// its callees as an icicle below, the two meeting at the function.
const sandwich = {
  callers: new Flamegraph($("sandwich-callers"), $("tip-callers")),
  callees: new Flamegraph($("sandwich-callees"), $("tip-callees")),
};

function showSandwich() {
  const parts = state.fn && tree ? tree.sandwich(state.fn) : null;
  $("sandwich").hidden = !parts;
  hook.sandwich = null;
  if (!parts) return;
  $("sandwich-title").textContent = `${state.fn}: its callers above, its callees below (${weight(parts.callees.total[0], tree.period, tree.type)})`;
  sandwich.callers.setTree(parts.callers);
  sandwich.callers.icicle = false;
  sandwich.callers.draw();
  sandwich.callees.setTree(parts.callees);
  sandwich.callees.icicle = true;
  sandwich.callees.draw();
  const drawn = (side) => side.rects.filter((r) => r.node >= 0).map((r) => side.tree.name(r.node));
  hook.sandwich = { callers: drawn(sandwich.callers), callees: drawn(sandwich.callees) };
}

function afterDraw() {
  const panel = $("flame-panel");
  hook.root = tree.name(flame.zoom);
  hook.zoom = tree.path(flame.zoom);
  hook.drawn = flame.rects.length;
  panel.dataset.root = hook.root;
  panel.dataset.zoom = JSON.stringify(hook.zoom);
  panel.dataset.drawn = String(hook.drawn);
  $("flamegraph").setAttribute(
    "aria-label",
    `Flamegraph of ${hook.zoom.length ? hook.zoom.join(" > ") : "all samples"}: ${hook.drawn} frames drawn; the top functions table below lists the same weights`,
  );
  renderBreadcrumb();
}

function renderBreadcrumb() {
  const nav = $("breadcrumb");
  const chain = [];
  for (let at = flame.zoom; ; at = tree.parent[at]) {
    chain.push(at);
    if (at === 0) break;
  }
  chain.reverse();
  const parts = [];
  chain.forEach((node, k) => {
    if (k) {
      const sep = document.createElement("span");
      sep.className = "sep";
      sep.textContent = "›";
      parts.push(sep);
    }
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = node === 0 ? "all" : tree.name(node);
    button.title = button.textContent;
    button.disabled = node === flame.zoom;
    button.addEventListener("click", () => flame.setZoom(node));
    parts.push(button);
  });
  nav.replaceChildren(...parts);
}

function renderLegend() {
  const byBinary = new Map();
  for (let i = 1; i < tree.count; i++) {
    const f = tree.frames[tree.frame[i]];
    const key = binaryLegend(f);
    const entry = byBinary.get(key) || { weight: 0, frame: f };
    entry.weight += tree.self[i];
    byBinary.set(key, entry);
  }
  const entries = [...byBinary.entries()].sort((a, b) => b[1].weight - a[1].weight).slice(0, 12);
  $("legend").replaceChildren(
    ...entries.map(([name, { frame }]) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      const [h, s, l] = binaryHsl(frame, tree.palette());
      swatch.style.background = `hsl(${h} ${s}% ${l}%)`;
      span.append(swatch, name);
      return span;
    }),
  );
  if (tree.base) {
    // A colour scale, as the frames are coloured: the change of a frame's
    // share of all, relative to the larger of the two shares.
    const scale = document.createElement("span");
    scale.className = "diff-scale";
    const bar = document.createElement("i");
    bar.style.background =
      "linear-gradient(to right, hsl(215 80% 50%), hsl(215 80% 71%), hsl(0 0% 92%), hsl(0 80% 71%), hsl(0 80% 50%))";
    const [less, more] = [document.createElement("span"), document.createElement("span")];
    less.textContent = "smaller share than the baseline";
    more.textContent = "larger";
    scale.append(less, bar, more);
    const note = document.createElement("span");
    note.textContent = "widths are the selection's";
    $("legend").replaceChildren(scale, note);
  }
}

/** The search as a frame matcher (none for an empty search), or why its regex is not one. */
function searchMatcher(text) {
  if (!text) return { match: null, error: "" };
  const regex = /^\/(.+)\/$/.exec(text);
  if (regex) {
    try {
      const re = new RegExp(regex[1], "i");
      return { match: (f) => re.test(f.name), error: "" };
    } catch (err) {
      return { match: () => false, error: err.message };
    }
  }
  const needle = text.toLowerCase();
  return { match: (f) => f.name.toLowerCase().includes(needle), error: "" };
}

function applySearch() {
  const { match, error } = searchMatcher(state.search);
  const result = flame.setSearch(match);
  const out = $("search-result");
  const panel = $("flame-panel");
  // Next to the search, so it goes with the search that caused it.
  hook.searchError = error;
  out.classList.toggle("error", Boolean(error));
  if (error) {
    out.textContent = error;
    hook.searchShare = null;
    hook.searchMatches = 0;
    delete panel.dataset.searchShare;
  } else if (!result) {
    out.textContent = "";
    hook.searchShare = null;
    hook.searchMatches = 0;
    delete panel.dataset.searchShare;
  } else {
    const share = tree.total[0] ? result.weight / tree.total[0] : 0;
    hook.searchShare = share;
    hook.searchMatches = result.count;
    panel.dataset.searchShare = String(share);
    out.textContent = result.count
      ? `${result.count.toLocaleString("en-US")} ${result.count === 1 ? "frame" : "frames"}, ${(share * 100).toFixed(2)}% of all`
      : "no match";
  }
  afterDraw();
}

async function benchZoom(steps) {
  // Zooms into the widest child, level after level, then back out to the
  // root; each step is one full redraw.
  const times = [];
  const begun = performance.now();
  for (let k = 0; k < steps; k++) {
    const kids = tree.children(flame.zoom);
    let next = 0;
    if (kids.length) next = kids.reduce((a, b) => (tree.total[b] > tree.total[a] ? b : a));
    const started = performance.now();
    flame.zoom = kids.length ? next : 0;
    flame.draw();
    times.push(performance.now() - started);
    await new Promise((resolve) => requestAnimationFrame(resolve));
  }
  // Frames: one zoom per animation frame, so this is the frame rate the
  // page keeps while zooming (capped by the display's, when it has one).
  const framesPerSecond = steps / ((performance.now() - begun) / 1000);
  flame.setZoom(0);
  const avg = times.reduce((a, b) => a + b, 0) / times.length;
  return { steps, avgMs: avg, maxMs: Math.max(...times), redrawsPerSecond: 1000 / avg, framesPerSecond };
}

// ---- top table and callers ----

let functions = [];

/**
 * Adds each function's self share in the baseline and the change of its
 * self share (`delta`, positive: more of the time now, slower).
 */
function compareFunctions(list, selected, baseline) {
  const before = new Map(baseline.functions().map((f) => [functionKey(f), f]));
  const all = selected.total[0] || 1;
  const baseAll = baseline.total[0] || 1;
  for (const f of list) {
    const old = before.get(functionKey(f));
    f.baseShare = old ? old.self / baseAll : 0;
    f.delta = f.self / all - f.baseShare;
  }
}

function renderTop() {
  const filter = state.filter.toLowerCase();
  const key = state.sort;
  const rows = functions
    .filter((f) => !filter || f.name.toLowerCase().includes(filter))
    .sort((a, b) => (key === "name" ? a.name.localeCompare(b.name) : (b[key] ?? 0) - (a[key] ?? 0) || a.name.localeCompare(b.name)));
  if (state.reversed) rows.reverse();
  const all = tree?.total[0] || 1;
  $("top-count").textContent = `${rows.length.toLocaleString("en-US")} functions${rows.length > TOP_ROWS ? `, first ${TOP_ROWS} shown` : ""}`;
  hook.topFirst = rows.length ? rows[0].name : "";
  for (const th of document.querySelectorAll("#top th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === key);
    th.classList.toggle("reversed", th.dataset.sort === key && Boolean(state.reversed));
  }
  $("top").tBodies[0].replaceChildren(
    ...rows.slice(0, TOP_ROWS).map((f) => {
      const tr = document.createElement("tr");
      tr.dataset.function = f.name;
      if (f.name === state.fn) tr.className = "selected";
      for (const [text, num, extra] of [
        [f.name, false],
        [f.binary, false],
        [amount(f.self, tree?.period, tree?.type), true],
        [`${((100 * f.self) / all).toFixed(2)}%`, true],
        [amount(f.total, tree?.period, tree?.type), true],
        [`${((100 * f.total) / all).toFixed(2)}%`, true],
        ...(comparing() && f.delta !== undefined
          ? [
              [`${(100 * f.baseShare).toFixed(2)}%`, true, "compare-only"],
              [`${f.delta >= 0 ? "+" : ""}${(100 * f.delta).toFixed(2)}%`, true, f.delta > 0 ? "slower" : f.delta < 0 ? "faster" : ""],
            ]
          : []),
      ]) {
        const td = document.createElement("td");
        td.textContent = text;
        td.title = text;
        td.className = [num ? "num" : "", extra || ""].join(" ").trim();
        tr.append(td);
      }
      tr.addEventListener("click", () => selectFunction(f.name === state.fn ? "" : f.name));
      return tr;
    }),
  );
}

function selectFunction(name) {
  state.fn = name;
  writeUrl({ push: true });
  flame.setHighlight(name || null);
  renderTop();
  loadCallers();
}

let callersRequest = null;

async function loadCallers() {
  showSandwich();
  const panel = $("callers");
  const name = state.fn;
  callersRequest?.abort();
  if (!name || !tree) {
    panel.innerHTML = '<p class="hint">Click a function in the table to see its callers and callees.</p>';
    return;
  }
  callersRequest = new AbortController();
  panel.textContent = `Loading the callers of ${name}…`;
  try {
    const report = await get("/api/v1/callers", { ...selectionParams(), function: name }, { signal: callersRequest.signal });
    const all = report.total || 1;
    const list = (title, items) => {
      const h = document.createElement("h3");
      h.textContent = `${title} (${items.length})`;
      const ul = document.createElement("ul");
      for (const item of items) {
        const li = document.createElement("li");
        const fn = document.createElement("span");
        fn.textContent = item.function;
        fn.title = item.function;
        const w = document.createElement("span");
        w.className = "num";
        w.textContent = `${((100 * item.weight) / all).toFixed(2)}%`;
        li.append(fn, w);
        li.addEventListener("click", () => selectFunction(item.function));
        ul.append(li);
      }
      if (!items.length) ul.innerHTML = '<li class="hint">none</li>';
      return [h, ul];
    };
    const title = document.createElement("div");
    title.className = "fn";
    title.textContent = report.function;
    const stats = document.createElement("div");
    stats.textContent = `self ${weight(report.self, tree.period, tree.type)}, total ${weight(report.total, tree.period, tree.type)}`;
    panel.replaceChildren(title, stats, ...list("Callers", report.callers), ...list("Callees", report.callees));
  } catch (err) {
    if (err.name === "AbortError") return;
    panel.textContent = "";
    showError(err);
  }
}

// ---- loading ----

let loadRequest = null;

async function load() {
  loadRequest?.abort();
  const request = new AbortController();
  loadRequest = request;
  const signal = request.signal;
  const started = performance.now();
  hook.loads++;
  hook.error = "";
  // The flamegraph shown stays (dimmed) until the new one is in.
  setPanelState("loading", tree && hook.state === "ready" ? "" : "Loading the flamegraph…");
  showStatus("");
  syncControls();
  loadTimeline(signal);
  try {
    const flatParams = { ...selectionParams(), format: "flat", group_by: state.group_by };
    const trees = Promise.all([
      get("/api/v1/flamegraph", flatParams, { signal }),
      comparing()
        ? get("/api/v1/flamegraph", { ...baseParams(), format: "flat", group_by: state.group_by }, { signal })
        : null,
    ]);
    // The pickers' label queries wait for the flamegraph's, which they
    // would otherwise slow down in the collector.
    trees
      .finally(() => {
        if (!signal.aborted) loadPickers(signal);
      })
      .catch(() => {});
    const [current, base] = await trees;
    const fetched = performance.now();
    const selected = Tree.fromFlat(current);
    const baseline = base ? Tree.fromFlat(base) : null;
    const next = baseline ? Tree.diff(selected, baseline) : selected;
    const parsed = performance.now();
    tree = next;
    hook.nodes = tree.count;
    $("flame-panel").dataset.nodes = String(tree.count);
    if (tree.total[0] === 0) {
      clearSelectionViews();
      const message = state.type
        ? `No ${typeName(state.type)} in this selection and time range.\nChoose CPU time in the type picker, widen the range, or remove matchers from the query.`
        : state.match
        ? `The selection matched nothing in this time range.\nWiden the range (a preset above, or drag on the timeline) or remove matchers from the query (${state.match}).`
        : "No data yet: the collector has no samples in this time range.\nStart an agent that ships to this collector (stackscope-agent --collector http://HOST:7070), wait for its first interval, or pick a longer range.";
      setPanelState("empty", message);
      return;
    }
    setPanelState("ready");
    flame.setTree(tree);
    flame.icicle = state.view === "icicle";
    const zoom = state.zoom.length ? tree.find(state.zoom) : 0;
    flame.zoom = zoom < 0 ? 0 : zoom;
    if (zoom < 0) state.zoom = [];
    flame.highlight = state.fn ? tree.match((f) => f.name === state.fn) : null;
    applySearch();
    const drawn = performance.now();
    hook.timings = {
      fetchMs: fetched - started,
      parseMs: parsed - fetched,
      drawMs: drawn - parsed,
      loadMs: drawn - started,
      sinceNavigationMs: drawn,
    };
    hook.firstFlamegraphMs ??= drawn;
    renderLegend();
    // In depth-first order (a differential tree is not): the selection's own.
    functions = selected.functions().filter((f) => f.binary !== "[group]");
    if (baseline) compareFunctions(functions, selected, baseline);
    showSides(selected, baseline);
    document.body.classList.toggle("comparing", Boolean(baseline));
    renderTop();
    loadCallers();
    if (comparing()) {
      const base = describeRange([Number(state.base_start), Number(state.base_end)]);
      const baseMatch = state.base_match && state.base_match !== state.match ? ` where ${state.base_match}` : "";
      const empty = baseline && baseline.total[0] === 0;
      // Against nothing, every frame is new and drawn red: say why.
      const notice = empty ? " The baseline has no samples: every frame shows as new." : "";
      $("compare-text").textContent = `Comparing ${state.match || "everything"} in ${describeRange(rangeSeconds())} with the baseline ${base}${baseMatch}.${notice}`;
      $("compare-text").classList.toggle("warn", Boolean(empty));
    }
  } catch (err) {
    if (err.name === "AbortError") return;
    tree = null;
    // Nothing of the previous selection stays beside the error.
    clearSelectionViews();
    setPanelState("error", err.status === 0 ? "The collector is unreachable." : "The query failed: see the message above.");
    showError(err);
  }
}

/** Empties the views of a selection: what a failed or empty query leaves. */
function clearSelectionViews() {
  functions = [];
  renderTop();
  $("legend").replaceChildren();
  $("breadcrumb").replaceChildren();
  $("callers").replaceChildren();
  $("sandwich").hidden = true;
  hook.sandwich = null;
}

/** A range as the timeline's axis reads it: local times, with their zone. */
function describeRange([start, end]) {
  return `${localTime(start)} – ${localTime(end)} (${utcOffset(new Date(end * 1000))})`;
}

async function loadTimeline(signal) {
  const [start, end] = rangeSeconds();
  timeline.setBaseline(comparing() ? [Number(state.base_start) * 1e9, Number(state.base_end) * 1e9] : null);
  // The range's axis at once, the bars when they come (or never, on an error).
  timeline.set([], 1, start * 1e9, end * 1e9, "loading…");
  try {
    const series = await get("/api/v1/series", selectionParams(), { signal });
    timeline.type = state.type || "cpu";
    timeline.set(series.points, series.step_nanos, start * 1e9, end * 1e9);
    const total = series.points.reduce((sum, p) => sum + p.weight, 0);
    $("timeline").dataset.points = String(series.points.length);
    $("timeline").dataset.total = String(total);
  } catch (err) {
    if (err.name === "AbortError") return;
    timeline.set([], 1, start * 1e9, end * 1e9, "no series: see the message above");
    showError(err);
  }
}

const labelCache = new Map();

function rangeKey() {
  return JSON.stringify(rangeParams());
}

/** Label names and values for completion, kept a minute (new ones appear as agents ship). */
const LABEL_TTL_MS = 60_000;

function cached(key, fetcher) {
  const full = `${rangeKey()}|${key}`;
  const entry = labelCache.get(full);
  if (!entry || performance.now() - entry.at > LABEL_TTL_MS) {
    const promise = fetcher().catch((err) => {
      labelCache.delete(full);
      throw err;
    });
    labelCache.set(full, { promise, at: performance.now() });
    return promise;
  }
  return entry.promise;
}

const labelNames = () => cached("", () => get("/api/v1/labels", rangeParams()));
// Over the range alone: every type with samples in it, whichever is shown.
const profileTypes = () => {
  const { type, ...range } = rangeParams();
  return cached("|types", () => get("/api/v1/types", range));
};
const labelValues = (name) => cached(name, () => get(`/api/v1/labels/${encodeURIComponent(name)}/values`, rangeParams()));

async function loadPickers(signal) {
  try {
    const [names, types] = await Promise.all([labelNames(), profileTypes()]);
    if (signal.aborted) return;
    fillTypes(types);
    fillSelect($("group-by"), names, state.group_by, "none");
    await Promise.all(
      PICKERS.map(async (id) => {
        const select = $(id);
        const label = select.dataset.label;
        const present = names.includes(label);
        const current = matcherValue(state.match, label);
        // A label no sample carries in this range (no containers, no pods):
        // its picker would offer only "any". Kept while the query uses it.
        select.parentElement.hidden = !present && !current;
        const values = present ? await labelValues(label) : [];
        if (!signal.aborted) fillSelect(select, values, current, "any");
      }),
    );
  } catch (err) {
    showError(err);
  }
}

const TYPE_NAMES = { cpu: "CPU time", off_cpu: "off-CPU time" };

/** A type's name in the picker: an application's (`memory:alloc_space:bytes:…`) as "alloc_space (memory)". */
function typeName(type) {
  if (TYPE_NAMES[type]) return TYPE_NAMES[type];
  const parts = type.split(":");
  return parts.length === 5 ? `${parts[1]} (${parts[0]})` : type;
}

/** The profile-type picker: shown when the range holds more than CPU samples. */
function fillTypes(types) {
  const current = state.type || "cpu";
  const offered = types.includes(current) ? types : [...types, current];
  $("pick-type").parentElement.hidden = offered.length < 2;
  $("pick-type").replaceChildren(
    ...offered.map((type) => {
      const option = document.createElement("option");
      option.value = type;
      option.textContent = typeName(type);
      return option;
    }),
  );
  $("pick-type").value = current;
}

function fillSelect(select, values, current, none) {
  const options = [["", none], ...values.map((v) => [v, v])];
  if (current && !values.includes(current)) options.push([current, current]);
  select.replaceChildren(
    ...options.map(([value, text]) => {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = text;
      return option;
    }),
  );
  select.value = current;
}

/** Says when the query bar holds other matchers than the graph shows. */
function markPendingQuery() {
  $("query-pending").hidden = $("query").value.trim() === state.match;
}

function syncControls() {
  $("query").value = state.match;
  markPendingQuery();
  $("search").value = state.search;
  $("top-filter").value = state.filter;
  $("view-toggle").textContent = state.view === "icicle" ? "flame" : "icicle";
  $("view-toggle").title = state.view === "icicle" ? "Show as a flame graph (root at the bottom)" : "Show as an icicle graph (root at the top)";
  for (const b of document.querySelectorAll(".presets button")) {
    b.classList.toggle("active", !state.start && (state.since || "1h") === b.dataset.since);
  }
  for (const link of document.querySelectorAll("[data-export-api]")) link.href = exportUrl(link.dataset.exportApi);
  $("range").textContent = state.start && state.end ? describeRange(rangeSeconds()) : `the last ${state.since || "1h"}`;
  $("compare-bar").hidden = !comparing();
  $("base-match").value = state.base_match;
}

/** Applies a state change that needs the API again. */
function reload(change) {
  Object.assign(state, change, { zoom: [] });
  writeUrl({ push: true });
  load();
}

// ---- wiring ----

const timeline = new Timeline($("timeline"), {
  onRange: (start, end) => reload({ start: String(start), end: String(end), since: "" }),
});

new QueryBar($("query"), $("completions"), {
  names: labelNames,
  values: labelValues,
  onSubmit: (text) => reload({ match: text }),
  onError: showError,
});

$("query").addEventListener("input", markPendingQuery);

$("query-form").addEventListener("submit", (e) => {
  e.preventDefault();
  reload({ match: $("query").value.trim() });
});

for (const id of PICKERS) {
  $(id).addEventListener("change", (e) => {
    reload({ match: setMatcher(state.match, e.target.dataset.label, e.target.value) });
  });
}
$("group-by").addEventListener("change", (e) => reload({ group_by: e.target.value }));
$("pick-type").addEventListener("change", (e) => reload({ type: e.target.value === "cpu" ? "" : e.target.value }));

for (const button of document.querySelectorAll(".presets button")) {
  button.addEventListener("click", () => reload({ since: button.dataset.since, start: "", end: "" }));
}

$("compare-hour").addEventListener("click", () => {
  const [start, end] = rangeSeconds();
  reload({
    start: start.toFixed(3),
    end: end.toFixed(3),
    since: "",
    base_start: (start - 3600).toFixed(3),
    base_end: (end - 3600).toFixed(3),
  });
});
$("compare-selection").addEventListener("click", () => {
  // The same range; the baseline's matchers are edited in the compare bar.
  const [start, end] = rangeSeconds();
  const range = { start: start.toFixed(3), end: end.toFixed(3), since: "" };
  reload({ ...range, base_start: range.start, base_end: range.end, base_match: state.base_match || state.match });
  $("base-match").focus();
});
$("compare-stop").addEventListener("click", () => reload({ base_start: "", base_end: "", base_match: "" }));
$("base-match").addEventListener("change", (e) => reload({ base_match: e.target.value.trim() }));

let searchTimer = 0;
$("search").addEventListener("input", (e) => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => {
    state.search = e.target.value.trim();
    writeUrl();
    if (tree && hook.state === "ready") applySearch();
  }, 120);
});

// ---- the theme: the one chosen here (kept in localStorage), else the system's ----

const THEME_KEY = "stackscope.theme";
const systemDark = window.matchMedia("(prefers-color-scheme: dark)");

function applyTheme() {
  const theme = localStorage.getItem(THEME_KEY) || (systemDark.matches ? "dark" : "light");
  document.documentElement.dataset.theme = theme;
  $("theme-toggle").textContent = theme === "dark" ? "light" : "dark";
  // The canvases read their colours from the style sheet when they draw.
  timeline.draw();
}

applyTheme();
systemDark.addEventListener("change", applyTheme);
$("theme-toggle").addEventListener("click", () => {
  localStorage.setItem(THEME_KEY, document.documentElement.dataset.theme === "dark" ? "light" : "dark");
  applyTheme();
});

$("view-toggle").addEventListener("click", () => {
  state.view = state.view === "icicle" ? "flame" : "icicle";
  writeUrl({ push: true });
  syncControls();
  flame.setIcicle(state.view === "icicle");
  if (!$("side-by-side").hidden) for (const side of Object.values(sides)) side.setIcicle(state.view === "icicle");
});

$("top-filter").addEventListener("input", (e) => {
  state.filter = e.target.value;
  writeUrl();
  if (tree) renderTop();
});
for (const th of document.querySelectorAll("#top th[data-sort]")) {
  th.addEventListener("click", () => {
    // The sorted column again: the other way round.
    state.reversed = th.dataset.sort === state.sort && !state.reversed ? "1" : "";
    state.sort = th.dataset.sort;
    writeUrl();
    if (tree) renderTop();
  });
}

$("token-button").addEventListener("click", () => {
  $("token-form").hidden = !$("token-form").hidden;
  $("token").value = token();
});
$("token-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const value = $("token").value.trim();
  setToken(value);
  $("token-form").hidden = true;
  labelCache.clear();
  load();
  if (!value) return;
  // Saved either way; say when this collector does not use it.
  try {
    const unused = await answersWithoutToken();
    if (hook.state !== "error") {
      showStatus(unused ? "Token saved; this collector answers without one." : "Token saved.");
    }
  } catch {
    // Unreachable: the load says so.
  }
});
$("token-forget").addEventListener("click", () => {
  setToken("");
  $("token").value = "";
});

/** The selection's range as UTC instants, e.g. 2026-11-28T09:00:00Z. */
function utcRange() {
  const iso = (seconds) => new Date(seconds * 1000).toISOString().replace(/\.\d{3}Z$/, "Z");
  return rangeSeconds().map(iso);
}

/** A file name that says what was exported: the matchers and the range. */
function exportName(extension) {
  const what = (state.match || "all").replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 60) || "all";
  const [start, end] = utcRange().map((t) => t.replace(/[-:]/g, ""));
  return `stackscope-${what}-${start}-${end}.${extension}`;
}

/** The API address of the export shown: copyable, and what a script would fetch. */
function exportUrl(kind) {
  return location.origin + apiUrl("/api/v1/flamegraph", { ...selectionParams(), format: kind, group_by: state.group_by });
}

function download(blob, name) {
  hook.lastDownload = { name, size: blob.size, type: blob.type, blob };
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

for (const button of document.querySelectorAll("[data-export]")) {
  button.addEventListener("click", async () => {
    const kind = button.dataset.export;
    try {
      if (kind === "svg") {
        if (!tree) throw new Error("Nothing to export: no flamegraph is shown.");
        const [start, end] = utcRange();
        const title = `stackscope ${state.match || "everything"}, ${start} to ${end}`;
        download(new Blob([flame.toSvg(title)], { type: "image/svg+xml" }), exportName("svg"));
      } else {
        const blob = await get("/api/v1/flamegraph", { ...selectionParams(), format: kind, group_by: state.group_by }, { as: "blob" });
        download(blob, exportName(kind === "pprof" ? "pb.gz" : "folded"));
      }
    } catch (err) {
      showError(err);
    }
  });
}

const SELECTION_KEYS = ["match", "type", "since", "start", "end", "group_by", "base_start", "base_end", "base_match"];

// Escape zooms out one level (outside text fields).
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape" || !tree || hook.state !== "ready" || flame.zoom === 0) return;
  if (e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement) return;
  flame.setZoom(tree.parent[flame.zoom]);
});

window.addEventListener("popstate", () => {
  const previous = state;
  state = readUrl();
  if (!tree || hook.state !== "ready" || SELECTION_KEYS.some((k) => previous[k] !== state[k])) {
    load();
    return;
  }
  // Zoom, view, search and the chosen function: the tree is already here.
  syncControls();
  const zoom = tree.find(state.zoom);
  flame.zoom = zoom < 0 ? 0 : zoom;
  flame.icicle = state.view === "icicle";
  flame.highlight = state.fn ? tree.match((f) => f.name === state.fn) : null;
  applySearch();
  renderTop();
  loadCallers();
});

load();
