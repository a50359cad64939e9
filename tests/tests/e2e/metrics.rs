//! The agent's and the collector's metrics and health endpoints (root),
//! scraped by a real Prometheus server (Debian's `prometheus`) on
//! 127.0.0.1: the agent samples a fixture and ships to the collector, and
//! Prometheus's own query API must then show what both did (samples,
//! walks, batches sent and stored, storage size, memory), as an operator's
//! dashboard would read it.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use stackscope_test_fixtures::{C_FLAGS, Fixture, RunningProcess, workspace_binary};
use stackscope_tests::{Collector, free_port, http_get, wait_success};

/// A Prometheus server scraping `targets` (job name, `host:port`) every
/// second, killed on drop with its data.
struct Prometheus {
    address: String,
    _process: RunningProcess,
    _data: tempfile::TempDir,
}

impl Prometheus {
    fn scrape(targets: &[(&str, &str)]) -> Self {
        let data = tempfile::tempdir().expect("temp dir");
        let mut config = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n");
        config.push_str("scrape_configs:\n");
        for (job, target) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            ));
        }
        let config_file = data.path().join("prometheus.yml");
        std::fs::write(&config_file, config).expect("writing prometheus.yml");
        let address = format!("127.0.0.1:{}", free_port());
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                data.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("`prometheus` is missing: run `cargo xtask setup` (installs prometheus)");
        let process = RunningProcess::adopt(child);
        let started = Instant::now();
        while http_get(&address, "/-/ready").map(|(status, _)| status) != Some(200) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "prometheus never became ready"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        Self {
            address,
            _process: process,
            _data: data,
        }
    }

    /// The value of an instant PromQL query that has exactly one series.
    fn value(&self, query: &str) -> Option<f64> {
        let encoded: String = query
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let (status, body) = http_get(&self.address, &format!("/api/v1/query?query={encoded}"))?;
        assert_eq!(status, 200, "{query}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON from prometheus");
        let series = answer["data"]["result"].as_array()?;
        match series.as_slice() {
            [one] => one["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// Waits (up to 30 s) until `query` has one series whose value passes
    /// `check`, and returns that value.
    fn wait_for(&self, query: &str, check: impl Fn(f64) -> bool) -> f64 {
        let started = Instant::now();
        loop {
            let value = self.value(query);
            if let Some(value) = value.filter(|&v| check(v)) {
                return value;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{query} stayed at {value:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

#[test]
fn prometheus_scrapes_what_the_agent_and_the_collector_did() {
    stackscope_tests::require_root();
    let _exclusive = stackscope_tests::exclusive();
    let fixture = Fixture::compile("call_chain", C_FLAGS);
    let spinner = fixture.start(&[]);
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());

    let mut agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(["--pid", &spinner.pid().to_string()])
        .args([
            "--frequency",
            "199",
            "--duration",
            "60s",
            "--interval",
            "1s",
        ])
        .args(["--metrics-address", "127.0.0.1:0"])
        .args(["--no-table-cache", "--json", "--log-level", "info"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let agent_pid = agent.id();
    // `metrics=http://127.0.0.1:PORT/metrics` in the agent's log.
    let mut log = BufReader::new(agent.stderr.take().expect("piped stderr")).lines();
    let agent_address = loop {
        let line = log
            .next()
            .expect("the agent exited before serving metrics")
            .expect("reading the agent's log");
        if let Some(rest) = line.split("metrics=http://").nth(1) {
            break rest.split('/').next().expect("host:port").to_string();
        }
    };
    std::thread::spawn(move || for _ in log {});
    let collector_address = collector.http.trim_start_matches("http://").to_string();

    // The probes a kubelet would send. The endpoints answer from the
    // start, on a thread of their own: not ready while the program loads,
    // ready once the run loop turns.
    let loading_until = Instant::now() + Duration::from_secs(120);
    loop {
        match http_get(&agent_address, "/readyz") {
            Some((200, body)) => {
                assert_eq!(body, "ready\n");
                break;
            }
            Some((503, body)) if Instant::now() < loading_until => {
                assert_eq!(body, "not ready\n");
                std::thread::sleep(Duration::from_millis(100));
            }
            other => panic!("the agent's /readyz answered {other:?}"),
        }
    }
    assert_eq!(
        http_get(&agent_address, "/healthz"),
        Some((200, "ok\n".into()))
    );
    assert_eq!(
        http_get(&collector_address, "/readyz"),
        Some((200, "ready\n".into()))
    );

    let prometheus = Prometheus::scrape(&[
        ("agent", agent_address.as_str()),
        ("collector", collector_address.as_str()),
    ]);
    prometheus.wait_for(r#"up{job="agent"}"#, |up| up == 1.0);
    prometheus.wait_for(r#"up{job="collector"}"#, |up| up == 1.0);
    // The agent samples the fixture at 199 Hz and walks its stacks to the
    // root (a shallow chain: nearly every walk).
    prometheus.wait_for(r#"stackscope_agent_ticks_total{outcome="sampled"}"#, |n| {
        n >= 200.0
    });
    let walks = prometheus.wait_for("sum(stackscope_agent_walks_total)", |n| n >= 200.0);
    let to_root = prometheus.value(r#"stackscope_agent_walks_total{end="root"}"#);
    assert!(
        to_root.is_some_and(|n| n >= 0.9 * walks - 5.0),
        "{to_root:?} of about {walks} walks reached the root"
    );
    // Batches go out every second and the collector stores them.
    prometheus.wait_for(
        r#"stackscope_agent_export_batches_total{result="stored"}"#,
        |n| n >= 2.0,
    );
    prometheus.wait_for(
        r#"stackscope_collector_ingest_batches_total{result="stored"}"#,
        |n| n >= 2.0,
    );
    prometheus.wait_for("stackscope_collector_ingest_duration_seconds_count", |n| {
        n >= 2.0
    });
    prometheus.wait_for("stackscope_collector_storage_bytes", |bytes| bytes > 4096.0);
    prometheus.wait_for(r#"process_resident_memory_bytes{job="agent"}"#, |bytes| {
        bytes > 1e6
    });
    assert_eq!(
        prometheus.value(r#"stackscope_agent_samples_lost_total{cause="decode_error"}"#),
        Some(0.0)
    );

    // A query shows up in the collector's latency histogram.
    let (status, _) = http_get(
        &collector_address,
        "/api/v1/flamegraph?since=10m&format=json",
    )
    .expect("the collector answers");
    assert_eq!(status, 200);
    prometheus.wait_for(
        r#"sum(stackscope_collector_query_duration_seconds_count{query="flamegraph",outcome="ok"})"#,
        |n| n >= 1.0,
    );

    // Stopped as a DaemonSet pod is: it finishes and reports.
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agent_pid as i32, libc::SIGTERM) };
    let report = wait_success(agent);
    assert!(
        report["export"]["batches_sent"].as_u64() >= Some(2),
        "{report}"
    );
}
