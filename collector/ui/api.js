// The collector's HTTP API, as the page uses it: every request carries the
// query token the user gave (kept in localStorage), and every failure
// becomes an ApiError whose message says what to do. Nothing is swallowed:
// callers show the error.

const TOKEN_KEY = "stackscope.token";

export class ApiError extends Error {
  /** status: the HTTP status, or 0 when the collector did not answer. */
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function token() {
  try {
    return localStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

export function setToken(value) {
  try {
    if (value) localStorage.setItem(TOKEN_KEY, value);
    else localStorage.removeItem(TOKEN_KEY);
  } catch {
    // Private windows may refuse storage; the token then lasts the page.
  }
  sessionToken = value;
}

let sessionToken = null;

function headers() {
  const value = sessionToken ?? token();
  // X-Requested-With: the collector then refuses a missing token without an
  // HTTP Basic challenge, which would make the browser show its own
  // password dialog and hold the request; the page asks for the token.
  const sent = { "X-Requested-With": "stackscope-ui" };
  if (value) sent.Authorization = `Bearer ${value}`;
  return sent;
}

/** Whether the collector answers queries without a token. */
export async function answersWithoutToken() {
  const response = await fetch("/api/v1/labels", { headers: { "X-Requested-With": "stackscope-ui" } });
  return response.ok;
}

/** The URL of an API path with query parameters (empty ones left out). */
export function apiUrl(path, params = {}) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") query.set(name, value);
  }
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

/**
 * GETs an API path. `as`: "json" (default), "text" or "blob".
 * Rejects with an ApiError (or an AbortError when `signal` aborts).
 */
export async function get(path, params = {}, { signal, as = "json" } = {}) {
  let response;
  const sent = headers();
  try {
    response = await fetch(apiUrl(path, params), { headers: sent, signal });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(
      0,
      "The collector is unreachable: is stackscope-collector running, and is this page served by it? " +
        `(${err.message})`,
    );
  }
  if (!response.ok) {
    const body = (await response.text().catch(() => "")).trim();
    if (response.status === 401) {
      // A wrong token and a missing one call for different fixes.
      const asked = sent.Authorization
        ? "The collector refused the query token saved in this browser: check it in the Token field above. "
        : "The collector asks for a query token (--query-token-file): enter it in the Token field above. ";
      throw new ApiError(401, asked + (body ? `(${body})` : ""));
    }
    throw new ApiError(
      response.status,
      `${path} answered ${response.status} ${response.statusText}: ${body || "(no message)"}`,
    );
  }
  if (as === "blob") return response.blob();
  if (as === "text") return response.text();
  return response.json();
}
