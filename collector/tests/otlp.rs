//! OTLP profiles (alpha) into a collector on 127.0.0.1 with a real SQLite
//! file: an export as OpenTelemetry's generated client sends it, over gRPC
//! and over HTTP, stored once per export with the resource's attributes as
//! labels and read back through the collector's API; bad exports refused
//! with nothing stored; the ingest token.

#[path = "support/collector.rs"]
mod collector;
#[path = "support/http.rs"]
mod http;

use collector::Fixture;

use std::time::SystemTime;

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::{
        ExportProfilesServiceRequest, profiles_service_client::ProfilesServiceClient,
    },
    common::v1::{AnyValue, KeyValue, any_value::Value},
    profiles::v1development::{
        Function, KeyValueAndUnit, Line, Location, Profile, ProfilesDictionary, ResourceProfiles,
        Sample, ScopeProfiles, Stack, ValueType,
    },
    resource::v1::Resource,
};
use prost::Message as _;
use stackscope_collector::server::ServerConfig;
use stackscope_profile::model::unix_nanos;
use tonic::metadata::MetadataValue;

const PERIOD: i64 = 50_000_000;

async fn start(ingest_token: Option<&str>) -> Fixture {
    collector::start_with(ServerConfig {
        ingest_token: ingest_token.map(str::to_owned),
        ..ServerConfig::default()
    })
    .await
}

impl Fixture {
    fn folded(&self, profile_type: &str, matchers: &str) -> Vec<String> {
        let query: String = matchers
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        let answer = http::request(
            self.collector.http_addr.expect("HTTP"),
            "GET",
            &format!("/api/v1/flamegraph?since=1h&format=folded&type={profile_type}&match={query}"),
            &[],
            b"",
        );
        assert_eq!(answer.status, 200, "{}", answer.text());
        let mut lines: Vec<String> = answer.text().lines().map(str::to_owned).collect();
        lines.sort();
        lines
    }

    async fn client(&self) -> ProfilesServiceClient<tonic::transport::Channel> {
        ProfilesServiceClient::connect(format!("http://{}", self.collector.grpc_addr))
            .await
            .expect("connecting")
    }
}

fn string_value(s: &str) -> Option<AnyValue> {
    Some(AnyValue {
        value: Some(Value::StringValue(s.to_owned())),
    })
}

/// An export as OpenTelemetry's eBPF profiler shapes one: the shared
/// dictionary (index 0 of each table the "not set" entry), one process
/// resource, a CPU profile counting samples of `PERIOD` with a sample
/// attribute, and a second profile (allocations) in the same scope.
fn export(service: &str) -> ExportProfilesServiceRequest {
    let strings: Vec<String> = [
        "",
        "samples",
        "count",
        "cpu",
        "nanoseconds",
        "main",
        "work",
        "leaf",
        "/srv/app.c",
        "thread.name",
        "worker-1",
        "alloc_space",
        "bytes",
        "space",
    ]
    .map(str::to_owned)
    .to_vec();
    let function = |name: i32| Function {
        name_strindex: name,
        filename_strindex: 8,
        ..Default::default()
    };
    let location = |function: i32, line: i64| Location {
        lines: vec![Line {
            function_index: function,
            line,
            column: 0,
        }],
        ..Default::default()
    };
    let dictionary = ProfilesDictionary {
        string_table: strings,
        function_table: vec![Function::default(), function(5), function(6), function(7)],
        location_table: vec![
            Location::default(),
            location(1, 10),
            location(2, 20),
            location(3, 30),
        ],
        // Leaf first.
        stack_table: vec![
            Stack::default(),
            Stack {
                location_indices: vec![3, 2, 1],
            },
            Stack {
                location_indices: vec![2, 1],
            },
        ],
        attribute_table: vec![
            KeyValueAndUnit::default(),
            KeyValueAndUnit {
                key_strindex: 9,
                value: Some(AnyValue {
                    value: Some(Value::StringValueStrindex(10)),
                }),
                unit_strindex: 0,
            },
        ],
        ..Default::default()
    };
    let now = unix_nanos(SystemTime::now()) as u64;
    let cpu = Profile {
        sample_type: Some(ValueType {
            type_strindex: 1,
            unit_strindex: 2,
        }),
        period_type: Some(ValueType {
            type_strindex: 3,
            unit_strindex: 4,
        }),
        period: PERIOD,
        time_unix_nano: now - 10_000_000_000,
        duration_nano: 10_000_000_000,
        samples: vec![
            Sample {
                stack_index: 1,
                values: vec![4, 2],
                attribute_indices: vec![1],
                ..Default::default()
            },
            // Values as timestamps alone: one event each.
            Sample {
                stack_index: 2,
                timestamps_unix_nano: vec![now - 5, now - 4, now - 3],
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let allocations = Profile {
        sample_type: Some(ValueType {
            type_strindex: 11,
            unit_strindex: 12,
        }),
        period_type: Some(ValueType {
            type_strindex: 13,
            unit_strindex: 12,
        }),
        period: 524_288,
        time_unix_nano: now - 10_000_000_000,
        duration_nano: 10_000_000_000,
        samples: vec![Sample {
            stack_index: 2,
            values: vec![1 << 20],
            ..Default::default()
        }],
        ..Default::default()
    };
    ExportProfilesServiceRequest {
        resource_profiles: vec![ResourceProfiles {
            resource: Some(Resource {
                attributes: vec![
                    KeyValue {
                        key: "service.name".into(),
                        value: string_value(service),
                        ..Default::default()
                    },
                    KeyValue {
                        key: "host.name".into(),
                        value: string_value("node-7"),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            scope_profiles: vec![ScopeProfiles {
                profiles: vec![cpu, allocations],
                ..Default::default()
            }],
            ..Default::default()
        }],
        dictionary: Some(dictionary),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_exports_are_stored_over_grpc_and_http() {
    let fixture = start(None).await;
    let request = export("ebpf-app");
    fixture
        .client()
        .await
        .export(request.clone())
        .await
        .expect("an export over gRPC");
    // Sent again (a retry): stored once.
    fixture
        .client()
        .await
        .export(request)
        .await
        .expect("the same export again");
    // Samples counted of a period are the agents' CPU ticks.
    assert_eq!(
        fixture.folded("cpu", r#"service_name="ebpf-app",host_name="node-7""#),
        ["main;work 3", "main;work;leaf 6"]
    );
    assert_eq!(
        fixture.folded("cpu", r#"thread_name="worker-1""#),
        ["main;work;leaf 6"]
    );
    assert_eq!(
        fixture.folded("memory:alloc_space:bytes:space:bytes", "{}"),
        ["main;work 1048576"]
    );

    // OTLP/HTTP, protobuf.
    let answer = http::request(
        fixture.collector.http_addr.expect("HTTP"),
        "POST",
        "/v1development/profiles",
        &[("Content-Type", "application/x-protobuf")],
        &export("http-app").encode_to_vec(),
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        fixture.folded("cpu", r#"service_name="http-app""#),
        ["main;work 3", "main;work;leaf 6"]
    );
    let answer = http::request(
        fixture.collector.http_addr.expect("HTTP"),
        "POST",
        "/v1development/profiles",
        &[("Content-Type", "application/json")],
        b"{}",
    );
    assert_eq!(answer.status, 415, "{}", answer.text());
}

/// A change that breaks an export.
type Edit = Box<dyn Fn(&mut ExportProfilesServiceRequest)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_otlp_exports_are_refused_whole_and_the_token_is_needed() {
    let fixture = start(Some("in-s3cret")).await;
    let with_token = |request: ExportProfilesServiceRequest| {
        let mut request = tonic::Request::new(request);
        request.metadata_mut().insert(
            "authorization",
            MetadataValue::from_static("Bearer in-s3cret"),
        );
        request
    };
    let status = fixture
        .client()
        .await
        .export(export("x"))
        .await
        .expect_err("no token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let answer = http::request(
        fixture.collector.http_addr.expect("HTTP"),
        "POST",
        "/v1development/profiles",
        &[("Content-Type", "application/x-protobuf")],
        &export("x").encode_to_vec(),
    );
    assert_eq!(answer.status, 401, "OTLP/HTTP needs the ingest token too");

    let broken: Vec<(&str, Edit, &str)> = vec![
        (
            "a stack that is not there",
            Box::new(|r| {
                r.resource_profiles[0].scope_profiles[0].profiles[1].samples[0].stack_index = 9
            }),
            "stack index 9 out of range",
        ),
        (
            "a string that is not there",
            Box::new(|r| r.dictionary.as_mut().unwrap().function_table[2].name_strindex = 99),
            "string index 99 out of range",
        ),
        (
            "values and timestamps that disagree",
            Box::new(|r| {
                let sample = &mut r.resource_profiles[0].scope_profiles[0].profiles[0].samples[0];
                sample.timestamps_unix_nano = vec![1];
            }),
            "2 values for 1 timestamps",
        ),
        (
            "no sample type",
            Box::new(|r| r.resource_profiles[0].scope_profiles[0].profiles[1].sample_type = None),
            "no sample type",
        ),
    ];
    for (what, edit, says) in broken {
        let mut request = export("bad");
        edit(&mut request);
        let status = fixture
            .client()
            .await
            .export(with_token(request))
            .await
            .expect_err(what);
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{what}: {status:?}"
        );
        assert!(
            status.message().contains(says),
            "{what}: {}",
            status.message()
        );
    }
    // The good profile beside each bad one was not stored either.
    assert_eq!(fixture.folded("cpu", "{}"), Vec::<String>::new());
    fixture
        .client()
        .await
        .export(with_token(export("good")))
        .await
        .expect("an export with the token");
    assert_eq!(fixture.folded("cpu", "{}").len(), 2);
}
