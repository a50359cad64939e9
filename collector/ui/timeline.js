// Samples over time for the selection (the series API), drawn as bars on a
// canvas; dragging across it chooses a new time range.

const HEIGHT = 90;
const AXIS = 16;

export class Timeline {
  constructor(canvas, { onRange }) {
    this.canvas = canvas;
    this.onRange = onRange;
    this.points = [];
    this.start = 0;
    this.end = 1;
    this.step = 1;
    this.drag = null;
    this.empty = "";
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
      const [a, b] = [Math.min(drag.from, drag.to), Math.max(drag.from, drag.to)];
      this.draw();
      if (b - a < 3) return;
      this.onRange(this.timeAt(a), this.timeAt(b));
    });
    new ResizeObserver(() => this.draw()).observe(canvas.parentElement);
  }

  xOf(event) {
    const box = this.canvas.getBoundingClientRect();
    return Math.max(0, Math.min(box.width, event.clientX - box.left));
  }

  /** Unix seconds at x. */
  timeAt(x) {
    const width = this.canvas.clientWidth || 1;
    return (this.start + ((this.end - this.start) * x) / width) / 1e9;
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
    ctx.strokeStyle = "#999";
    ctx.beginPath();
    ctx.moveTo(0, plot + 0.5);
    ctx.lineTo(width, plot + 0.5);
    ctx.stroke();
    ctx.fillStyle = "#555";
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
      const caption = `max ${Math.round(max).toLocaleString("en-US")} samples / ${stepLabel(this.step)}`;
      this.canvas.dataset.caption = caption;
      ctx.fillText(`${caption} · times in ${zone}`, 4, 2);
    } else {
      delete this.canvas.dataset.caption;
      ctx.fillText(`times in ${zone}`, 4, 2);
    }
    if (this.drag) {
      const [a, b] = [Math.min(this.drag.from, this.drag.to), Math.max(this.drag.from, this.drag.to)];
      ctx.fillStyle = "hsl(210 80% 50% / 0.2)";
      ctx.fillRect(a, 0, b - a, plot);
    }
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

function stepLabel(nanos) {
  const s = nanos / 1e9;
  if (s < 60) return `${Number(s.toFixed(s < 10 ? 1 : 0))}s`;
  if (s < 3600) return `${Math.round(s / 60)}m`;
  return `${Math.round(s / 3600)}h`;
}
