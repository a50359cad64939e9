// The call tree (from the API's `format=flat`) and its flamegraph, drawn on
// a canvas: a fleet-wide tree has hundreds of thousands of nodes, which SVG
// or DOM elements cannot hold, but only the frames wide enough to see are
// drawn (siblings narrower than MIN_WIDTH pixels are merged into one
// "small frames" block), so a redraw costs what is on screen, not what is in
// the tree.

/** Frames narrower than this (CSS pixels) are merged with their small siblings. */
export const MIN_WIDTH = 2;

/** What makes two frames the same function: its name and binary (frames
 * that differ only in file or line are one function). */
export const functionKey = (f) => `${f.name}\u0000${f.binary}`;
const ROW = 18;
/** A frame a search does not match, in a comparison. */
const SEARCH_MISS = "hsl(0 0% 86%)";
const FONT = "12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";

/**
 * Builds a tree node by node: the children of a node with the same frame
 * are one node, their weights summed. `base` (a baseline's weights) only
 * for differential trees.
 */
class TreeBuilder {
  constructor(rootFrame) {
    this.parent = [0];
    this.frame = [rootFrame];
    this.total = [0];
    this.base = [0];
    this.index = new Map();
  }

  /** The node for frame `f` under node `p`, made if there is none. */
  child(p, f) {
    // Frame ids stay below 2^32 and nodes below 2^21: an exact number.
    const key = p * 4294967296 + f;
    let at = this.index.get(key);
    if (at === undefined) {
      at = this.parent.length;
      this.index.set(key, at);
      this.parent.push(p);
      this.frame.push(f);
      this.total.push(0);
      this.base.push(0);
    }
    return at;
  }

  tree(frames, period, baseTotal = null, type = "cpu") {
    const base = baseTotal === null ? null : Float64Array.from(this.base);
    return new Tree(Int32Array.from(this.parent), Int32Array.from(this.frame), Float64Array.from(this.total), frames, period, base, baseTotal ?? 0, type);
  }
}

/** A call tree in typed arrays; node 0 is the root, parents before children. */
export class Tree {
  /**
   * parent, frame: Int32Array; total: Float64Array; frames: [{name, binary,
   * file, line, inlined}]; base: Float64Array of the baseline's totals for a
   * differential tree, else null; type: the profile type its weights are
   * of ("cpu": samples, each worth `period` ns; "off_cpu": nanoseconds; a
   * Pyroscope id: its sample unit).
   */
  constructor(parent, frame, total, frames, period, base = null, baseTotal = 0, type = "cpu") {
    const n = parent.length;
    this.count = n;
    this.parent = parent;
    this.frame = frame;
    this.total = total;
    this.frames = frames;
    this.period = period;
    this.type = type;
    this.base = base;
    this.baseTotal = baseTotal;
    this.binaryColors = null;
    this.depth = new Int32Array(n);
    this.self = Float64Array.from(total);
    const childCount = new Int32Array(n);
    let maxDepth = 0;
    for (let i = 1; i < n; i++) {
      const p = parent[i];
      this.depth[i] = this.depth[p] + 1;
      if (this.depth[i] > maxDepth) maxDepth = this.depth[i];
      this.self[p] -= total[i];
      childCount[p]++;
    }
    this.maxDepth = maxDepth;
    this.childStart = new Int32Array(n + 1);
    for (let i = 0; i < n; i++) this.childStart[i + 1] = this.childStart[i] + childCount[i];
    this.childList = new Int32Array(Math.max(n - 1, 0));
    const cursor = this.childStart.slice(0, n);
    for (let i = 1; i < n; i++) this.childList[cursor[parent[i]]++] = i;
  }

  /**
   * Each binary's colour in this view: the binaries by their own samples,
   * the heaviest first, each the next of the palette's 20 colours (past
   * them, colours repeat). Once per tree.
   */
  palette() {
    if (!this.binaryColors) {
      const weights = new Map();
      for (let i = 1; i < this.count; i++) {
        const f = this.frames[this.frame[i]];
        if (binaryKind(f) !== "user") continue;
        weights.set(f.binary, (weights.get(f.binary) || 0) + this.self[i]);
      }
      const ranked = [...weights.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
      this.binaryColors = new Map(
        ranked.map(([binary], i) => [binary, USER_COLORS[i % USER_COLORS.length]]),
      );
    }
    return this.binaryColors;
  }

  /** From the API's flat format: `nodes` as [parent, frame, total] triples. */
  static fromFlat(flat) {
    const n = flat.nodes.length / 3;
    const parent = new Int32Array(n);
    const frame = new Int32Array(n);
    const total = new Float64Array(n);
    const nodes = flat.nodes;
    for (let i = 0, j = 0; i < n; i++, j += 3) {
      parent[i] = nodes[j];
      frame[i] = nodes[j + 1];
      total[i] = nodes[j + 2];
    }
    return new Tree(parent, frame, total, flat.frames, flat.sample_period_nanos, null, 0, flat.profile_type || "cpu");
  }

  /**
   * A differential tree: `current`'s shape and widths, each node with the
   * weight the same path (function and binary per frame) had in `baseline`.
   * Paths only the baseline has are kept with width 0.
   */
  static diff(current, baseline) {
    const frames = [];
    const frameIds = new Map();
    const frameOf = (f) => {
      const key = functionKey(f);
      let id = frameIds.get(key);
      if (id === undefined) {
        id = frames.length;
        frames.push(f);
        frameIds.set(key, id);
      }
      return id;
    };
    const built = new TreeBuilder(frameOf(current.frames[current.frame[0]]));
    built.total[0] = current.total[0];
    built.base[0] = baseline.total[0];
    const add = (tree, weights) => {
      const mapped = new Int32Array(tree.count);
      for (let i = 1; i < tree.count; i++) {
        const m = built.child(mapped[tree.parent[i]], frameOf(tree.frames[tree.frame[i]]));
        weights[m] += tree.total[i];
        mapped[i] = m;
      }
    };
    add(current, built.total);
    add(baseline, built.base);
    return built.tree(frames, current.period, baseline.total[0], current.type);
  }

  children(i) {
    return this.childList.subarray(this.childStart[i], this.childStart[i + 1]);
  }

  name(i) {
    return this.frames[this.frame[i]].name;
  }

  /** Function names from the root's child down to `i`. */
  path(i) {
    const names = [];
    for (let at = i; at !== 0; at = this.parent[at]) names.push(this.name(at));
    return names.reverse();
  }

  /** The node reached from the root through these function names, or -1. */
  find(names) {
    let at = 0;
    for (const name of names) {
      let next = -1;
      for (const child of this.children(at)) {
        if (this.name(child) === name && (next < 0 || this.total[child] > this.total[next])) next = child;
      }
      if (next < 0) return -1;
      at = next;
    }
    return at;
  }

  /**
   * Nodes whose frame `matches` (a predicate on frames): a mark per node and
   * the weight they cover, each stack counted once (a match under a match
   * adds nothing).
   */
  match(matches) {
    const frameHit = new Uint8Array(this.frames.length);
    let any = false;
    this.frames.forEach((f, k) => {
      if (matches(f)) {
        frameHit[k] = 1;
        any = true;
      }
    });
    const hit = new Uint8Array(this.count);
    const covered = new Uint8Array(this.count);
    // Whether the subtree below a node holds a match (for merged blocks).
    const below = new Uint8Array(this.count);
    let weight = 0;
    let count = 0;
    if (!any) return { hit, below, weight, count };
    for (let i = 1; i < this.count; i++) {
      const p = this.parent[i];
      if (frameHit[this.frame[i]]) {
        hit[i] = 1;
        count++;
        if (!covered[p]) weight += this.total[i];
        covered[i] = 1;
      } else {
        covered[i] = covered[p];
      }
    }
    for (let i = this.count - 1; i > 0; i--) {
      if (hit[i] || below[i]) below[this.parent[i]] = 1;
    }
    return { hit, below, weight, count };
  }

  /**
   * Per function (name and binary): self weight, and total weight counting
   * each stack once even when the function recurses.
   */
  functions() {
    // One entry per (name, binary): frames that differ only in file or line
    // are the same function here.
    const stats = [];
    const ids = new Map();
    const statOf = Int32Array.from(this.frames, (f) => {
      const key = functionKey(f);
      let id = ids.get(key);
      if (id === undefined) {
        id = stats.length;
        ids.set(key, id);
        stats.push({ name: f.name, binary: f.binary, self: 0, total: 0 });
      }
      return id;
    });
    // How often each function is on the path from the root to the node.
    const onPath = new Int32Array(stats.length);
    const path = new Int32Array(this.maxDepth + 1);
    let length = 0;
    for (let i = 1; i < this.count; i++) {
      const d = this.depth[i];
      while (length >= d) onPath[path[--length]]--;
      const id = statOf[this.frame[i]];
      const stat = stats[id];
      stat.self += this.self[i];
      if (onPath[id] === 0) stat.total += this.total[i];
      onPath[id]++;
      path[length++] = id;
    }
    return stats.filter((stat) => stat.total > 0);
  }

  /**
   * The sandwich of function `name` (in any binary): `callees`, the calls
   * below it merged into one tree rooted at it, and `callers`, the paths
   * from it up to the root merged into one tree rooted at it (its callers
   * its children, the program's entry its leaves). Each stack counts once:
   * where the function recurses, its outermost call stands for the stack.
   * Null when no node is the function.
   */
  sandwich(name) {
    const outermost = [];
    const inside = new Uint8Array(this.count);
    for (let i = 1; i < this.count; i++) {
      const hit = this.name(i) === name;
      if (hit && !inside[this.parent[i]]) outermost.push(i);
      inside[i] = hit || inside[this.parent[i]] ? 1 : 0;
    }
    if (!outermost.length) return null;
    const root = this.frame[outermost[0]];

    // Callees: every node under an outermost call, in order (parents
    // come before their children), placed under its parent's place.
    const callees = new TreeBuilder(root);
    const placed = new Int32Array(this.count).fill(-1);
    for (const i of outermost) placed[i] = 0;
    for (let i = 1; i < this.count; i++) {
      if (placed[i] !== 0 && placed[this.parent[i]] >= 0) placed[i] = callees.child(placed[this.parent[i]], this.frame[i]);
      if (placed[i] >= 0) callees.total[placed[i]] += this.total[i];
    }

    // Callers: each outermost call's path to the root, innermost first.
    const callers = new TreeBuilder(root);
    for (const i of outermost) {
      const w = this.total[i];
      callers.total[0] += w;
      let at = 0;
      for (let up = this.parent[i]; up !== 0; up = this.parent[up]) {
        at = callers.child(at, this.frame[up]);
        callers.total[at] += w;
      }
    }
    return {
      callers: callers.tree(this.frames, this.period, null, this.type),
      callees: callees.tree(this.frames, this.period, null, this.type),
    };
  }
}

// Colours by binary, so the kernel, JIT code and unknown frames stand out
// from each other and from the binaries of the program.
const KIND_COLORS = {
  kernel: [26, 92, 56],
  jit: [160, 55, 45],
  python: [110, 50, 52],
  unknown: [0, 0, 68],
  vdso: [48, 80, 55],
  group: [270, 45, 70],
  synthetic: [210, 15, 80],
};
// Away from the kernel's orange, the JIT's and Python's greens, so those
// stay apart; each in a light and a deeper shade: 20 colours for the
// binaries of a view, the heaviest first, none shared among them.
const USER_HUES = [200, 280, 236, 324, 60, 218, 302, 258, 345, 84];
const USER_SHADES = [
  [62, 72],
  [48, 58],
];
const USER_COLORS = USER_SHADES.flatMap(([s, l]) => USER_HUES.map((h) => [h, s, l]));

/**
 * A frame's name cut to `fits` characters, keeping the function's own name
 * (what follows the last `::` or `.` outside brackets): the namespace goes
 * first (`…ssManager::run`), and only an own name too long by itself is cut
 * at its end.
 */
export function shortLabel(name, fits) {
  if (name.length <= fits) return name;
  if (fits < 2) return "";
  const own = ownName(name);
  if (own.length <= fits - 1) return `…${name.slice(name.length - (fits - 1))}`;
  return `${own.slice(0, fits - 1)}…`;
}

/** What follows the last `::` or `.` outside <>, () and []. */
function ownName(name) {
  let depth = 0;
  let start = 0;
  for (let i = 0; i < name.length; i++) {
    const c = name[i];
    if (c === "<" || c === "(" || c === "[") depth++;
    else if ((c === ">" || c === ")" || c === "]") && depth > 0) depth--;
    else if (depth === 0 && c === ":" && name[i + 1] === ":") start = ++i + 1;
    else if (depth === 0 && c === ".") start = i + 1;
  }
  return name.slice(start);
}

export function binaryKind(frame) {
  const b = frame.binary;
  if (b === "[kernel]") return "kernel";
  if (b === "[jit]" || b === "[anonymous]") return "jit";
  if (b === "[vdso]") return "vdso";
  if (b === "[python]") return "python";
  if (b === "[group]") return "group";
  if (b === "" ) return "synthetic";
  if (b === "[unknown]" || frame.name.startsWith("[unknown]")) return "unknown";
  return "user";
}

function hash(text) {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return h >>> 0;
}

/**
 * The colour of a frame's binary, as the legend shows it: its kind's
 * (kernel, JIT, Python, ...), or for a binary's own code the one `palette`
 * (see `Tree.palette`) gives it.
 */
export function binaryHsl(frame, palette) {
  const kind = binaryKind(frame);
  if (kind !== "user") return KIND_COLORS[kind];
  return palette?.get(frame.binary) ?? USER_COLORS[hash(frame.binary) % USER_COLORS.length];
}

/** A frame's colour: its binary's, each function a little lighter or darker. */
function frameHsl(frame, palette) {
  const [h, s, l] = binaryHsl(frame, palette);
  switch (binaryKind(frame)) {
    case "unknown":
    case "synthetic":
      return [h, s, l];
    case "user":
      return [h, s, l + (hash(frame.name) % 8) - 4];
    default:
      return [h, s, l + (hash(frame.name) % 10) - 5];
  }
}

export function binaryLegend(frame) {
  const kind = binaryKind(frame);
  return kind === "user" ? frame.binary : `[${kind}]`;
}

const hsl = ([h, s, l]) => `hsl(${h} ${s}% ${l}%)`;

function diffColor(tree, i) {
  const now = tree.total[0] ? tree.total[i] / tree.total[0] : 0;
  const before = tree.baseTotal ? tree.base[i] / tree.baseTotal : 0;
  const delta = now - before;
  const intensity = Math.min(1, Math.abs(delta) / Math.max(now, before, 1e-12));
  if (intensity < 0.02) return "hsl(0 0% 92%)";
  const light = 92 - 42 * intensity;
  return delta > 0 ? `hsl(0 80% ${light}%)` : `hsl(215 80% ${light}%)`;
}

const stripeCache = new Map();

function stripes(ctx, hit) {
  const key = hit ? "hit" : "plain";
  if (!stripeCache.has(key)) {
    const tile = document.createElement("canvas");
    tile.width = tile.height = 6;
    const t = tile.getContext("2d");
    t.fillStyle = hit ? "hsl(292 70% 82%)" : "hsl(0 0% 90%)";
    t.fillRect(0, 0, 6, 6);
    t.strokeStyle = hit ? "hsl(292 80% 55%)" : "hsl(0 0% 72%)";
    t.beginPath();
    t.moveTo(0, 6);
    t.lineTo(6, 0);
    t.stroke();
    stripeCache.set(key, ctx.createPattern(tile, "repeat"));
  }
  return stripeCache.get(key);
}

/** The interactive flamegraph on `canvas`. */
export class Flamegraph {
  constructor(canvas, tooltip, { onZoom, onSelect } = {}) {
    this.canvas = canvas;
    this.tooltip = tooltip;
    this.onZoom = onZoom || (() => {});
    this.onSelect = onSelect || (() => {});
    this.tree = null;
    this.zoom = 0;
    this.icicle = false;
    this.search = null;
    this.highlight = null;
    this.rects = [];
    this.hover = -1;
    this.colors = null;
    /** The node the keyboard is on (-1: none yet). */
    this.focused = -1;
    canvas.addEventListener("mousemove", (e) => this.onMove(e));
    canvas.addEventListener("mouseleave", () => this.hideTooltip());
    canvas.addEventListener("click", (e) => this.onClick(e));
    // Keyboard: Tab to the drawing, arrows move between frames, Enter
    // zooms into the one in focus, Escape zooms out to the root.
    canvas.tabIndex = 0;
    canvas.addEventListener("keydown", (e) => this.onKey(e));
    canvas.addEventListener("blur", () => {
      this.hideTooltip();
      if (this.tree) this.draw();
    });
    new ResizeObserver(() => this.tree && this.draw()).observe(canvas.parentElement);
  }

  setTree(tree) {
    this.tree = tree;
    this.zoom = 0;
    this.focused = -1;
    const palette = tree.palette();
    this.colors = tree.frames.map((f) => hsl(frameHsl(f, palette)));
    this.dim = tree.frames.map((f) => {
      const [h, , l] = frameHsl(f, palette);
      return `hsl(${h} 12% ${Math.min(90, l + 22)}%)`;
    });
    this.search = null;
    this.highlight = null;
  }

  setZoom(node) {
    this.zoom = node;
    this.draw();
    this.onZoom(node);
  }

  setIcicle(icicle) {
    this.icicle = icicle;
    if (this.tree) this.draw();
  }

  /** `matcher`: a predicate on frames, or null; returns the match report. */
  setSearch(matcher) {
    this.search = matcher && this.tree ? this.tree.match(matcher) : null;
    if (this.tree) this.draw();
    return this.search;
  }

  /** Outlines every node of this function (name), or none. */
  setHighlight(name) {
    this.highlight = name && this.tree ? this.tree.match((f) => f.name === name) : null;
    if (this.tree) this.draw();
    return this.highlight;
  }

  /** Lays out what is visible: one rect per drawn frame, merged blocks too. */
  layout(width) {
    const t = this.tree;
    const rects = [];
    // The zoomed node's ancestors, full width: the way back out.
    if (this.zoom !== 0) {
      const chain = [];
      for (let a = t.parent[this.zoom]; ; a = t.parent[a]) {
        chain.push(a);
        if (a === 0) break;
      }
      for (const n of chain.reverse()) rects.push({ node: n, x: 0, w: width, depth: t.depth[n] });
    }
    const scale = t.total[this.zoom] > 0 ? width / t.total[this.zoom] : 0;
    const search = this.search;
    const stack = [this.zoom, 0];
    while (stack.length) {
      const x = stack.pop();
      const i = stack.pop();
      const w = t.total[i] * scale;
      rects.push({ node: i, x, w, depth: t.depth[i] });
      let cx = x;
      let merged = 0;
      let mergedCount = 0;
      let mergedHit = false;
      let mergedWeight = 0;
      for (const c of t.children(i)) {
        const cw = t.total[c] * scale;
        if (cw >= MIN_WIDTH) {
          stack.push(c, cx);
          cx += cw;
        } else if (cw > 0) {
          merged += cw;
          mergedWeight += t.total[c];
          mergedCount++;
          if (search && (search.hit[c] || search.below[c])) mergedHit = true;
        }
      }
      if (merged >= 1) {
        rects.push({ node: -1, parent: i, x: cx, w: merged, depth: t.depth[i] + 1, count: mergedCount, weight: mergedWeight, hit: mergedHit });
      }
    }
    return rects;
  }

  draw() {
    const t = this.tree;
    if (!t) return;
    const started = performance.now();
    const canvas = this.canvas;
    const width = canvas.parentElement.clientWidth || 800;
    const rects = this.layout(width);
    let rows = 1;
    for (const r of rects) rows = Math.max(rows, r.depth + 1);
    const height = rows * ROW;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(Math.min(height, 32000 / ratio) * ratio);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    const charWidth = ctx.measureText("mmmmmmmmmm").width / 10;
    const search = this.search;
    const highlight = this.highlight;
    for (const r of rects) {
      r.y = this.icicle ? r.depth * ROW : height - (r.depth + 1) * ROW;
      if (r.node < 0) {
        // Merged small frames: striped, magenta when a match hides in them.
        r.fill = r.hit ? "merged-match" : "merged";
        ctx.fillStyle = stripes(ctx, r.hit);
        ctx.fillRect(r.x, r.y, Math.max(r.w - 0.5, 0.5), ROW - 1);
        continue;
      }
      const f = t.frame[r.node];
      let color;
      // In a comparison a search keeps its matches' change colours and
      // greys out the rest.
      if (t.base) color = !search || search.hit[r.node] ? diffColor(t, r.node) : SEARCH_MISS;
      else if (!search) color = this.colors[f];
      else color = search.hit[r.node] ? "hsl(292 80% 62%)" : this.dim[f];
      r.fill = color;
      ctx.fillStyle = color;
      ctx.fillRect(r.x, r.y, Math.max(r.w - 0.5, 0.5), ROW - 1);
      if (highlight && highlight.hit[r.node]) {
        ctx.strokeStyle = "#111";
        ctx.lineWidth = 2;
        ctx.strokeRect(r.x + 1, r.y + 1, Math.max(r.w - 2.5, 0.5), ROW - 3);
      }
      if (r.node === this.focused && document.activeElement === canvas) {
        ctx.strokeStyle = "hsl(210 90% 35%)";
        ctx.lineWidth = 3;
        ctx.strokeRect(r.x + 1.5, r.y + 1.5, Math.max(r.w - 3.5, 0.5), ROW - 4);
      }
      if (r.w > charWidth * 3 + 6) {
        const name = t.frames[f].name;
        const fits = Math.floor((r.w - 6) / charWidth);
        ctx.fillStyle = "#1a1a1a";
        ctx.fillText(shortLabel(name, fits), r.x + 3, r.y + ROW / 2);
      }
    }
    this.rects = rects;
    this.lastDrawMs = performance.now() - started;
    this.lastHeight = height;
  }

  rectAt(event) {
    const box = this.canvas.getBoundingClientRect();
    const x = event.clientX - box.left;
    const y = event.clientY - box.top;
    for (let k = this.rects.length - 1; k >= 0; k--) {
      const r = this.rects[k];
      if (y >= r.y && y < r.y + ROW && x >= r.x && x < r.x + r.w) return r;
    }
    return null;
  }

  onClick(event) {
    const r = this.rectAt(event);
    if (!r) return;
    this.setZoom(r.node < 0 ? r.parent : r.node);
    // The head (breadcrumb, search) sticks to the window's top while the
    // panel is in view; a zoomed drawing can be so much shorter that the
    // whole panel went above the window: it is brought back then.
    const head = this.canvas.closest(".flame-panel")?.querySelector(".flame-head");
    if (head && head.getBoundingClientRect().bottom <= 0) head.scrollIntoView({ block: "start" });
    // What is under the pointer now, not the frame that was clicked.
    this.onMove(event);
  }

  /** Arrow keys, Enter and Escape; see the constructor. */
  onKey(event) {
    if (!this.tree) return;
    const t = this.tree;
    const current = this.drawnRect(this.focused) ? this.focused : this.zoom;
    // Deeper is down in an icicle (the root on top), up in a flame graph.
    const deeper = this.icicle ? "ArrowDown" : "ArrowUp";
    const shallower = this.icicle ? "ArrowUp" : "ArrowDown";
    let next;
    switch (event.key) {
      case deeper:
        next = this.widestDrawnChild(current);
        break;
      case shallower:
        next = current === 0 ? current : t.parent[current];
        break;
      case "ArrowLeft":
      case "ArrowRight":
        next = this.drawnNeighbour(current, event.key === "ArrowRight" ? 1 : -1);
        break;
      case "Enter":
        this.setZoom(current);
        next = current;
        break;
      case "Escape":
        this.setZoom(0);
        next = 0;
        break;
      default:
        return;
    }
    event.preventDefault();
    this.focusOn(next);
  }

  /** Puts the keyboard on `node`: outlined, in view, its tooltip shown. */
  focusOn(node) {
    this.focused = node;
    this.draw();
    const r = this.drawnRect(node);
    if (!r) return this.hideTooltip();
    const box = this.canvas.getBoundingClientRect();
    const y = box.top + r.y;
    if (y < 0 || y + ROW > window.innerHeight) window.scrollBy(0, y - window.innerHeight / 2);
    const now = this.canvas.getBoundingClientRect();
    this.showTooltip(r, now.left + r.x + Math.min(r.w / 2, 40), now.top + r.y + ROW / 2);
  }

  drawnRect(node) {
    return node >= 0 ? this.rects.find((r) => r.node === node) || null : null;
  }

  /** The widest drawn child of `node`, or `node` when none is drawn. */
  widestDrawnChild(node) {
    let widest = null;
    for (const r of this.rects) {
      if (r.node >= 0 && r.node !== node && this.tree.parent[r.node] === node && (!widest || r.w > widest.w)) widest = r;
    }
    return widest ? widest.node : node;
  }

  /** The drawn frame beside `node` at its depth (`step` -1: left, 1: right). */
  drawnNeighbour(node, step) {
    const depth = this.tree.depth[node];
    const row = this.rects.filter((r) => r.node >= 0 && r.depth === depth).sort((a, b) => a.x - b.x);
    const at = row.findIndex((r) => r.node === node);
    const next = row[at + step];
    return next ? next.node : node;
  }

  onMove(event) {
    const r = this.rectAt(event);
    if (!r) return this.hideTooltip();
    this.showTooltip(r, event.clientX, event.clientY);
  }

  /** The tooltip of `r`, placed by the point (viewport pixels) it is for. */
  showTooltip(r, clientX, clientY) {
    const t = this.tree;
    const tip = this.tooltip;
    const pct = (w, of) => (of > 0 ? `${((100 * w) / of).toFixed(2)}%` : "–");
    const lines = [];
    if (r.node < 0) {
      lines.push([`${r.count} small frames, merged`, ""]);
      lines.push(["total", `${weight(r.weight, t.period, t.type)}  ${pct(r.weight, t.total[0])} of all`]);
      lines.push(["", `each narrower than ${MIN_WIDTH}px here: click to zoom into their caller`]);
    } else {
      const f = t.frames[t.frame[r.node]];
      const all = t.total[0];
      const zoomTotal = t.total[this.zoom];
      lines.push([f.name, ""]);
      lines.push(["binary", `${f.binary || "–"}${f.file ? `  ${f.file}:${f.line}` : ""}${f.inlined ? " (inlined)" : ""}`]);
      lines.push(["total", `${weight(t.total[r.node], t.period, t.type)}  ${pct(t.total[r.node], all)} of all${this.zoom ? `, ${pct(t.total[r.node], zoomTotal)} of zoom` : ""}`]);
      lines.push(["self", `${weight(t.self[r.node], t.period, t.type)}  ${pct(t.self[r.node], all)} of all`]);
      if (t.base) {
        lines.push(["baseline", `${weight(t.base[r.node], t.period, t.type)}  ${pct(t.base[r.node], t.baseTotal)} of baseline`]);
        // What the colour says, in numbers: the share of all that moved.
        const now = all > 0 ? t.total[r.node] / all : 0;
        const before = t.baseTotal > 0 ? t.base[r.node] / t.baseTotal : 0;
        const points = (100 * (now - before)).toFixed(2);
        lines.push(["change", `${now >= before ? "+" : ""}${points} points of all (${(100 * before).toFixed(2)}% → ${(100 * now).toFixed(2)}%)`]);
      }
    }
    tip.replaceChildren(
      ...lines.map(([k, v], n) => {
        const line = document.createElement("div");
        if (n === 0) {
          line.className = "tip-title";
          line.textContent = k;
        } else {
          const key = document.createElement("span");
          key.className = "tip-key";
          key.textContent = k;
          line.append(key, ` ${v}`);
        }
        return line;
      }),
    );
    tip.hidden = false;
    const box = this.canvas.parentElement.getBoundingClientRect();
    const left = Math.min(clientX - box.left + 14, box.width - tip.offsetWidth - 4);
    tip.style.left = `${Math.max(0, left)}px`;
    // Below the pointer, or above it where the window ends first.
    const below = clientY + 16 + tip.offsetHeight <= window.innerHeight - 4;
    const top = below ? clientY + 16 : Math.max(4, clientY - 8 - tip.offsetHeight);
    tip.style.top = `${top - box.top}px`;
  }

  hideTooltip() {
    this.tooltip.hidden = true;
  }

  /** The visible frames as an SVG document (what is on screen). */
  toSvg(title) {
    const t = this.tree;
    const width = this.canvas.parentElement.clientWidth || 800;
    const height = this.lastHeight || ROW;
    const esc = (s) => s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
    const out = [
      `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height + 24}" font-family="monospace" font-size="12">`,
      `<text x="4" y="16">${esc(title)}</text>`,
      `<g transform="translate(0,24)">`,
    ];
    const ctx = this.canvas.getContext("2d");
    ctx.font = FONT;
    const charWidth = ctx.measureText("mmmmmmmmmm").width / 10;
    for (const r of this.rects) {
      const w = Math.max(r.w - 0.5, 0.5).toFixed(2);
      if (r.node < 0) {
        out.push(`<rect x="${r.x.toFixed(2)}" y="${r.y}" width="${w}" height="${ROW - 1}" fill="#e0e0e0"><title>${r.count} small frames</title></rect>`);
        continue;
      }
      const f = t.frames[t.frame[r.node]];
      const fill = t.base ? diffColor(t, r.node) : hsl(frameHsl(f, t.palette()));
      const share = t.total[0] ? ((100 * t.total[r.node]) / t.total[0]).toFixed(2) : "0";
      const amount = t.type === "cpu" ? `${t.total[r.node]} samples` : weight(t.total[r.node], t.period, t.type);
      out.push(`<g><title>${esc(f.name)} (${esc(f.binary)}): ${amount}, ${share}%</title>`);
      out.push(`<rect x="${r.x.toFixed(2)}" y="${r.y}" width="${w}" height="${ROW - 1}" fill="${fill}"/>`);
      if (r.w > charWidth * 3 + 6) {
        const fits = Math.floor((r.w - 6) / charWidth);
        const name = shortLabel(f.name, fits);
        out.push(`<text x="${(r.x + 3).toFixed(2)}" y="${r.y + 13}">${esc(name)}</text>`);
      }
      out.push("</g>");
    }
    out.push("</g></svg>");
    return out.join("\n");
  }
}

/**
 * What the weights of a profile type an application sent measure, from
 * its Pyroscope id (`memory:alloc_space:bytes:space:bytes`): the sample
 * type and its unit; null for CPU and off-CPU time.
 */
function sentType(type) {
  const parts = type.split(":");
  return parts.length === 5 ? { sample: parts[1], unit: parts[2] } : null;
}

/** A sent type's weight in its unit: time, bytes, or a count of its sample type. */
function sentAmount(w, sent, withName) {
  if (sent.unit === "nanoseconds") return duration(w / 1e9);
  if (sent.unit === "bytes") return bytes(w);
  const count = Math.round(w).toLocaleString("en-US");
  return withName ? `${count} ${sent.sample}` : count;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[i]}`;
}

/**
 * A weight of a profile of `type`: CPU samples, and their CPU time when
 * the sample period is known; off-CPU time (nanoseconds blocked); a sent
 * type's amount in its unit.
 */
export function weight(w, periodNanos, type = "cpu") {
  if (type === "off_cpu") return `${duration((w * (periodNanos || 1)) / 1e9)} off-CPU`;
  const sent = sentType(type);
  if (sent) return sentAmount(w, sent, true);
  const samples = `${Math.round(w).toLocaleString("en-US")} samples`;
  if (!periodNanos) return samples;
  return `${samples} (${duration((w * periodNanos) / 1e9)} CPU)`;
}

/**
 * A weight as a table shows it: the samples counted, or the time off the
 * CPU for an off-CPU profile.
 */
export function amount(w, periodNanos, type = "cpu") {
  if (type === "off_cpu") return duration((w * (periodNanos || 1)) / 1e9);
  const sent = sentType(type);
  if (sent) return sentAmount(w, sent, false);
  return Math.round(w).toLocaleString("en-US");
}

function duration(seconds) {
  if (seconds >= 100) return `${Math.round(seconds).toLocaleString("en-US")} s`;
  if (seconds >= 1) return `${seconds.toFixed(2)} s`;
  return `${(seconds * 1000).toFixed(1)} ms`;
}
