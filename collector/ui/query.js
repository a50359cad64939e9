// The query bar: label matchers as the API takes them (`comm="x",exe=~".*/y"`)
// with completion of label names and of the values of the label being typed.

/** Splits matcher text at the commas outside quotes. */
export function splitMatchers(text) {
  const parts = [];
  let current = "";
  let quoted = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === "\\" && quoted && i + 1 < text.length) {
      current += c + text[++i];
      continue;
    }
    if (c === '"') quoted = !quoted;
    if (c === "," && !quoted) {
      parts.push(current);
      current = "";
    } else {
      current += c;
    }
  }
  parts.push(current);
  return parts.map((p) => p.trim()).filter((p) => p);
}

const quote = (value) => `"${value.replace(/\\/g, "\\\\").replace(/"/g, '\\"')}"`;

/** The text with `name="value"` in place of any matcher on `name` (none when value is empty). */
export function setMatcher(text, name, value) {
  const kept = splitMatchers(text).filter((m) => !new RegExp(`^${name}\\s*(=~|!~|!=|=)`).test(m));
  if (value) kept.push(`${name}=${quote(value)}`);
  return kept.join(",");
}

/** The value an equality matcher gives `name` in the text, or "". */
export function matcherValue(text, name) {
  for (const m of splitMatchers(text)) {
    const found = new RegExp(`^${name}\\s*=\\s*"((?:[^"\\\\]|\\\\.)*)"$`).exec(m);
    if (found) return found[1].replace(/\\(.)/g, "$1");
  }
  return "";
}

/**
 * The options that contain what is typed (any case), best first: the exact
 * one, then those that start with it, then the rest, each group in the
 * order given. Typing `x` puts `xz` before `pyenv-exec`.
 */
export function rankCompletions(options, typed) {
  const prefix = typed.toLowerCase();
  const groups = [[], [], []];
  for (const option of options) {
    const lower = option.toLowerCase();
    if (lower === prefix) groups[0].push(option);
    else if (lower.startsWith(prefix)) groups[1].push(option);
    else if (lower.includes(prefix)) groups[2].push(option);
  }
  return groups.flat();
}

export class QueryBar {
  /** names(): label names; values(name): its values; onSubmit(text). */
  constructor(input, list, { names, values, onSubmit, onError }) {
    this.input = input;
    this.list = list;
    this.names = names;
    this.values = values;
    this.onSubmit = onSubmit;
    this.onError = onError;
    this.items = [];
    this.active = -1;
    this.request = 0;
    // Not on focus: tabbing through the page must not open a list (and
    // a Tab then take its first entry).
    input.addEventListener("input", () => this.complete());
    input.addEventListener("blur", () => setTimeout(() => this.close(), 150));
    input.addEventListener("keydown", (e) => this.onKey(e));
  }

  onKey(e) {
    const open = !this.list.hidden && this.items.length > 0;
    if (e.key === "ArrowDown" && open) {
      this.active = (this.active + 1) % this.items.length;
      this.render();
      e.preventDefault();
    } else if (e.key === "ArrowUp" && open) {
      this.active = (this.active - 1 + this.items.length) % this.items.length;
      this.render();
      e.preventDefault();
    } else if (e.key === "Tab" && open) {
      // Tab takes the entry chosen with the arrows, else the best one.
      this.accept(this.items[Math.max(this.active, 0)]);
      e.preventDefault();
    } else if (e.key === "Enter" && open && this.active >= 0) {
      // Enter takes an entry only when one was chosen with the arrows;
      // otherwise it runs the query as typed.
      this.accept(this.items[this.active]);
      e.preventDefault();
    } else if (e.key === "Enter") {
      this.close();
      this.onSubmit(this.input.value.trim());
      e.preventDefault();
    } else if (e.key === "Escape") {
      this.close();
    }
  }

  /** What is being typed at the cursor: a label name or a label's value. */
  context() {
    const before = this.input.value.slice(0, this.input.selectionStart ?? this.input.value.length);
    let start = 0;
    let quoted = false;
    for (let i = 0; i < before.length; i++) {
      if (before[i] === "\\" && quoted) i++;
      else if (before[i] === '"') quoted = !quoted;
      else if (before[i] === "," && !quoted) start = i + 1;
    }
    const segment = before.slice(start);
    const lead = segment.length - segment.trimStart().length;
    const value = /^([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"?((?:[^"\\]|\\.)*)$/.exec(segment.trimStart());
    if (value) return { kind: "value", label: value[1], op: value[2], prefix: value[3], start: start + lead };
    if (/^\s*[A-Za-z0-9_]*$/.test(segment)) return { kind: "name", prefix: segment.trim(), start: start + lead };
    return null;
  }

  async complete() {
    const context = this.context();
    const request = ++this.request;
    if (!context) return this.close();
    let options;
    try {
      options = context.kind === "name" ? await this.names() : await this.values(context.label);
    } catch (err) {
      this.onError(err);
      return this.close();
    }
    if (request !== this.request) return;
    this.context_ = context;
    this.items = rankCompletions(options, context.prefix).slice(0, 50);
    // Nothing chosen until the arrows choose: Enter runs what is typed.
    this.active = -1;
    this.render();
  }

  render() {
    if (!this.items.length || document.activeElement !== this.input) return this.close();
    this.list.replaceChildren(
      ...this.items.map((item, k) => {
        const li = document.createElement("li");
        li.textContent = item;
        li.className = k === this.active ? "active" : "";
        li.addEventListener("mousedown", (e) => {
          e.preventDefault();
          this.accept(item);
        });
        return li;
      }),
    );
    this.list.hidden = false;
  }

  accept(item) {
    const context = this.context_;
    const text = this.input.value;
    const cursor = this.input.selectionStart ?? text.length;
    // The rest of the segment after the cursor is replaced too.
    let end = cursor;
    let quoted = context.kind === "value";
    while (end < text.length && (quoted || text[end] !== ",")) {
      if (text[end] === '"') quoted = !quoted;
      end++;
    }
    let insert;
    let caret;
    if (context.kind === "name") {
      insert = `${item}=""`;
      caret = context.start + insert.length - 1;
    } else {
      const value = context.op.includes("~") ? item.replace(/[.*+?^${}()|[\]\\]/g, "\\$&") : item;
      insert = `${context.label}${context.op}${quote(value)}`;
      caret = context.start + insert.length;
    }
    this.input.value = text.slice(0, context.start) + insert + text.slice(end);
    this.input.setSelectionRange(caret, caret);
    this.close();
    // As typing would: the page sees the change, and a name just taken
    // gets its values listed.
    this.input.dispatchEvent(new Event("input"));
  }

  close() {
    this.list.hidden = true;
    this.items = [];
    this.active = -1;
  }
}
