//! The `stackscope` binary against a real collector on 127.0.0.1 (SQLite
//! in a temporary directory) that speaks TLS and asks queries for a token:
//! the CLI verifies the server with `--ca-cert`, sends the token from
//! `--token-file`, and prints labels and the weight over time.

use std::{net::SocketAddr, path::Path, process::Output, sync::Arc};

use stackscope_collector::{
    server::{self, ServerConfig, TlsFiles},
    storage::sqlite::{SqliteOptions, SqliteStorage},
};
use stackscope_proto::v1::{
    ProfileType, PushRequest, Sample, TypedSamples, ingest_client::IngestClient,
};
use stackscope_test_fixtures::{batches::batch, tls::TestPki};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

fn stackscope(grpc_port: u16, pki: &TestPki, token: Option<&Path>, args: &[&str]) -> Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_stackscope"));
    command
        .args(["--collector", &format!("https://localhost:{grpc_port}")])
        .arg("--ca-cert")
        .arg(pki.path("ca.pem"))
        .args(args)
        .env_remove("STACKSCOPE_TOKEN_FILE")
        .env_remove("STACKSCOPE_COLLECTOR");
    if let Some(token) = token {
        command.arg("--token-file").arg(token);
    }
    command.output().expect("running stackscope")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_verifies_the_collector_and_sends_its_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = SqliteStorage::open(&dir.path().join("stackscope.db"), SqliteOptions::default())
        .expect("opening the database");
    let pki = TestPki::new(&["localhost"]);
    let collector = server::start(
        ServerConfig {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_listen: None,
            tls: Some(TlsFiles {
                cert_pem: pki.server_cert_pem.clone().into_bytes(),
                key_pem: pki.server_key_pem.clone().into_bytes(),
            }),
            query_token: Some("r3ader".into()),
            ..ServerConfig::default()
        },
        Arc::new(storage),
    )
    .await
    .expect("starting the collector");
    let port = collector.grpc_addr.port();
    let channel = Channel::from_shared(format!("https://localhost:{port}"))
        .expect("uri")
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&pki.ca_pem))
                .domain_name("localhost"),
        )
        .expect("TLS settings")
        .connect()
        .await
        .expect("connecting over TLS");
    let mut ingest = IngestClient::new(channel);
    ingest
        .push(PushRequest {
            batch: Some(batch(1, "node-a", "redis", 3, 0)),
        })
        .await
        .expect("a push");
    // Off-CPU time alone: 2.5 ms blocked in the same stack.
    let mut blocked = batch(2, "node-a", "redis", 0, 0);
    blocked.typed_samples = vec![TypedSamples {
        r#type: ProfileType::OffCpu as i32,
        period_nanos: 1,
        samples: vec![Sample {
            stack: 0,
            label_set: 0,
            count: 2_500_000,
            sampling_divisor: 0,
        }],
    }];
    ingest
        .push(PushRequest {
            batch: Some(blocked),
        })
        .await
        .expect("a push");

    let token = dir.path().join("token");
    std::fs::write(&token, "r3ader\n").expect("writing the token");
    let labels = ["labels", "--since", "1h"];

    let refused = stackscope(port, &pki, None, &labels);
    assert!(!refused.status.success());
    let error = String::from_utf8_lossy(&refused.stderr);
    assert!(error.contains("Unauthenticated"), "{error}");

    let answered = stackscope(port, &pki, Some(&token), &labels);
    assert!(
        answered.status.success(),
        "{}",
        String::from_utf8_lossy(&answered.stderr)
    );
    let names = String::from_utf8_lossy(&answered.stdout);
    assert!(names.lines().any(|line| line == "comm"), "{names}");

    // `series`: one line per step with samples, summing to the 3 ticks
    // pushed, or with `--type off-cpu` to the nanoseconds blocked.
    let total = |extra: &[&str]| -> u64 {
        let mut args = vec!["series", "--since", "30m", "--step", "1h"];
        args.extend_from_slice(extra);
        let series = stackscope(port, &pki, Some(&token), &args);
        assert!(
            series.status.success(),
            "{}",
            String::from_utf8_lossy(&series.stderr)
        );
        let text = String::from_utf8_lossy(&series.stdout);
        text.lines()
            .map(|line| {
                let (start, weight) = line.split_once(' ').expect("`start weight` lines");
                humantime::parse_rfc3339(start).expect("an RFC 3339 start");
                weight.parse::<u64>().expect("a weight")
            })
            .sum()
    };
    assert_eq!(total(&[]), 3);
    assert_eq!(total(&["--type", "off-cpu"]), 2_500_000);
    let unknown = stackscope(port, &pki, Some(&token), &["series", "--type", "wall"]);
    assert!(!unknown.status.success());
    let error = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        error.contains("type \"wall\": expected cpu, off_cpu or a profile type id"),
        "{error}"
    );
    let types = stackscope(port, &pki, Some(&token), &["types", "--since", "1h"]);
    assert!(
        types.status.success(),
        "{}",
        String::from_utf8_lossy(&types.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&types.stdout), "cpu\noff_cpu\n");

    // Without the CA the server's certificate is not trusted.
    let untrusted = std::process::Command::new(env!("CARGO_BIN_EXE_stackscope"))
        .args(["--collector", &format!("https://localhost:{port}")])
        .args(labels)
        .arg("--token-file")
        .arg(&token)
        .output()
        .expect("running stackscope");
    assert!(!untrusted.status.success());

    collector.shutdown().await.expect("clean shutdown");
}
