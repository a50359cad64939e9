//! Pyroscope's clients against a real collector: its Python and Node SDKs
//! (PyPI's `pyroscope-io`, npm's `@pyroscope/nodejs`) push profiles the CLI
//! reads by `service_name`, and PyPI's `connectrpc` client, generated from
//! Pyroscope's `.proto` files, asks the querier API what Grafana asks,
//! in protobuf and in JSON, and gets what the collector's own API answers
//! for the same selections, for the agent's CPU profiles and the SDKs'
//! profiles alike. The SDKs and the client are installed from PyPI and npm
//! on first use (`stackscope_tests::sdk`).

use std::{
    collections::BTreeMap,
    path::Path,
    process::{Command, Output, Stdio},
};

use stackscope_test_fixtures::{C_FLAGS, Fixture, fixture_source, http_get, workspace_binary};
use stackscope_tests::{Collector, exclusive, folded, sdk::sdk_clients, wait_success};

const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
const WALL: &str = "wall:wall:nanoseconds:wall:nanoseconds";
const NODE_HEAP: &str = "memory:inuse_space:bytes:inuse_space:bytes";
const INGEST_TOKEN: &str = "sdk-s3cret";

fn check(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A collector that takes pushes with [`INGEST_TOKEN`] only.
fn collector(data: &Path) -> Collector {
    let token = data.join("ingest-token");
    std::fs::write(&token, INGEST_TOKEN).expect("writing the token");
    Collector::start_with(
        data,
        &["--ingest-token-file", token.to_str().expect("UTF-8 path")],
    )
}

/// Runs the Python SDK's application for `seconds`, pushing to `collector`.
fn run_python_app(collector: &Collector, seconds: &str) {
    let clients = sdk_clients();
    let out = Command::new(&clients.python)
        .arg(fixture_source("pyroscope_sdk_app.py"))
        .args([&collector.http, seconds])
        .env("STACKSCOPE_TOKEN", INGEST_TOKEN)
        .output()
        .expect("running the Python SDK's application");
    assert!(check(out, "the Python SDK's application").contains("done"));
}

/// Runs the Node SDK's application for `seconds`, pushing to `collector`.
fn run_node_app(collector: &Collector, seconds: &str) {
    let clients = sdk_clients();
    let out = Command::new("node")
        .arg(fixture_source("pyroscope_sdk_app.js"))
        .args([&collector.http, seconds])
        .env("NODE_PATH", &clients.node_modules)
        .env("STACKSCOPE_TOKEN", INGEST_TOKEN)
        .output()
        .expect("running the Node SDK's application");
    assert!(check(out, "the Node SDK's application").contains("done"));
}

fn weight_under(stacks: &[(String, u64)], path: &str) -> u64 {
    stacks
        .iter()
        .filter(|(stack, _)| stack.contains(path))
        .map(|(_, n)| n)
        .sum()
}

#[test]
fn the_python_and_node_sdks_push_profiles_the_cli_reads_by_service_name() {
    // The applications keep both CPUs busy: not beside a test that samples.
    let _exclusive = exclusive();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = collector(data.path());
    run_python_app(&collector, "4");
    run_node_app(&collector, "4");

    let services = check_cli(&collector, &["labels", "service_name", "--since", "10m"]);
    assert!(
        services.lines().any(|s| s == "pyshop"),
        "CPU services: {services}"
    );
    // The Python SDK's CPU samples are the agents' CPU type.
    let python = collector.folded_stacks(r#"service_name="pyshop",region="eu-west""#);
    let total: u64 = python.iter().map(|(_, n)| n).sum();
    assert!(total >= 100, "{total} ticks of 10 ms in 4 s: {python:#?}");
    let checkout = weight_under(&python, "checkout;price_cart;fib");
    let render = weight_under(&python, "render_page");
    assert!(
        checkout * 100 >= total * 40 && render > 0 && checkout + render >= total * 80 / 100,
        "checkout {checkout}, render_page {render} of {total}: {python:#?}"
    );

    // The Node SDK's wall and heap profiles: types of their own.
    let types = check_cli(
        &collector,
        &[
            "types",
            "--since",
            "10m",
            "--match",
            r#"service_name="nodeshop""#,
        ],
    );
    for wanted in [WALL, "wall:samples:count:wall:nanoseconds", NODE_HEAP] {
        assert!(types.lines().any(|t| t == wanted), "{wanted} in {types}");
    }
    let export = |profile_type: &str| {
        folded(
            check_cli(
                &collector,
                &[
                    "export",
                    "--format",
                    "folded",
                    "--since",
                    "10m",
                    "--type",
                    profile_type,
                    "--match",
                    r#"service_name="nodeshop""#,
                ],
            )
            .as_bytes(),
        )
    };
    let wall = export(WALL);
    let wall_total: u64 = wall.iter().map(|(_, n)| n).sum();
    // The SDK names a function `<file>:<name>:<line>`.
    let reports = weight_under(&wall, ":buildReport:");
    assert!(
        reports * 100 >= wall_total * 25 && weight_under(&wall, ":handleRequest:") >= reports,
        "buildReport {reports} of {wall_total}: {wall:#?}"
    );
    let heap = export(NODE_HEAP);
    let rows = weight_under(&heap, "allocateRows");
    let heap_total: u64 = heap.iter().map(|(_, n)| n).sum();
    eprintln!("node heap: allocateRows keeps {rows} of {heap_total} bytes sampled");
    assert!(rows > 0, "the rows are kept: {heap:#?}");
    collector.stop();
}

fn check_cli(collector: &Collector, args: &[&str]) -> String {
    String::from_utf8(collector.cli(args)).expect("UTF-8")
}

/// What the querier client printed.
struct QuerierAnswer {
    json: serde_json::Value,
    pprof: Vec<u8>,
}

fn ask_querier(
    collector: &Collector,
    codec: &str,
    range_ms: (i64, i64),
    selections: &[(&str, &str)],
    dir: &Path,
) -> QuerierAnswer {
    let clients = sdk_clients();
    let pprof = dir.join(format!("merged-{codec}.pb"));
    let out = Command::new(&clients.python)
        .arg(fixture_source("pyroscope_querier_client.py"))
        .args([
            collector.http.as_str(),
            codec,
            &range_ms.0.to_string(),
            &range_ms.1.to_string(),
        ])
        .arg(&pprof)
        .arg(serde_json::to_string(selections).expect("JSON"))
        .env("PYTHONPATH", &clients.generated)
        .stderr(Stdio::piped())
        .output()
        .expect("running the Connect client");
    let json = check(out, "the Connect client");
    QuerierAnswer {
        json: serde_json::from_str(&json).expect("the client's JSON"),
        pprof: std::fs::read(&pprof).expect("the merged profile"),
    }
}

/// The collector's own answer for a selection: folded stacks of the CLI
/// and the sample period its HTTP API gives.
fn own_answer(
    collector: &Collector,
    profile_type: &str,
    matchers: &str,
) -> (BTreeMap<String, u64>, u64) {
    let name = match profile_type {
        CPU => "cpu",
        other => other,
    };
    let stacks = folded(
        check_cli(
            collector,
            &[
                "export", "--format", "folded", "--since", "10m", "--type", name, "--match",
                matchers,
            ],
        )
        .as_bytes(),
    );
    let address = collector.http.trim_start_matches("http://");
    let query: String = matchers
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (status, body) = http_get(
        address,
        &format!("/api/v1/flamegraph?since=10m&format=flat&type={name}&match={query}"),
    )
    .expect("the HTTP API");
    assert_eq!(status, 200, "{body}");
    let flat: serde_json::Value = serde_json::from_str(&body).expect("flat JSON");
    let period = match profile_type {
        CPU => flat["sample_period_nanos"].as_u64().expect("a period"),
        _ => 1,
    };
    (stacks.into_iter().collect(), period)
}

#[test]
fn the_querier_answers_what_the_collectors_own_api_does_for_agent_and_sdk_profiles() {
    let _exclusive = exclusive();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = collector(data.path());
    let fixture = Fixture::compile("call_chain", C_FLAGS);
    let spinner = fixture.start(&[]);
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(["--pid", &spinner.pid().to_string()])
        .args(["--frequency", "199", "--duration", "4s", "--interval", "2s"])
        .args(["--no-table-cache", "--json"])
        .arg("--token-file")
        .arg(data.path().join("ingest-token"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    run_python_app(&collector, "3");
    wait_success(agent);
    drop(spinner);
    run_node_app(&collector, "3");

    let now_ms = stackscope_profile::model::unix_nanos(std::time::SystemTime::now()) / 1_000_000;
    let range = (now_ms - 600_000, now_ms + 60_000);
    let selections = [
        (CPU, r#"{comm="call_chain"}"#),
        (CPU, r#"{service_name="pyshop"}"#),
        (WALL, r#"{service_name="nodeshop"}"#),
        // The agent at 199 Hz and the SDK at 100 Hz in one answer.
        (CPU, "{}"),
    ];
    let proto = ask_querier(&collector, "proto", range, &selections, data.path());
    let json = ask_querier(&collector, "json", range, &selections, data.path());
    assert_eq!(proto.json, json.json, "protobuf and JSON answers differ");
    assert_eq!(proto.pprof, json.pprof);

    // The types and services the collector's own API lists.
    let own_types = check_cli(&collector, &["types", "--since", "10m"]);
    let mut expected_types: Vec<String> = own_types
        .lines()
        .map(|t| {
            if t == "cpu" {
                CPU.to_owned()
            } else {
                t.to_owned()
            }
        })
        .collect();
    expected_types.sort();
    assert_eq!(
        proto.json["profile_types"],
        serde_json::json!(expected_types)
    );
    let mut services = std::collections::BTreeSet::new();
    for profile_type in own_types.lines() {
        services.extend(
            check_cli(
                &collector,
                &[
                    "labels",
                    "service_name",
                    "--since",
                    "10m",
                    "--type",
                    profile_type,
                ],
            )
            .lines()
            .map(str::to_owned),
        );
    }
    assert!(services.contains("call_chain") && services.contains("pyshop"));
    assert_eq!(proto.json["service_names"], serde_json::json!(services));

    // Every flame graph is the collector's own tree, in the type's unit;
    // the mixed one, each source's at its own period.
    let mut mixed: BTreeMap<String, u64> = BTreeMap::new();
    for (index, (profile_type, selector)) in selections.iter().enumerate() {
        let matchers = selector.trim_start_matches('{').trim_end_matches('}');
        let expected: BTreeMap<String, u64> = if matchers.is_empty() {
            std::mem::take(&mut mixed)
        } else {
            let (stacks, period) = own_answer(&collector, profile_type, matchers);
            let expected: BTreeMap<String, u64> = stacks
                .iter()
                .map(|(s, n)| (s.clone(), n * period))
                .collect();
            if *profile_type == CPU {
                for (stack, n) in &expected {
                    *mixed.entry(stack.clone()).or_default() += n;
                }
            }
            expected
        };
        let answered = &proto.json["flamegraphs"][index];
        let got: BTreeMap<String, u64> =
            serde_json::from_value(answered["stacks"].clone()).expect("stacks");
        assert!(!expected.is_empty(), "{selector}: no samples");
        assert_eq!(got, expected, "{profile_type} {selector}");
        let total: u64 = expected.values().sum();
        assert_eq!(answered["total"], total, "{selector}");
        assert_eq!(
            proto.json["series"][index]["sum"], total as f64,
            "{selector}"
        );
    }

    // The merged profile as `go tool pprof` reads it: the agent's `c`.
    let file = data.path().join("merged.pb");
    std::fs::write(&file, &proto.pprof).expect("writing the profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(&file)
        .env("HOME", data.path())
        .env("GOCACHE", data.path().join("gocache"))
        .output()
        .expect("`go` is missing: run `cargo xtask setup` (installs golang-go)");
    let top = check(out, "go tool pprof");
    let first = top
        .lines()
        .skip_while(|line| !line.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(first.trim_end().ends_with(" c"), "{top}");
    collector.stop();
}
