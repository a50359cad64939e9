// Samples over time for the selection (the series API), drawn as bars on a
// canvas; dragging across it chooses a new time range, out to whole bars:
// a bar is the finest the data is summed in, so a range that cut one would
// be widened by the query anyway, and silently.

import { weight } from "./flamegraph.js";

const HEIGHT = 90;
const AXIS = 16;

export class Timeline {
  constructor(canvas, { onRange }) {
    this.canvas = canvas;
    this.onRange = onRange;
    // The profile type the weights are of (the caption's unit).
    this.type = "cpu";
    this.points = [];
    this.start = 0;
    this.end = 1;
    this.step = 1;
    this.drag = null;
    this.empty = "";
    /** The baseline's range in unix nanoseconds, when comparing. */
    this.baseline = null;
    canvas.addEventListener("mousedown", (e) => {
      this.drag = { from: this.xOf(e), to: this.xOf(e) };
      e.preventDefault();
    });
    window.addEventListener("mousemove", (e) => {
      if (!this.drag) return;
      this.drag.to = this.xOf(e);
      this.draw();
    });
    window.addEventListener("mouseup", () => {
      const drag = this.drag;
      this.drag = null;
      if (!drag) return;
      this.draw();
      if (Math.abs(drag.to - drag.from) < 3) return;
      const [from, to] = this.snapped(drag);
      this.onRange(Math.round(from / 1e9), Math.round(to / 1e9));
    });
    new ResizeObserver(() => this.draw()).observe(canvas.parentElement);
  }

  xOf(event) {
    const box = this.canvas.getBoundingClientRect();
    return Math.max(0, Math.min(box.width, event.clientX - box.left));
  }

  /** Unix nanoseconds at x. */
  timeAt(x) {
    const width = this.canvas.clientWidth || 1;
    return this.start + ((this.end - this.start) * x) / width;
  }

  /** x of unix nanoseconds `t`. */
  xAt(t) {
    const width = this.canvas.clientWidth || 1;
    return ((t - this.start) / Math.max(this.end - this.start, 1)) * width;
  }

  /**
   * A drag's range in unix nanoseconds, out to the edges of the bars it
   * touches (bars start at multiples of the step, as the series API
   * aligns them).
   */
  snapped(drag) {
    const [a, b] = [Math.min(drag.from, drag.to), Math.max(drag.from, drag.to)];
    const step = this.step;
    const from = Math.floor(this.timeAt(a) / step) * step;
    const to = Math.max(Math.ceil(this.timeAt(b) / step) * step, from + step);
    return [from, to];
  }

  /**
   * points: [{start_unix_nanos, weight}]; the range in nanoseconds; what to
   * say while there are no points.
   */
  set(points, stepNanos, startNanos, endNanos, empty = "no samples in this range") {
    this.empty = empty;
    this.points = points;
    this.step = stepNanos;
    this.start = startNanos;
    this.end = endNanos;
    this.draw();
  }

  /** Marks the baseline's range ([start, end] in unix nanoseconds), or none. */
  setBaseline(range) {
    this.baseline = range;
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const width = canvas.parentElement.clientWidth || 800;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(HEIGHT * ratio);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${HEIGHT}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, HEIGHT);
    const span = Math.max(this.end - this.start, 1);
    const plot = HEIGHT - AXIS;
    // The page's theme, as its style sheet says it.
    const style = getComputedStyle(canvas);
    this.colors = {
      text: style.getPropertyValue("--canvas-text").trim() || "#555",
      axis: style.getPropertyValue("--canvas-axis").trim() || "#999",
      baseline: style.getPropertyValue("--canvas-baseline").trim() || "hsl(35 90% 30%)",
    };
    // Bars of buckets that start before the range are partly off the left
    // edge; the caption's max is of the bars in view.
    const visible = this.points.filter((p) => p.start_unix_nanos + this.step > this.start && p.start_unix_nanos < this.end);
    const max = visible.reduce((m, p) => Math.max(m, p.weight), 0);
    ctx.fillStyle = "hsl(210 60% 55%)";
    for (const p of this.points) {
      const x = ((p.start_unix_nanos - this.start) / span) * width;
      const w = Math.max((this.step / span) * width - 1, 1);
      const h = max ? (p.weight / max) * (plot - 4) : 0;
      ctx.fillRect(x, plot - h, w, h);
    }
    ctx.strokeStyle = this.colors.axis;
    ctx.beginPath();
    ctx.moveTo(0, plot + 0.5);
    ctx.lineTo(width, plot + 0.5);
    ctx.stroke();
    ctx.fillStyle = this.colors.text;
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    const ticks = Math.max(2, Math.floor(width / 140));
    for (let k = 0; k <= ticks; k++) {
      const x = (k / ticks) * width;
      const label = timeLabel(this.start + (k / ticks) * span, span);
      const w = ctx.measureText(label).width;
      ctx.fillText(label, Math.min(Math.max(x - w / 2, 0), width - w), plot + 3);
    }
    if (!this.points.length) {
      ctx.textBaseline = "middle";
      ctx.fillText(this.empty, 8, plot / 2);
    }
    // The axis's time zone (its labels are local times), with the
    // caption at the top left: the right end is the newest bar's.
    ctx.textBaseline = "top";
    const zone = utcOffset(new Date(this.end / 1e6));
    this.canvas.dataset.zone = zone;
    if (max) {
      const caption = `max ${this.type === "cpu" ? `${Math.round(max).toLocaleString("en-US")} samples` : weight(max, 1, this.type)} / ${stepLabel(this.step)}`;
      this.canvas.dataset.caption = caption;
      ctx.fillText(`${caption} · times in ${zone}`, 4, 2);
    } else {
      delete this.canvas.dataset.caption;
      ctx.fillText(`times in ${zone}`, 4, 2);
    }
    this.drawBaseline(ctx, width, plot, span);
    if (this.drag) {
      const [from, to] = this.snapped(this.drag);
      const [a, b] = [this.xAt(from), this.xAt(to)];
      ctx.fillStyle = "hsl(210 80% 50% / 0.2)";
      ctx.fillRect(a, 0, b - a, plot);
      // What the range will be, at the highlight's top.
      ctx.fillStyle = this.colors.text;
      ctx.textBaseline = "top";
      const label = `${timeLabel(from, span)} – ${timeLabel(to, span)}`;
      const w = ctx.measureText(label).width;
      ctx.fillText(label, Math.min(Math.max(a + 2, 0), width - w), 16);
    }
  }

  /**
   * The baseline's range: a band where it is in view, else an arrow at the
   * edge it lies beyond, with its times (`dataset.baseline` says which).
   */
  drawBaseline(ctx, width, plot, span) {
    if (!this.baseline) {
      delete this.canvas.dataset.baseline;
      return;
    }
    const [from, to] = this.baseline;
    const labelSpan = Math.max(to - from, span);
    const times = `${timeLabel(from, labelSpan)} – ${timeLabel(to, labelSpan)}`;
    const [a, b] = [Math.max(this.xAt(from), 0), Math.min(this.xAt(to), width)];
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "bottom";
    let where;
    let label;
    if (b > a) {
      where = "in view";
      label = `baseline ${times}`;
      ctx.fillStyle = "hsl(35 90% 55% / 0.15)";
      ctx.fillRect(a, 0, b - a, plot);
      ctx.fillStyle = "hsl(35 90% 45%)";
      ctx.fillRect(a, plot - 3, b - a, 3);
    } else if (to <= this.start) {
      where = "before";
      label = `◀ baseline ${times}`;
    } else {
      where = "after";
      label = `baseline ${times} ▶`;
    }
    ctx.fillStyle = this.colors.baseline;
    const w = ctx.measureText(label).width;
    const x = where === "after" ? width - w - 4 : where === "before" ? 4 : Math.min(Math.max(a + 4, 4), width - w - 4);
    ctx.fillText(label, x, plot - 4);
    this.canvas.dataset.baseline = `${where}: ${label}`;
  }

}

const pad = (n) => String(n).padStart(2, "0");

function timeLabel(nanos, span) {
  const d = new Date(nanos / 1e6);
  const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  if (span <= 3600e9 * 2) return `${hm}:${pad(d.getSeconds())}`;
  if (span <= 86400e9 * 2) return hm;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hm}`;
}

/** The browser's offset from UTC at `date`, as `UTC+01:00`. */
export function utcOffset(date) {
  const minutes = -date.getTimezoneOffset();
  const sign = minutes < 0 ? "-" : "+";
  const abs = Math.abs(minutes);
  return `UTC${sign}${pad(Math.floor(abs / 60))}:${pad(abs % 60)}`;
}

/** A time as the page writes it everywhere: local, `2026-11-28 09:30:00`. */
export function localTime(seconds) {
  const d = new Date(seconds * 1000);
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`
  );
}

/** A bar's width, exactly: `1h 41m`, not a rounded `2h` (a bar holds whole storage buckets). */
function stepLabel(nanos) {
  const s = nanos / 1e9;
  if (s < 60) return `${Number(s.toFixed(s < 10 ? 1 : 0))}s`;
  let rest = Math.round(s);
  const parts = [];
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]]) {
    const count = Math.floor(rest / size);
    if (count) parts.push(`${count}${unit}`);
    rest -= count * size;
  }
  return parts.join(" ");
}
