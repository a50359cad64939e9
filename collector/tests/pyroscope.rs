//! Pyroscope's APIs on a collector on 127.0.0.1 with a real SQLite file:
//! pprof profiles pushed as the SDKs push them (`push.v1` in protobuf with
//! a gzipped body, `/ingest` with a gzipped pprof, multipart or folded
//! stacks) are stored once, whole or not at all, and read back through
//! the collector's own API and through the querier API in protobuf and
//! JSON, with the same numbers.

#[path = "support/collector.rs"]
mod collector;
#[path = "support/http.rs"]
mod http;

use collector::Fixture;

use std::{io::Write as _, time::SystemTime};

use base64::{Engine as _, engine::general_purpose::STANDARD as BASE64};
use prost::Message as _;
use stackscope_collector::server::ServerConfig;
use stackscope_profile::model::unix_nanos;
use stackscope_proto::{
    pprof,
    pyroscope::{
        push::v1::{PushRequest, RawProfileSeries, RawSample},
        querier::v1 as querier,
        types::v1::LabelPair,
    },
};

const MAX_MESSAGE_BYTES: usize = 256 << 10;
const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
const ALLOC_SPACE: &str = "memory:alloc_space:bytes:space:bytes";
const PERIOD: i64 = 10_000_000;

async fn start(ingest_token: Option<&str>, query_token: Option<&str>) -> Fixture {
    collector::start_with(ServerConfig {
        max_message_bytes: MAX_MESSAGE_BYTES,
        ingest_token: ingest_token.map(str::to_owned),
        query_token: query_token.map(str::to_owned),
        ..ServerConfig::default()
    })
    .await
}

impl Fixture {
    fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::Answer {
        let addr = self.collector.http_addr.expect("HTTP enabled");
        http::request(addr, "POST", path, headers, body)
    }

    fn get(&self, path: &str) -> http::Answer {
        let addr = self.collector.http_addr.expect("HTTP enabled");
        http::request(addr, "GET", path, &[], b"")
    }

    /// A querier call in protobuf: the answer decoded, or the error.
    fn call<T: prost::Message + Default>(
        &self,
        method: &str,
        request: &impl prost::Message,
    ) -> Result<T, (u16, String)> {
        let answer = self.post(
            &format!("/querier.v1.QuerierService/{method}"),
            &[
                ("Content-Type", "application/proto"),
                ("Connect-Protocol-Version", "1"),
            ],
            &request.encode_to_vec(),
        );
        if answer.status != 200 {
            return Err((answer.status, answer.text()));
        }
        assert_eq!(answer.header("content-type"), Some("application/proto"));
        Ok(T::decode(&answer.body[..]).expect("a protobuf answer"))
    }

    /// A querier call in JSON: the answer as JSON.
    fn call_json(&self, method: &str, request: serde_json::Value) -> serde_json::Value {
        let answer = self.post(
            &format!("/querier.v1.QuerierService/{method}"),
            &[("Content-Type", "application/json")],
            request.to_string().as_bytes(),
        );
        assert_eq!(answer.status, 200, "{method}: {}", answer.text());
        assert_eq!(answer.header("content-type"), Some("application/json"));
        serde_json::from_slice(&answer.body).expect("a JSON answer")
    }

    /// Folded stacks of a type and a selection from the collector's own API.
    fn folded(&self, profile_type: &str, matchers: &str) -> Vec<(String, u64)> {
        let answer = self.get(&format!(
            "/api/v1/flamegraph?since=1h&format=folded&type={profile_type}&match={}",
            percent(matchers)
        ));
        assert_eq!(answer.status, 200, "{}", answer.text());
        let mut lines: Vec<(String, u64)> = answer
            .text()
            .lines()
            .map(|line| {
                let (stack, count) = line.rsplit_once(' ').expect("count");
                (stack.to_owned(), count.parse().expect("a number"))
            })
            .collect();
        lines.sort();
        lines
    }

    fn types(&self) -> Vec<String> {
        serde_json::from_slice(&self.get("/api/v1/types?since=1h").body).expect("types")
    }
}

fn percent(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).expect("gzip");
    gz.finish().expect("gzip")
}

/// A stack of a [`profile`]: frames root first, a value per sample type,
/// string labels.
type SentStack<'a> = (&'a [&'a str], &'a [i64], &'a [(&'a str, &'a str)]);

/// A pprof profile as Pyroscope's Python SDK writes one: no mappings, one
/// line per location, functions with file names; `stacks` root first, each
/// with its values (one per sample type) and string labels.
fn profile(
    sample_types: &[(&str, &str)],
    period: (&str, &str, i64),
    stacks: &[SentStack<'_>],
) -> pprof::Profile {
    let mut strings = vec![String::new()];
    let mut string = |s: &str| -> i64 {
        if let Some(i) = strings.iter().position(|x| x == s) {
            return i as i64;
        }
        strings.push(s.to_owned());
        strings.len() as i64 - 1
    };
    let mut functions: Vec<pprof::Function> = Vec::new();
    let mut locations: Vec<pprof::Location> = Vec::new();
    let mut samples = Vec::new();
    for (frames, values, labels) in stacks {
        let mut ids = Vec::new();
        for frame in frames.iter().rev() {
            let name = string(frame);
            let id = match functions.iter().find(|f| f.name == name) {
                Some(f) => f.id,
                None => {
                    let id = functions.len() as u64 + 1;
                    functions.push(pprof::Function {
                        id,
                        name,
                        filename: string("/srv/app.py"),
                        ..Default::default()
                    });
                    locations.push(pprof::Location {
                        id,
                        line: vec![pprof::Line {
                            function_id: id,
                            line: id as i64 * 10,
                        }],
                        ..Default::default()
                    });
                    id
                }
            };
            ids.push(id);
        }
        samples.push(pprof::Sample {
            location_id: ids,
            value: values.to_vec(),
            label: labels
                .iter()
                .map(|(k, v)| pprof::Label {
                    key: string(k),
                    str: string(v),
                    ..Default::default()
                })
                .collect(),
        });
    }
    let sample_type = sample_types
        .iter()
        .map(|(t, u)| pprof::ValueType {
            r#type: string(t),
            unit: string(u),
        })
        .collect();
    let period_type = Some(pprof::ValueType {
        r#type: string(period.0),
        unit: string(period.1),
    });
    pprof::Profile {
        sample_type,
        sample: samples,
        location: locations,
        function: functions,
        string_table: strings,
        period_type,
        period: period.2,
        time_nanos: unix_nanos(SystemTime::now()) - 10_000_000_000,
        duration_nanos: 10_000_000_000,
        ..Default::default()
    }
}

fn cpu_profile() -> pprof::Profile {
    profile(
        &[("cpu", "nanoseconds")],
        ("cpu", "nanoseconds", PERIOD),
        &[
            (&["main", "work", "fib"], &[30 * PERIOD], &[]),
            (&["main", "work"], &[5 * PERIOD], &[]),
            (&["main", "serve"], &[7 * PERIOD], &[("endpoint", "/slow")]),
        ],
    )
}

fn memory_profile() -> pprof::Profile {
    profile(
        &[("alloc_objects", "count"), ("alloc_space", "bytes")],
        ("space", "bytes", 524_288),
        &[
            (&["main", "load"], &[3, 4096], &[]),
            (&["main", "work", "buffer"], &[1, 1 << 20], &[]),
        ],
    )
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(name, value)| LabelPair {
            name: (*name).to_owned(),
            value: (*value).to_owned(),
        })
        .collect()
}

/// A push as the Python SDK sends it: the CPU and memory series.
fn sdk_push(service: &str) -> PushRequest {
    let series = |name: &str, profile: pprof::Profile| RawProfileSeries {
        labels: labels(&[
            ("__name__", name),
            ("service_name", service),
            ("region", "eu"),
            ("otel.scope.name", "com.grafana.pyroscope/python"),
        ]),
        samples: vec![RawSample {
            raw_profile: profile.encode_to_vec(),
            id: "b2a95af0-2018-41fd-97fe-a468a21ed7cd".into(),
        }],
        annotations: Vec::new(),
    };
    PushRequest {
        series: vec![
            series("process_cpu", cpu_profile()),
            series("memory", memory_profile()),
        ],
    }
}

/// Posts a push as the Python SDK does (gzipped protobuf, no Connect
/// headers).
fn push(fixture: &Fixture, request: &PushRequest, headers: &[(&str, &str)]) -> http::Answer {
    let mut all = vec![
        ("Content-Type", "application/proto"),
        ("Content-Encoding", "gzip"),
    ];
    all.extend_from_slice(headers);
    fixture.post(
        "/push.v1.PusherService/Push",
        &all,
        &gzip(&request.encode_to_vec()),
    )
}

fn now_ms() -> i64 {
    unix_nanos(SystemTime::now()) / 1_000_000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_pushes_are_stored_once_and_read_back_through_both_apis() {
    let fixture = start(None, None).await;
    let request = sdk_push("pyapp");
    let answer = push(&fixture, &request, &[]);
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.header("content-type"), Some("application/proto"));
    // The same push sent again (a retry) is stored once.
    assert_eq!(push(&fixture, &request, &[]).status, 200);

    assert_eq!(
        fixture.types(),
        ["cpu", "memory:alloc_objects:count:space:bytes", ALLOC_SPACE]
    );
    // CPU nanoseconds are stored as ticks of the profile's period; labels
    // as the query language has them (`otel.scope.name` sanitized).
    assert_eq!(
        fixture.folded("cpu", r#"service_name="pyapp",otel_scope_name=~".*python""#),
        [
            ("main;serve".to_owned(), 7),
            ("main;work".to_owned(), 5),
            ("main;work;fib".to_owned(), 30)
        ]
    );
    assert_eq!(
        fixture.folded("cpu", r#"endpoint="/slow""#),
        [("main;serve".to_owned(), 7)],
        "a pprof sample's labels are the sample's"
    );
    assert_eq!(
        fixture.folded(ALLOC_SPACE, r#"service_name="pyapp""#),
        [
            ("main;load".to_owned(), 4096),
            ("main;work;buffer".to_owned(), 1 << 20)
        ]
    );

    // The querier, in protobuf.
    let (start, end) = (now_ms() - 3_600_000, now_ms() + 60_000);
    let types: querier::ProfileTypesResponse = fixture
        .call("ProfileTypes", &querier::ProfileTypesRequest { start, end })
        .unwrap();
    let ids: Vec<&str> = types.profile_types.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(
        ids,
        ["memory:alloc_objects:count:space:bytes", ALLOC_SPACE, CPU]
    );
    let cpu = &types.profile_types[2];
    assert_eq!(
        (
            cpu.name.as_str(),
            cpu.sample_type.as_str(),
            cpu.period_unit.as_str()
        ),
        ("process_cpu", "cpu", "nanoseconds")
    );
    let merged: querier::SelectMergeStacktracesResponse = fixture
        .call(
            "SelectMergeStacktraces",
            &querier::SelectMergeStacktracesRequest {
                profile_type_id: CPU.into(),
                label_selector: r#"{service_name="pyapp"}"#.into(),
                start,
                end,
                ..Default::default()
            },
        )
        .unwrap();
    let flamegraph = merged.flamegraph.expect("a flame graph");
    assert_eq!(flamegraph.total, 42 * PERIOD, "ticks back in nanoseconds");
    assert_eq!(flamegraph.max_self, 30 * PERIOD);
    assert_eq!(flamegraph.names, ["total", "main", "serve", "work", "fib"]);
    assert_eq!(
        flamegraph.levels[2].values,
        [0, 7 * PERIOD, 7 * PERIOD, 2, 0, 35 * PERIOD, 5 * PERIOD, 3]
    );

    // The same in JSON, as Grafana's Profiles Drilldown asks: the same
    // numbers (64-bit integers as strings).
    let json = fixture.call_json(
        "SelectMergeStacktraces",
        serde_json::json!({
            "profile_typeID": CPU,
            "labelSelector": "{service_name=\"pyapp\"}",
            "start": start.to_string(),
            "end": end,
            "maxNodes": 16,
        }),
    );
    assert_eq!(json["flamegraph"]["total"], (42 * PERIOD).to_string());
    assert_eq!(
        json["flamegraph"]["names"],
        serde_json::json!(flamegraph.names)
    );

    let values = fixture.call_json(
        "LabelValues",
        serde_json::json!({"name": "service_name", "matchers": ["{}"], "start": start, "end": end}),
    );
    assert_eq!(values, serde_json::json!({"names": ["pyapp"]}));
    let series = fixture.call_json(
        "Series",
        serde_json::json!({
            "labelNames": ["service_name", "__profile_type__"],
            "start": start, "end": end
        }),
    );
    let set = |profile_type: &str| {
        serde_json::json!({"labels": [
            {"name": "__profile_type__", "value": profile_type},
            {"name": "service_name", "value": "pyapp"},
        ]})
    };
    assert_eq!(
        series["labelsSet"],
        serde_json::json!([
            set("memory:alloc_objects:count:space:bytes"),
            set(ALLOC_SPACE),
            set(CPU)
        ])
    );

    // Grouped by a label only some samples have: the others are a group
    // of their own, and nothing is counted twice.
    let by_endpoint: querier::SelectSeriesResponse = fixture
        .call(
            "SelectSeries",
            &querier::SelectSeriesRequest {
                profile_type_id: CPU.into(),
                label_selector: "{}".into(),
                start,
                end,
                step: 15.0,
                group_by: vec!["endpoint".into()],
                ..Default::default()
            },
        )
        .unwrap();
    let sums: Vec<(Vec<LabelPair>, f64)> = by_endpoint
        .series
        .iter()
        .map(|s| (s.labels.clone(), s.points.iter().map(|p| p.value).sum()))
        .collect();
    assert_eq!(
        sums,
        [
            (vec![], (35 * PERIOD) as f64),
            (labels(&[("endpoint", "/slow")]), (7 * PERIOD) as f64)
        ]
    );

    let points: querier::SelectSeriesResponse = fixture
        .call(
            "SelectSeries",
            &querier::SelectSeriesRequest {
                profile_type_id: ALLOC_SPACE.into(),
                label_selector: "{}".into(),
                start,
                end,
                step: 15.0,
                group_by: vec!["service_name".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(points.series.len(), 1);
    assert_eq!(
        points.series[0].labels,
        labels(&[("service_name", "pyapp")])
    );
    let sum: f64 = points.series[0].points.iter().map(|p| p.value).sum();
    assert_eq!(sum, 4096.0 + f64::from(1 << 20));

    let pprof_answer: stackscope_proto::pyroscope::google::v1::Profile = fixture
        .call(
            "SelectMergeProfile",
            &querier::SelectMergeProfileRequest {
                profile_type_id: ALLOC_SPACE.into(),
                label_selector: "{}".into(),
                start,
                end,
                ..Default::default()
            },
        )
        .unwrap();
    let total: i64 = pprof_answer.sample.iter().map(|s| s.value[0]).sum();
    assert_eq!(total, 4096 + (1 << 20));

    // Calls stackscope does not answer say so.
    let err = fixture
        .call::<querier::SelectHeatmapResponse>(
            "SelectHeatmap",
            &querier::SelectHeatmapRequest::default(),
        )
        .unwrap_err();
    assert_eq!(err.0, 501, "{}", err.1);
    assert!(err.1.contains("\"code\":\"unimplemented\""), "{}", err.1);
    let err = fixture
        .call::<querier::ProfileTypesResponse>(
            "NoSuchCall",
            &querier::ProfileTypesRequest::default(),
        )
        .unwrap_err();
    assert_eq!(err.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pushes_are_refused_with_clear_errors_and_store_nothing() {
    let fixture = start(None, None).await;
    let good = cpu_profile();
    let with_profile = |raw: Vec<u8>| PushRequest {
        series: vec![RawProfileSeries {
            labels: labels(&[("__name__", "process_cpu"), ("service_name", "bad")]),
            samples: vec![
                // A good profile first: the bad one after it must take it
                // down too (never a partial store).
                RawSample {
                    raw_profile: good.encode_to_vec(),
                    id: String::new(),
                },
                RawSample {
                    raw_profile: raw,
                    id: String::new(),
                },
            ],
            annotations: Vec::new(),
        }],
    };
    let broken = |edit: &dyn Fn(&mut pprof::Profile)| {
        let mut profile = cpu_profile();
        edit(&mut profile);
        with_profile(profile.encode_to_vec())
    };
    let cases: Vec<(&str, PushRequest, &str)> = vec![
        ("not pprof", with_profile(b"\xff\xff\xff".to_vec()), "pprof"),
        (
            "truncated gzip",
            with_profile(gzip(&good.encode_to_vec())[..20].to_vec()),
            "gzip",
        ),
        (
            "string index out of range",
            broken(&|p| p.function[0].name = 999),
            "string index 999",
        ),
        (
            "values and sample types disagree",
            broken(&|p| p.sample[0].value.push(1)),
            "2 values for 1 sample types",
        ),
        (
            "a location that is not there",
            broken(&|p| p.sample[0].location_id.push(77)),
            "no location has id 77",
        ),
        (
            "no empty string first",
            broken(&|p| p.string_table[0] = "x".into()),
            "empty string",
        ),
        (
            "a profile type id that is not one",
            broken(&|p| {
                let at = p.string_table.len() as i64;
                p.string_table.push("cpu time".into());
                p.sample_type[0].r#type = at;
            }),
            "not a profile type id",
        ),
    ];
    for (what, request, says) in cases {
        let answer = push(&fixture, &request, &[]);
        assert_eq!(answer.status, 400, "{what}: {}", answer.text());
        let error: serde_json::Value = serde_json::from_slice(&answer.body).expect("JSON error");
        assert_eq!(error["code"], "invalid_argument", "{what}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(says), "{what}: {message}");
        assert!(
            message.contains("profile 1"),
            "{what} names the profile: {message}"
        );
    }
    // Bodies that are not pushes.
    let answer = fixture.post(
        "/push.v1.PusherService/Push",
        &[("Content-Type", "application/proto")],
        b"\x0a\xff",
    );
    assert_eq!(answer.status, 400, "{}", answer.text());
    let answer = fixture.post(
        "/push.v1.PusherService/Push",
        &[("Content-Type", "text/plain")],
        b"hello",
    );
    assert_eq!(answer.status, 415, "{}", answer.text());
    // Larger than the collector takes, whole or once decompressed.
    let mut huge = cpu_profile();
    huge.string_table
        .extend((0..MAX_MESSAGE_BYTES / 64).map(|i| format!("{i:064}")));
    let answer = fixture.post(
        "/push.v1.PusherService/Push",
        &[("Content-Type", "application/proto")],
        &with_profile(huge.encode_to_vec()).encode_to_vec(),
    );
    assert_eq!(answer.status, 413, "{}", answer.text());
    // Profiles each within the bound, but not together.
    let mut padded = cpu_profile();
    padded
        .string_table
        .extend((0..MAX_MESSAGE_BYTES / 3 / 64).map(|i| format!("{i:064}")));
    let raw = gzip(&padded.encode_to_vec());
    let many = PushRequest {
        series: vec![RawProfileSeries {
            labels: labels(&[("__name__", "process_cpu"), ("service_name", "many")]),
            samples: (0..4)
                .map(|_| RawSample {
                    raw_profile: raw.clone(),
                    id: String::new(),
                })
                .collect(),
            annotations: Vec::new(),
        }],
    };
    let answer = push(&fixture, &many, &[]);
    assert_eq!(answer.status, 429, "{}", answer.text());
    assert!(
        answer
            .text()
            .contains("profile 2: the request's profiles are larger than"),
        "{}",
        answer.text()
    );
    let bomb = vec![0u8; 4 * MAX_MESSAGE_BYTES];
    let answer = push(&fixture, &with_profile(gzip(&bomb)), &[]);
    assert_eq!(answer.status, 429, "{}", answer.text());
    assert!(answer.text().contains("larger than"), "{}", answer.text());

    // /ingest's own refusals.
    let answer = fixture.post("/ingest?name=%7Bx%3Dy%7D&format=folded", &[], b"main 1\n");
    assert_eq!(answer.status, 400, "{}", answer.text());
    let answer = fixture.post("/ingest?name=app&format=folded", &[], b"main one\n");
    assert_eq!(answer.status, 400, "{}", answer.text());
    let answer = fixture.post("/ingest?name=app&format=trie", &[], b"main 1\n");
    assert_eq!(answer.status, 400, "{}", answer.text());

    // Labels and profiles beyond the bounds.
    let with_labels = |pairs: Vec<LabelPair>, samples: usize| PushRequest {
        series: vec![RawProfileSeries {
            labels: pairs,
            samples: (0..samples)
                .map(|_| RawSample {
                    raw_profile: good.encode_to_vec(),
                    id: String::new(),
                })
                .collect(),
            annotations: Vec::new(),
        }],
    };
    let long = "x".repeat(5000);
    for (what, request, says) in [
        (
            "a label value longer than a string may be",
            with_labels(labels(&[("service_name", &long)]), 1),
            "label service_name has 5012 bytes",
        ),
        (
            "more labels than a set may have",
            with_labels(
                (0..70)
                    .map(|i| LabelPair {
                        name: format!("l{i}"),
                        value: "v".into(),
                    })
                    .collect(),
                1,
            ),
            "70 labels, more than the 64 taken",
        ),
        (
            // Empty profiles cost two bytes each on the wire.
            "more profiles than a request may hold",
            PushRequest {
                series: vec![RawProfileSeries {
                    labels: labels(&[("service_name", "many")]),
                    samples: vec![RawSample::default(); 10_001],
                    annotations: Vec::new(),
                }],
            },
            "10001 profiles, more than the 10000 taken",
        ),
    ] {
        let answer = push(&fixture, &request, &[]);
        assert_eq!(answer.status, 400, "{what}: {}", answer.text());
        assert!(answer.text().contains(says), "{what}: {}", answer.text());
    }
    // Profiles of very different times in one request.
    let mut early = cpu_profile();
    early.time_nanos -= 3_600_000_000_000;
    let spread = PushRequest {
        series: vec![RawProfileSeries {
            labels: labels(&[("__name__", "process_cpu"), ("service_name", "spread")]),
            samples: [cpu_profile(), early]
                .iter()
                .map(|p| RawSample {
                    raw_profile: p.encode_to_vec(),
                    id: String::new(),
                })
                .collect(),
            annotations: Vec::new(),
        }],
    };
    let answer = push(&fixture, &spread, &[]);
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(
        answer.text().contains("span more than 15 minutes"),
        "{}",
        answer.text()
    );
    // CPU samples without a period cannot be counted as ticks.
    let answer = fixture.post(
        "/ingest?name=app&format=folded&sampleRate=2000000000",
        &[],
        b"main 1\n",
    );
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(
        answer.text().contains("need the profile's period"),
        "{}",
        answer.text()
    );

    assert_eq!(fixture.types(), Vec::<String>::new(), "nothing was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_labels_types_and_times_follow_the_collectors_rules() {
    let fixture = start(None, None).await;
    // A label that would be the collector's own once made query-safe.
    let sneaky = PushRequest {
        series: vec![RawProfileSeries {
            labels: labels(&[
                ("__name__", "process_cpu"),
                ("service_name", "sneaky"),
                ("..type__", "memory:alloc_space:bytes:space:bytes"),
            ]),
            samples: vec![RawSample {
                raw_profile: cpu_profile().encode_to_vec(),
                id: String::new(),
            }],
            annotations: Vec::new(),
        }],
    };
    assert_eq!(push(&fixture, &sneaky, &[]).status, 200);
    assert_eq!(fixture.types(), ["cpu"]);
    assert_eq!(
        fixture
            .folded("cpu", r#"service_name="sneaky""#)
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>(),
        42
    );
    // Off-CPU time by its Pyroscope id is the agents' off-CPU type.
    let blocked = profile(
        &[("off_cpu", "nanoseconds")],
        ("off_cpu", "nanoseconds", 1),
        &[(&["main", "wait"], &[2_500_000], &[])],
    );
    let answer = push(
        &fixture,
        &PushRequest {
            series: vec![RawProfileSeries {
                labels: labels(&[("__name__", "off_cpu"), ("service_name", "waiter")]),
                samples: vec![RawSample {
                    raw_profile: blocked.encode_to_vec(),
                    id: String::new(),
                }],
                annotations: Vec::new(),
            }],
        },
        &[],
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        fixture.folded("off_cpu", r#"service_name="waiter""#),
        [("main;wait".to_owned(), 2_500_000)]
    );
    // Two profiles that say nothing of their time, sent apart, are two
    // (the time used is the time they arrived).
    for _ in 0..2 {
        let answer = fixture.post("/ingest?name=timeless&format=folded", &[], b"main 1\n");
        assert_eq!(answer.status, 200, "{}", answer.text());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        fixture.folded("cpu", r#"service_name="timeless""#),
        [("main".to_owned(), 2)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_takes_pprof_multipart_and_folded_profiles() {
    let fixture = start(None, None).await;
    let now = unix_nanos(SystemTime::now()) / 1_000_000_000;
    let window = format!("from={}&until={}", now - 10, now);
    // The Node SDK's: a gzipped pprof body, the name carrying the labels.
    let wall = profile(
        &[("samples", "count"), ("wall", "nanoseconds")],
        ("wall", "nanoseconds", 12_866_000),
        &[
            (&["main", "tick"], &[2, 25_732_000], &[]),
            // Not merged by the SDK: the collector adds them up.
            (&["main", "tick"], &[1, 12_866_000], &[]),
        ],
    );
    let answer = fixture.post(
        &format!(
            "/ingest?format=pprof&{window}&name={}&spyName=nodespy&sampleRate=17",
            percent("nodeapp{region=x,env=test}")
        ),
        &[("Content-Type", "application/octet-stream")],
        &gzip(&wall.encode_to_vec()),
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        fixture.folded(
            "wall:wall:nanoseconds:wall:nanoseconds",
            r#"service_name="nodeapp",env="test""#
        ),
        [("main;tick".to_owned(), 38_598_000)]
    );
    assert_eq!(
        fixture.folded("wall:samples:count:wall:nanoseconds", "{}"),
        [("main;tick".to_owned(), 3)]
    );

    // Older SDKs: the profile as a multipart form's `profile` part.
    let boundary = "xYzZY";
    let mut form = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; \
         filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    form.extend(gzip(&memory_profile().encode_to_vec()));
    form.extend(format!("\r\n--{boundary}--\r\n").into_bytes());
    let answer = fixture.post(
        &format!("/ingest?format=pprof&{window}&name=goapp"),
        &[(
            "Content-Type",
            &format!("multipart/form-data; boundary={boundary}"),
        )],
        &form,
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        fixture.folded(ALLOC_SPACE, r#"service_name="goapp""#),
        [
            ("main;load".to_owned(), 4096),
            ("main;work;buffer".to_owned(), 1 << 20)
        ]
    );

    // Folded stacks: CPU samples at the given rate.
    let answer = fixture.post(
        &format!("/ingest?{window}&name=rbapp.cpu%7Bpod%3Dweb-1%7D&sampleRate=100"),
        &[],
        b"main;work;leaf 9\nmain 1\n",
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        fixture.folded("cpu", r#"service_name="rbapp",pod="web-1""#),
        [("main".to_owned(), 1), ("main;work;leaf".to_owned(), 9)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_need_the_ingest_token_and_queries_the_query_token() {
    let fixture = start(Some("in-s3cret"), Some("q-s3cret")).await;
    assert_eq!(push(&fixture, &sdk_push("a"), &[]).status, 401);
    assert_eq!(
        push(
            &fixture,
            &sdk_push("a"),
            &[("Authorization", "Bearer q-s3cret")]
        )
        .status,
        401,
        "the query token does not push"
    );
    // The Python SDK sends a token as HTTP Basic's password.
    let basic = format!("Basic {}", BASE64.encode("pyroscope:in-s3cret"));
    let answer = push(&fixture, &sdk_push("a"), &[("Authorization", &basic)]);
    assert_eq!(answer.status, 200, "{}", answer.text());

    let request = querier::ProfileTypesRequest {
        start: now_ms() - 3_600_000,
        end: now_ms() + 60_000,
    };
    let answer = fixture.post(
        "/querier.v1.QuerierService/ProfileTypes",
        &[("Content-Type", "application/proto")],
        &request.encode_to_vec(),
    );
    assert_eq!(answer.status, 401);
    let answer = fixture.post(
        "/querier.v1.QuerierService/ProfileTypes",
        &[
            ("Content-Type", "application/proto"),
            ("Authorization", "Bearer q-s3cret"),
        ],
        &request.encode_to_vec(),
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    let types = querier::ProfileTypesResponse::decode(&answer.body[..]).unwrap();
    assert_eq!(types.profile_types.len(), 3);
    // Each token opens its own door only.
    let answer = fixture.post(
        "/querier.v1.QuerierService/ProfileTypes",
        &[
            ("Content-Type", "application/proto"),
            ("Authorization", "Bearer in-s3cret"),
        ],
        &request.encode_to_vec(),
    );
    assert_eq!(answer.status, 401, "the ingest token does not query");
    let answer = fixture.post("/ingest?name=app&format=folded", &[], b"main 1\n");
    assert_eq!(answer.status, 401, "/ingest needs the ingest token");
    let answer = fixture.post(
        "/ingest?name=app&format=folded",
        &[("Authorization", "Bearer in-s3cret")],
        b"main 1\n",
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
}
