"""A current ClickHouse engine behind ClickHouse's HTTP interface, for the
collector's tests: chdb (PyPI) embeds a current ClickHouse; this serves the
part of the HTTP interface the collector's client speaks, so every statement
the storage engine sends runs on that engine unchanged.

* A statement in the body: run, its answer (in the statement's own FORMAT,
  else TabSeparated, as the HTTP interface answers) sent back.
* `INSERT INTO table (columns) FORMAT RowBinary` in the `query` parameter
  with the rows in the body: the rows go through a file, read back with the
  table's own column types.
* Other parameters are settings: each applied with SET when it changes
  (the client sends the same ones every time; `wait_end_of_query` is the
  HTTP layer's own).
* An error: HTTP 500 with ClickHouse's message.

Usage: chdb_http.py PORT DATA_DIR; prints "ready" once it listens.
"""

import http.server
import os
import re
import sys
import tempfile
import threading
import urllib.parse

from chdb import session

HTTP_ONLY = {"query", "wait_end_of_query"}
INSERT = re.compile(r"^INSERT INTO (\S+) \(([^)]*)\) FORMAT RowBinary$")

port, data_dir = int(sys.argv[1]), sys.argv[2]
engine = session.Session(os.path.join(data_dir, "db"))
# One statement at a time: a session is not shared between threads.
lock = threading.Lock()
# The settings the session has now: the client sends the same ones with
# every request, and a SET is a statement of its own.
applied = {}


def quoted(value):
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def column_types(table):
    database, name = table.split(".", 1)
    answer = engine.query(
        f"SELECT name, type FROM system.columns WHERE database = {quoted(database)} "
        f"AND table = {quoted(name)} FORMAT TabSeparated"
    ).bytes()
    return dict(line.split("\t", 1) for line in answer.decode().splitlines())


def insert(statement, rows):
    match = INSERT.match(statement)
    if not match:
        raise ValueError(f"not an insert this server takes: {statement}")
    table, columns = match.group(1), [c.strip() for c in match.group(2).split(",")]
    types = column_types(table)
    structure = ", ".join(f"{column} {types[column]}" for column in columns)
    with tempfile.NamedTemporaryFile(dir=data_dir, suffix=".bin") as file:
        file.write(rows)
        file.flush()
        engine.query(
            f"INSERT INTO {table} ({', '.join(columns)}) "
            f"SELECT * FROM file({quoted(file.name)}, 'RowBinary', {quoted(structure)})"
        )


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go in two writes: with Nagle's algorithm the second
    # waits for the client's delayed ACK (about 40 ms a request).
    disable_nagle_algorithm = True

    def do_POST(self):
        params = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            with lock:
                for name, values in params.items():
                    if name not in HTTP_ONLY and applied.get(name) != values[-1]:
                        engine.query(f"SET {name} = {quoted(values[-1])}")
                        applied[name] = values[-1]
                if "query" in params:
                    insert(params["query"][-1], body)
                    answer = b""
                else:
                    answer = engine.query(body.decode(), "TabSeparated").bytes()
            self.answer(200, answer)
        except Exception as error:  # noqa: BLE001 - every failure is the client's answer
            self.answer(500, str(error).encode())

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
print("ready", flush=True)
server.serve_forever()
