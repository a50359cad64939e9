//! The collector's servers on 127.0.0.1 with a real SQLite file: ingest over
//! gRPC (acknowledged, deduplicated, bad batches refused with nothing
//! stored), queries over gRPC and HTTP, health, and the ingest and query
//! tokens.

use std::{io::Write as _, time::SystemTime};

#[path = "support/collector.rs"]
mod collector;
#[path = "support/http.rs"]
mod http;

use collector::Fixture;

use prost::Message as _;
use stackscope_collector::server::ServerConfig;
use stackscope_profile::{model::unix_nanos, render, tree::CallTree};
use stackscope_proto::v1::{
    Batch, CompressedPushRequest, FlamegraphRequest, Label, LabelMatcher, LabelNamesRequest,
    LabelSet, ProfileType, PushRequest, Sample, Selection, TopFunctionsRequest, TypedSamples,
    ingest_client::IngestClient, label_matcher::Op, query_client::QueryClient,
};
use stackscope_test_fixtures::batches::batch;
use tonic::{Code, transport::Channel};

const MAX_MESSAGE_BYTES: usize = 256 << 10;

async fn start(token: Option<&str>) -> Fixture {
    start_with(ServerConfig {
        ingest_token: token.map(str::to_string),
        ..ServerConfig::default()
    })
    .await
}

/// A collector on free ports with `config`'s tokens and limits.
async fn start_with(config: ServerConfig) -> Fixture {
    collector::start_with(ServerConfig {
        max_message_bytes: MAX_MESSAGE_BYTES,
        ..config
    })
    .await
}

impl Fixture {
    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.collector.grpc_addr))
            .expect("uri")
            .connect()
            .await
            .expect("connecting")
    }

    async fn push(
        &self,
        batch: Batch,
    ) -> Result<stackscope_proto::v1::PushResponse, tonic::Status> {
        IngestClient::new(self.channel().await)
            .max_encoding_message_size(usize::MAX)
            .push(PushRequest { batch: Some(batch) })
            .await
            .map(|r| r.into_inner())
    }

    async fn total(&self, matchers: Vec<LabelMatcher>) -> u64 {
        let response = QueryClient::new(self.channel().await)
            .flamegraph(FlamegraphRequest {
                selection: Some(selection(matchers)),
                min_share: 0.0,
                group_by: String::new(),
            })
            .await
            .expect("flamegraph query")
            .into_inner();
        response.total
    }

    /// GET over plain HTTP/1.1; returns (status, body).
    fn http_get(&self, path: &str) -> (u16, Vec<u8>) {
        self.http_get_with(path, "")
    }

    /// [`Fixture::http_get`] with `headers` (each line ending in CRLF).
    fn http_get_with(&self, path: &str, headers: &str) -> (u16, Vec<u8>) {
        let addr = self.collector.http_addr.expect("HTTP enabled");
        let headers: Vec<(&str, &str)> = headers
            .split("\r\n")
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim(), value.trim()))
            .collect();
        let answer = http::request(addr, "GET", path, &headers, b"");
        (answer.status, answer.body)
    }
}

/// `batch` with a `container_name` label added to its label set.
fn in_container(mut batch: Batch, container: &str) -> Batch {
    let name = batch.strings.len() as u32;
    batch.strings.push("container_name".into());
    batch.strings.push(container.into());
    // "comm" < "container_name": the set stays sorted by name.
    batch.label_sets[0].labels.push(Label {
        name,
        value: name + 1,
    });
    batch
}

async fn grouped(
    fixture: &Fixture,
    matchers: Vec<LabelMatcher>,
    group_by: &str,
) -> Result<stackscope_proto::v1::FlamegraphResponse, tonic::Status> {
    QueryClient::new(fixture.channel().await)
        .flamegraph(FlamegraphRequest {
            selection: Some(selection(matchers)),
            min_share: 0.0,
            group_by: group_by.into(),
        })
        .await
        .map(|r| r.into_inner())
}

fn selection(matchers: Vec<LabelMatcher>) -> Selection {
    Selection {
        start_unix_nanos: unix_nanos(SystemTime::now()) - 3_600_000_000_000,
        end_unix_nanos: unix_nanos(SystemTime::now()) + 60_000_000_000,
        matchers,
        profile_type: String::new(),
    }
}

fn matcher(name: &str, op: Op, value: &str) -> LabelMatcher {
    LabelMatcher {
        name: name.into(),
        op: op as i32,
        value: value.into(),
    }
}

/// Off-CPU samples beside CPU ticks, on the same labels and stacks: gRPC
/// and HTTP answer one type at a time, CPU when none is named, and refuse
/// a type they do not know.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_profile_type_is_queried_apart() {
    let fixture = start(None).await;
    let mut both = batch(1, "node-a", "redis", 30, 5);
    let blocked = |stack, nanos| Sample {
        stack,
        label_set: 0,
        count: nanos,
        sampling_divisor: 0,
    };
    both.typed_samples = vec![TypedSamples {
        r#type: ProfileType::OffCpu as i32,
        period_nanos: 1,
        samples: vec![blocked(0, 4_000_000), blocked(1, 1_000_000)],
    }];
    let stored = fixture.push(both).await.expect("push");
    assert_eq!(stored.samples_stored, 4);
    assert_eq!(fixture.total(vec![]).await, 35, "CPU ticks only");

    let typed = |profile_type: &str| Selection {
        profile_type: profile_type.into(),
        ..selection(vec![])
    };
    let flamegraph = |profile_type: &str| {
        let request = FlamegraphRequest {
            selection: Some(typed(profile_type)),
            min_share: 0.0,
            group_by: String::new(),
        };
        let channel = fixture.channel();
        async move { QueryClient::new(channel.await).flamegraph(request).await }
    };
    let off_cpu = flamegraph("off_cpu").await.expect("off-CPU").into_inner();
    assert_eq!(
        (
            off_cpu.total,
            off_cpu.sample_period_nanos,
            off_cpu.profile_type.as_str()
        ),
        (5_000_000, 1, "off_cpu")
    );
    let cpu = flamegraph("cpu").await.expect("CPU").into_inner();
    assert_eq!(
        (
            cpu.total,
            cpu.sample_period_nanos,
            cpu.profile_type.as_str()
        ),
        (35, 10_101_010, "cpu")
    );
    let unknown = flamegraph("alloc_space")
        .await
        .expect_err("an unknown type");
    assert_eq!(unknown.code(), Code::InvalidArgument);
    assert!(unknown.message().contains("\"alloc_space\""), "{unknown:?}");

    let names = QueryClient::new(fixture.channel().await)
        .label_names(LabelNamesRequest {
            selection: Some(typed("off_cpu")),
        })
        .await
        .expect("label names")
        .into_inner()
        .names;
    assert_eq!(names, ["comm", "node"], "the type is not a label to match");

    let (status, body) = fixture.http_get("/api/v1/flamegraph?format=folded&since=1h&type=off_cpu");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        String::from_utf8(body).expect("UTF-8"),
        "main;[unknown] libfoo.so+0x1a2b 1000000\nmain;work;helper 4000000\n"
    );
    let (status, body) = fixture.http_get("/api/v1/flamegraph?format=folded&since=1h");
    assert_eq!(status, 200);
    assert_eq!(
        String::from_utf8(body).expect("UTF-8"),
        "main;[unknown] libfoo.so+0x1a2b 5\nmain;work;helper 30\n"
    );
    let (status, body) = fixture.http_get("/api/v1/flamegraph?format=folded&since=1h&type=wall");
    assert_eq!(status, 400);
    let message = String::from_utf8_lossy(&body);
    assert!(message.contains("type \"wall\""), "{message}");
}

// Multi-threaded: the HTTP checks use a blocking socket, and the servers
// must keep running on other threads meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_batches_are_counted_once_and_queried_by_label() {
    let fixture = start(None).await;
    let first = fixture
        .push(batch(1, "node-a", "redis", 30, 5))
        .await
        .expect("push");
    assert_eq!((first.samples_stored, first.duplicate), (2, false));
    fixture
        .push(batch(2, "node-b", "nginx", 7, 0))
        .await
        .expect("push");
    // A retry of the first batch (same id) is acknowledged, not counted.
    let retry = fixture
        .push(batch(1, "node-a", "redis", 30, 5))
        .await
        .expect("retry");
    assert_eq!((retry.samples_stored, retry.duplicate), (0, true));

    assert_eq!(fixture.total(vec![]).await, 42);
    assert_eq!(
        fixture
            .total(vec![matcher("comm", Op::Equal, "redis")])
            .await,
        35
    );
    assert_eq!(
        fixture
            .total(vec![matcher("comm", Op::NotEqual, "redis")])
            .await,
        7
    );
    assert_eq!(
        fixture
            .total(vec![matcher("node", Op::Regex, "node-.")])
            .await,
        42
    );
    assert_eq!(
        fixture
            .total(vec![matcher("node", Op::NotRegex, ".*b")])
            .await,
        35
    );
    assert_eq!(fixture.total(vec![matcher("pod", Op::Equal, "x")]).await, 0);

    let top = QueryClient::new(fixture.channel().await)
        .top_functions(TopFunctionsRequest {
            selection: Some(selection(vec![])),
            limit: 3,
        })
        .await
        .expect("top")
        .into_inner();
    let leaders: Vec<(&str, u64, u64)> = top
        .functions
        .iter()
        .map(|f| (f.function.as_str(), f.self_, f.total))
        .collect();
    assert_eq!(
        leaders,
        [
            ("helper", 37, 37),
            ("[unknown] libfoo.so+0x1a2b", 5, 5),
            ("main", 0, 42)
        ]
    );

    let names = QueryClient::new(fixture.channel().await)
        .label_names(LabelNamesRequest {
            selection: Some(selection(vec![])),
        })
        .await
        .expect("label names")
        .into_inner()
        .names;
    assert_eq!(names, ["comm", "node"]);

    // The HTTP API answers the same queries.
    let (status, body) =
        fixture.http_get("/api/v1/flamegraph?format=folded&since=1h&match=comm%3D%22redis%22");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        String::from_utf8(body).expect("UTF-8"),
        "main;[unknown] libfoo.so+0x1a2b 5\nmain;work;helper 30\n"
    );
    // The flat tree the web UI draws: each frame once, and the nodes as
    // [parent, frame, total] in depth-first order.
    let (status, body) =
        fixture.http_get("/api/v1/flamegraph?format=flat&since=1h&match=comm%3D%22redis%22");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let flat: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let frames: Vec<&str> = flat["frames"]
        .as_array()
        .expect("a frame table")
        .iter()
        .map(|frame| frame["name"].as_str().expect("a name"))
        .collect();
    assert_eq!(
        frames,
        [
            "all",
            "main",
            "[unknown] libfoo.so+0x1a2b",
            "work",
            "helper"
        ]
    );
    assert_eq!(
        flat["nodes"],
        serde_json::json!([0, 0, 35, 0, 1, 35, 1, 2, 5, 1, 3, 30, 3, 4, 30])
    );
    assert_eq!(flat["total"], 35);
    assert_eq!(flat["frames"][4]["inlined"], true);
    let (status, body) = fixture.http_get("/api/v1/flamegraph?since=1h");
    assert_eq!(status, 200);
    let svg = String::from_utf8(body).expect("UTF-8");
    assert!(svg.contains("<svg") && svg.contains("helper"), "{svg}");
    let (status, body) = fixture.http_get("/api/v1/callers?since=1h&function=work");
    assert_eq!(status, 200);
    let callers: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        callers,
        serde_json::json!({"function": "work", "self": 0, "total": 37,
            "callers": [{"function": "main", "weight": 37}],
            "callees": [{"function": "helper", "weight": 37}]})
    );
    // redis against nginx: both ran main;work;helper, only redis the
    // unnamed libfoo frame.
    let (status, body) = fixture
        .http_get("/api/v1/diff?since=1h&match=comm%3D%22redis%22&base_match=comm%3D%22nginx%22");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let svg = String::from_utf8(body).expect("UTF-8");
    assert!(
        svg.contains("<svg") && svg.contains("libfoo.so+0x1a2b"),
        "{svg:.300}"
    );
    // The header names both selections once, without the flamegraph
    // title's own "stackscope: " prefix.
    assert!(
        svg.contains(
            ">stackscope diff: {comm=&quot;redis&quot;} against {comm=&quot;nginx&quot;}</text>"
        ),
        "{svg:.300}"
    );
    let (status, body) = fixture.http_get("/api/v1/labels/comm/values?since=1h");
    assert_eq!((status, body), (200, br#"["nginx","redis"]"#.to_vec()));
    let (status, body) = fixture.http_get("/api/v1/flamegraph?match=comm%3Dredis");
    assert_eq!(status, 400);
    assert!(
        String::from_utf8_lossy(&body).starts_with("match: "),
        "{body:?}"
    );
    let (status, body) = fixture.http_get("/api/v1/top?since=forever");
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("since \"forever\""));

    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn bad_batches_are_refused_and_store_nothing() {
    let fixture = start(None).await;
    fixture
        .push(batch(1, "node-a", "redis", 3, 0))
        .await
        .expect("push");

    let mut dangling = batch(2, "node-a", "redis", 100, 0);
    dangling.samples[0].stack = 7;
    let err = fixture
        .push(dangling)
        .await
        .expect_err("dangling stack index");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("stack"), "{}", err.message());

    let mut bad_label = batch(3, "node-a", "redis", 100, 0);
    bad_label.label_sets[0].labels[0].value = 99;
    let err = fixture
        .push(bad_label)
        .await
        .expect_err("dangling string index");
    assert_eq!(err.code(), Code::InvalidArgument);

    let err = IngestClient::new(fixture.channel().await)
        .push(PushRequest { batch: None })
        .await
        .expect_err("missing batch");
    assert_eq!(err.code(), Code::InvalidArgument);

    // Larger than the collector accepts: refused before it is decoded.
    let mut oversized = batch(4, "node-a", "redis", 100, 0);
    oversized.strings.push("x".repeat(MAX_MESSAGE_BYTES));
    let err = fixture.push(oversized).await.expect_err("oversized batch");
    assert!(
        matches!(err.code(), Code::ResourceExhausted | Code::OutOfRange),
        "{err:?}"
    );

    assert_eq!(
        fixture.total(vec![]).await,
        3,
        "only the good batch is stored"
    );
    fixture.collector.shutdown().await.expect("clean shutdown");
}

/// `PushCompressed` as the agent sends it: the encoded request, one zstd
/// frame that states its size.
fn compressed(request: &PushRequest) -> CompressedPushRequest {
    compressed_bytes(&request.encode_to_vec())
}

fn compressed_bytes(bytes: &[u8]) -> CompressedPushRequest {
    CompressedPushRequest {
        zstd_push_request: zstd::bulk::compress(bytes, 3).unwrap().into(),
    }
}

/// `frame` with the content size its header states replaced by `size`,
/// in a field of the same width.
fn restated(frame: &[u8], size: u64) -> Vec<u8> {
    let descriptor = frame[4];
    let single_segment = descriptor & 0x20 != 0;
    let dictionary_id_bytes = [0, 1, 2, 4][usize::from(descriptor & 3)];
    let size_bytes = match descriptor >> 6 {
        0 => usize::from(single_segment),
        1 => 2,
        2 => 4,
        _ => 8,
    };
    let at = 5 + usize::from(!single_segment) + dictionary_id_bytes;
    // A two-byte field holds the size less 256.
    let stored = if size_bytes == 2 { size - 256 } else { size };
    let mut restated = frame.to_vec();
    restated[at..at + size_bytes].copy_from_slice(&stored.to_le_bytes()[..size_bytes]);
    assert_eq!(
        zstd::zstd_safe::get_frame_content_size(&restated).ok(),
        Some(Some(size))
    );
    restated
}

/// Hostile frames that pass the size check: each is refused, nothing of it
/// stored, and no more is allocated for it than its stated size.
#[tokio::test]
async fn frames_that_lie_about_their_size_or_carry_more_are_refused() {
    let fixture = start(None).await;
    let mut client = IngestClient::new(fixture.channel().await);
    let request = PushRequest {
        batch: Some(batch(1, "node-a", "redis", 3, 0)),
    };
    let plain = request.encode_to_vec();
    let frame = zstd::bulk::compress(&plain, 3).unwrap();
    let size = plain.len() as u64;
    let other = zstd::bulk::compress(
        &PushRequest {
            batch: Some(batch(2, "node-a", "redis", 5, 0)),
        }
        .encode_to_vec(),
        3,
    )
    .unwrap();
    // A skippable frame (magic 0x184D2A5?, its length, its bytes) states no
    // content; the real frame after it does.
    let mut skippable_first = vec![0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4];
    skippable_first.extend_from_slice(&frame);
    for (what, frame) in [
        ("two frames", [frame.clone(), other].concat()),
        ("a skippable frame first", skippable_first),
        ("stating less", restated(&frame, size - 1)),
        ("stating more", restated(&frame, size + 1)),
    ] {
        let err = client
            .push_compressed(CompressedPushRequest {
                zstd_push_request: frame.into(),
            })
            .await
            .expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(err.message().contains("nothing stored"), "{what}: {err:?}");
    }
    assert_eq!(fixture.total(vec![]).await, 0, "nothing stored");
    // The same frame, as it was made, is taken.
    let answer = client
        .push_compressed(CompressedPushRequest {
            zstd_push_request: frame.into(),
        })
        .await
        .expect("the frame as made");
    assert_eq!(answer.into_inner().samples_stored, 1);
    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn compressed_pushes_are_stored_once_and_bad_frames_refused_first() {
    let fixture = start(None).await;
    let mut client = IngestClient::new(fixture.channel().await);
    let good = PushRequest {
        batch: Some(batch(1, "node-a", "redis", 3, 0)),
    };
    let answer = client
        .push_compressed(compressed(&good))
        .await
        .expect("push");
    assert_eq!(answer.into_inner().samples_stored, 1, "one sample row");
    // Retried after a lost acknowledgement, as plain or compressed.
    let again = client
        .push_compressed(compressed(&good))
        .await
        .expect("push");
    assert!(again.into_inner().duplicate);
    assert!(
        client
            .push(good)
            .await
            .expect("push")
            .into_inner()
            .duplicate
    );

    // Small on the wire, larger than the collector takes once decompressed:
    // refused from the frame's header, as a plain push of that size is.
    let mut oversized = batch(2, "node-a", "redis", 100, 0);
    oversized.strings.push("x".repeat(MAX_MESSAGE_BYTES));
    let oversized = compressed(&PushRequest {
        batch: Some(oversized),
    });
    assert!(oversized.zstd_push_request.len() < 4096);
    let err = client
        .push_compressed(oversized)
        .await
        .expect_err("oversized");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("--max-batch-bytes"), "{err:?}");

    // A frame that does not state its size: written as a stream.
    let mut stream = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    let request = PushRequest {
        batch: Some(batch(3, "node-a", "redis", 100, 0)),
    }
    .encode_to_vec();
    let (first, second) = request.split_at(request.len() / 2);
    stream.write_all(first).unwrap();
    stream.flush().unwrap();
    stream.write_all(second).unwrap();
    let sizeless = CompressedPushRequest {
        zstd_push_request: stream.finish().unwrap().into(),
    };
    let garbage = CompressedPushRequest {
        zstd_push_request: b"not zstd at all".as_slice().into(),
    };
    // A frame whose content is cut short.
    let mut truncated = compressed(&PushRequest {
        batch: Some(batch(4, "node-a", "redis", 100, 0)),
    });
    let cut = truncated.zstd_push_request.len() - 4;
    truncated.zstd_push_request.truncate(cut);
    for (what, request, says) in [
        ("sizeless", sizeless, "does not state its size"),
        ("garbage", garbage, "not a zstd frame"),
        ("truncated", truncated, "does not decompress"),
        (
            "not a request",
            compressed_bytes(b"\xff\xff\xff"),
            "not a PushRequest",
        ),
        (
            "no batch",
            compressed(&PushRequest { batch: None }),
            "batch is missing",
        ),
    ] {
        let err = client.push_compressed(request).await.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(err.message().contains(says), "{what}: {err:?}");
    }

    assert_eq!(
        fixture.total(vec![]).await,
        3,
        "only the good batch is stored"
    );
    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn ingest_needs_the_token_when_one_is_set_and_health_is_served() {
    let fixture = start(Some("s3cret")).await;
    let err = fixture
        .push(batch(1, "node-a", "redis", 3, 0))
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut request = tonic::Request::new(PushRequest {
        batch: Some(batch(1, "node-a", "redis", 3, 0)),
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer s3cret".parse().expect("header"));
    IngestClient::new(fixture.channel().await)
        .push(request)
        .await
        .expect("push with the token");
    assert_eq!(fixture.total(vec![]).await, 3);

    let health = tonic_health::pb::health_client::HealthClient::new(fixture.channel().await)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "stackscope.v1.Ingest".into(),
        })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_need_the_query_token_and_probes_stay_open() {
    let fixture = start_with(ServerConfig {
        query_token: Some("r3ader".into()),
        ..ServerConfig::default()
    })
    .await;
    // Ingest is the ingest token's business (none set here).
    fixture
        .push(batch(1, "node-a", "redis", 3, 0))
        .await
        .expect("a push needs no query token");

    let names = || LabelNamesRequest {
        selection: Some(selection(vec![])),
    };
    let err = QueryClient::new(fixture.channel().await)
        .label_names(names())
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated);
    let mut request = tonic::Request::new(names());
    request
        .metadata_mut()
        .insert("authorization", "Bearer wrong".parse().expect("header"));
    let err = QueryClient::new(fixture.channel().await)
        .label_names(request)
        .await
        .expect_err("a wrong token");
    assert_eq!(err.code(), Code::Unauthenticated);
    let mut request = tonic::Request::new(names());
    request
        .metadata_mut()
        .insert("authorization", "Bearer r3ader".parse().expect("header"));
    let names = QueryClient::new(fixture.channel().await)
        .label_names(request)
        .await
        .expect("the token opens queries")
        .into_inner()
        .names;
    assert!(names.contains(&"comm".to_string()), "{names:?}");

    // HTTP: Bearer, or Basic with the token as password (browsers ask).
    let path = "/api/v1/labels?since=1h";
    assert_eq!(fixture.http_get(path).0, 401);
    assert_eq!(
        fixture
            .http_get_with(path, "Authorization: Bearer wrong\r\n")
            .0,
        401
    );
    assert_eq!(
        fixture
            .http_get_with(path, "Authorization: Bearer r3ader\r\n")
            .0,
        200
    );
    // "anyone:r3ader"
    assert_eq!(
        fixture
            .http_get_with(path, "Authorization: Basic YW55b25lOnIzYWRlcg==\r\n")
            .0,
        200
    );
    assert_eq!(fixture.http_get("/flamegraph.svg").0, 401);
    // The web UI's files hold no data; the page asks for the token.
    for open in ["/healthz", "/readyz", "/metrics", "/", "/ui/app.js"] {
        assert_eq!(fixture.http_get(open).0, 200, "{open}");
    }

    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_certificate_grpc_and_the_http_api_both_speak_tls() {
    use rustls::pki_types::pem::PemObject as _;
    use stackscope_collector::server::TlsFiles;
    use stackscope_test_fixtures::tls::TestPki;

    let pki = TestPki::new(&["localhost"]);
    let fixture = start_with(ServerConfig {
        tls: Some(TlsFiles {
            cert_pem: pki.server_cert_pem.clone().into_bytes(),
            key_pem: pki.server_key_pem.clone().into_bytes(),
        }),
        ..ServerConfig::default()
    })
    .await;
    let grpc_port = fixture.collector.grpc_addr.port();
    let http_port = fixture.collector.http_addr.expect("HTTP").port();

    // gRPC, verified against the test CA.
    let channel = Channel::from_shared(format!("https://localhost:{grpc_port}"))
        .expect("uri")
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&pki.ca_pem))
                .domain_name("localhost"),
        )
        .expect("TLS settings")
        .connect()
        .await
        .expect("connecting over TLS");
    IngestClient::new(channel.clone())
        .push(PushRequest {
            batch: Some(batch(1, "node-a", "redis", 3, 0)),
        })
        .await
        .expect("a push over TLS");

    // The HTTP API over TLS, with the same certificate.
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(
            rustls::pki_types::CertificateDer::from_pem_slice(pki.ca_pem.as_bytes())
                .expect("the CA's PEM"),
        )
        .expect("the test CA");
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .build()
        .expect("an HTTPS client");
    let response = client
        .get(format!(
            "https://localhost:{http_port}/api/v1/labels?since=1h"
        ))
        .send()
        .await
        .expect("a query over HTTPS");
    assert_eq!(response.status(), 200);
    let body = response.text().await.expect("the body");
    assert!(body.contains("comm"), "{body}");
    // Plain HTTP on the TLS port gets nothing it can use.
    let plain = reqwest::Client::new()
        .get(format!("http://localhost:{http_port}/healthz"))
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());

    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flamegraphs_group_by_a_label_with_a_group_for_samples_without_it() {
    let fixture = start(None).await;
    // web ran main;work;helper 10 times, db the unnamed libfoo frame 4
    // times; cron (outside any container) both, 3 and 2 times.
    fixture
        .push(in_container(batch(1, "node-a", "redis", 10, 0), "web"))
        .await
        .expect("push");
    fixture
        .push(in_container(batch(2, "node-a", "pg", 0, 4), "db"))
        .await
        .expect("push");
    fixture
        .push(batch(3, "node-b", "cron", 3, 2))
        .await
        .expect("push");

    let response = grouped(&fixture, vec![], "container_name")
        .await
        .expect("grouped flamegraph");
    assert_eq!(response.total, 19);
    assert_eq!(response.sample_period_nanos, 10_101_010);
    let mut groups: Vec<(&str, &str, u64)> = response
        .nodes
        .iter()
        .skip(1)
        .filter(|node| node.parent == 0)
        .map(|node| {
            let frame = &response.frames[node.frame_index as usize];
            (frame.function.as_str(), frame.binary.as_str(), node.total)
        })
        .collect();
    groups.sort();
    assert_eq!(
        groups,
        [
            ("container_name (none)", "[group]", 5),
            ("container_name=db", "[group]", 4),
            ("container_name=web", "[group]", 10),
        ]
    );
    // Each group holds its own stacks and nothing else.
    let tree = CallTree::from_proto(&response).expect("consistent tree");
    assert_eq!(
        render::folded(&tree),
        "container_name (none);main;[unknown] libfoo.so+0x1a2b 2\n\
         container_name (none);main;work;helper 3\n\
         container_name=db;main;[unknown] libfoo.so+0x1a2b 4\n\
         container_name=web;main;work;helper 10\n"
    );

    // A matcher on the label narrows the groups; the none group is left
    // out when no selected sample lacks the label.
    let response = grouped(
        &fixture,
        vec![matcher("container_name", Op::Equal, "web")],
        "container_name",
    )
    .await
    .expect("narrowed grouped flamegraph");
    let tree = CallTree::from_proto(&response).expect("consistent tree");
    assert_eq!(
        render::folded(&tree),
        "container_name=web;main;work;helper 10\n"
    );

    let err = grouped(&fixture, vec![], "container-name")
        .await
        .expect_err("not a label name");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("container-name"),
        "{}",
        err.message()
    );

    // Over HTTP: the folded stacks start with the group frame.
    let (status, body) =
        fixture.http_get("/api/v1/flamegraph?format=folded&since=1h&group_by=container_name");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let folded = String::from_utf8(body).expect("UTF-8");
    assert_eq!(folded.lines().count(), 4, "{folded}");
    assert!(
        folded
            .lines()
            .all(|line| line.starts_with("container_name")),
        "{folded}"
    );
    let (status, body) = fixture.http_get("/api/v1/flamegraph?since=1h&group_by=1pod");
    assert_eq!(status, 400);
    assert!(
        String::from_utf8_lossy(&body).contains("\"1pod\""),
        "{body:?}"
    );

    fixture.collector.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouping_by_a_label_with_too_many_values_is_refused() {
    let fixture = start(None).await;
    // One sample in each of 201 containers: one more than the collector
    // groups by.
    let mut many = batch(1, "node-a", "app", 1, 0);
    let name = many.strings.len() as u32;
    many.strings.push("container_name".into());
    let comm = many.label_sets[0].labels[0];
    many.label_sets.clear();
    many.samples.clear();
    for i in 0..201u32 {
        let value = many.strings.len() as u32;
        many.strings.push(format!("c{i}"));
        many.label_sets.push(LabelSet {
            labels: vec![comm, Label { name, value }],
        });
        many.samples.push(Sample {
            stack: 0,
            label_set: i,
            count: 1,
            sampling_divisor: 0,
        });
    }
    fixture.push(many).await.expect("push");

    let err = grouped(&fixture, vec![], "container_name")
        .await
        .expect_err("too many groups");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("201 values") && err.message().contains("narrow"),
        "{}",
        err.message()
    );
    // Narrowing the selection makes it answerable: c1, c10..c19, c100..c199.
    let response = grouped(
        &fixture,
        vec![matcher("container_name", Op::Regex, "c1.*")],
        "container_name",
    )
    .await
    .expect("narrowed");
    assert_eq!(response.total, 111);
    assert_eq!(
        response
            .nodes
            .iter()
            .skip(1)
            .filter(|node| node.parent == 0)
            .count(),
        111
    );
    let (status, body) =
        fixture.http_get("/api/v1/flamegraph?format=folded&since=1h&group_by=container_name");
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));

    fixture.collector.shutdown().await.expect("clean shutdown");
}
