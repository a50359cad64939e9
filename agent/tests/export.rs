//! The exporter against a real tonic `Ingest` server on 127.0.0.1: order and
//! content, compression on the wire (the agent's zstd, gRPC's gzip, and a
//! collector from before `PushCompressed`), retries with the same batch id, lost
//! acknowledgements, rejections, the queue bound while the collector is down,
//! the bearer token, shutdown (with a collector that is up, in backoff, or
//! unreachable), configuration errors, and TLS with certificates made at
//! test time. Every test runs on a current-thread runtime, like the agent.

use std::{
    collections::HashSet,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use prost::Message;
use stackscope_agent::export::{Compression, ExportConfig, ExportError, Exporter, TlsConfig};
use stackscope_collector_client::{
    connect::ConnectError,
    ingest::push::{CollectorSupport, RequestEncoder},
};
use stackscope_proto::v1::{
    Batch, CompressedPushRequest, Label, LabelSet, Line, Location, Mapping, MappingKind, Node,
    PushRequest, PushResponse, Sample, Stack,
    ingest_server::{Ingest, IngestServer},
};
use stackscope_test_fixtures::tls::TestPki;
use tokio::{
    net::{TcpListener, TcpSocket},
    sync::oneshot,
    task::JoinHandle,
};
use tonic::{
    Request, Response, Status,
    codec::CompressionEncoding,
    metadata::MetadataValue,
    service::interceptor::InterceptedService,
    transport::{Certificate, Identity, Server, ServerTlsConfig, server::TcpIncoming},
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// One push as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    batch: Batch,
    /// `Push`, or `PushCompressed` (compressed by the agent).
    method: &'static str,
    /// The `grpc-encoding` request header: the compression actually used.
    encoding: Option<String>,
    authorization: Option<String>,
}

/// The `Ingest` service under test's control.
#[derive(Default)]
struct Collector {
    /// Every push that reached the service, in order, whatever the answer.
    seen: Mutex<Vec<Seen>>,
    /// Batches stored, the first copy of each id only (as the real
    /// collector deduplicates).
    stored: Mutex<Vec<Batch>>,
    /// Answer the next this many pushes with UNAVAILABLE, storing nothing.
    fail_next: Mutex<u32>,
    /// Store the next this many pushes but answer UNAVAILABLE, as if the
    /// acknowledgement was lost on the way back.
    lose_ack_next: Mutex<u32>,
    /// Batch ids answered with INVALID_ARGUMENT.
    reject: Mutex<HashSet<Vec<u8>>>,
    /// Answer the next this many pushes as the collector does when its disk
    /// is full: RESOURCE_EXHAUSTED with a server pushback, storing nothing.
    disk_full_next: Mutex<u32>,
    /// Batch ids answered as too large: RESOURCE_EXHAUSTED, no pushback.
    too_large: Mutex<HashSet<Vec<u8>>>,
    /// Answer `PushCompressed` as a collector from before it does: tonic's
    /// generated server answers an unknown method UNIMPLEMENTED, no message.
    before_push_compressed: bool,
    /// `PushCompressed` calls so far, answered or not.
    push_compressed_calls: Mutex<u32>,
}

impl Collector {
    fn seen_ids(&self) -> Vec<u8> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| id_of(&s.batch))
            .collect()
    }

    fn stored(&self) -> Vec<Batch> {
        self.stored.lock().unwrap().clone()
    }

    fn stored_ids(&self) -> Vec<u8> {
        self.stored().iter().map(id_of).collect()
    }
}

fn take_one(counter: &Mutex<u32>) -> bool {
    let mut left = counter.lock().unwrap();
    let take = *left > 0;
    if take {
        *left -= 1;
    }
    take
}

#[tonic::async_trait]
impl Ingest for Collector {
    async fn push(&self, request: Request<PushRequest>) -> Result<Response<PushResponse>, Status> {
        let (seen, request) = seen(request, "Push");
        self.store(seen, request)
    }

    async fn push_compressed(
        &self,
        request: Request<CompressedPushRequest>,
    ) -> Result<Response<PushResponse>, Status> {
        *self.push_compressed_calls.lock().unwrap() += 1;
        if self.before_push_compressed {
            return Err(Status::unimplemented(""));
        }
        let (seen, request) = seen(request, "PushCompressed");
        let frame = request.zstd_push_request;
        let size = zstd::zstd_safe::get_frame_content_size(&frame)
            .ok()
            .flatten()
            .expect("the frame states its size") as usize;
        let request = zstd::bulk::decompress(&frame, size).expect("a zstd frame");
        self.store(
            seen,
            PushRequest::decode(&request[..]).expect("a push request"),
        )
    }
}

/// The push's headers, and its message.
fn seen<T>(request: Request<T>, method: &'static str) -> (Seen, T) {
    let header = |name: &str| {
        request
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let seen = Seen {
        batch: Batch::default(),
        method,
        encoding: header("grpc-encoding"),
        authorization: header("authorization"),
    };
    (seen, request.into_inner())
}

impl Collector {
    fn store(&self, seen: Seen, request: PushRequest) -> Result<Response<PushResponse>, Status> {
        let batch = request
            .batch
            .ok_or_else(|| Status::invalid_argument("PushRequest.batch is missing"))?;
        self.seen.lock().unwrap().push(Seen {
            batch: batch.clone(),
            ..seen
        });
        if take_one(&self.fail_next) {
            return Err(Status::unavailable("test collector: try again"));
        }
        if self.reject.lock().unwrap().contains(&batch.batch_id) {
            return Err(Status::invalid_argument("test collector: batch refused"));
        }
        if take_one(&self.disk_full_next) {
            let mut status = Status::resource_exhausted("test collector: disk full");
            status.metadata_mut().insert(
                stackscope_proto::RETRY_PUSHBACK_KEY,
                MetadataValue::from(20u32),
            );
            return Err(status);
        }
        if self.too_large.lock().unwrap().contains(&batch.batch_id) {
            return Err(Status::resource_exhausted(
                "test collector: batch too large",
            ));
        }
        let samples = batch.samples.len() as u64;
        let duplicate = {
            let mut stored = self.stored.lock().unwrap();
            let duplicate = stored.iter().any(|b| b.batch_id == batch.batch_id);
            if !duplicate {
                stored.push(batch);
            }
            duplicate
        };
        if take_one(&self.lose_ack_next) {
            return Err(Status::unavailable("test collector: acknowledgement lost"));
        }
        Ok(Response::new(PushResponse {
            samples_stored: if duplicate { 0 } else { samples },
            duplicate,
        }))
    }
}

struct ServerOptions {
    /// Require `authorization: Bearer <token>`.
    token: Option<&'static str>,
    accept: Vec<CompressionEncoding>,
    tls: Option<ServerTlsConfig>,
    /// See [`Collector::before_push_compressed`].
    before_push_compressed: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            token: None,
            accept: vec![CompressionEncoding::Gzip, CompressionEncoding::Zstd],
            tls: None,
            before_push_compressed: false,
        }
    }
}

struct TestServer {
    addr: SocketAddr,
    collector: Arc<Collector>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl TestServer {
    async fn start(options: ServerOptions) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, options)
    }

    fn serve(listener: TcpListener, options: ServerOptions) -> Self {
        let addr = listener.local_addr().unwrap();
        let collector = Arc::new(Collector {
            before_push_compressed: options.before_push_compressed,
            ..Collector::default()
        });
        let mut service = IngestServer::from_arc(Arc::clone(&collector));
        for encoding in options.accept {
            service = service.accept_compressed(encoding);
        }
        // Same check as the collector's: a missing or wrong token never
        // reaches the service.
        let expected = options
            .token
            .map(|t| MetadataValue::try_from(format!("Bearer {t}")).unwrap());
        let check_token = move |request: Request<()>| match &expected {
            Some(expected) if request.metadata().get("authorization") != Some(expected) => Err(
                Status::unauthenticated("missing or wrong bearer token for ingest"),
            ),
            _ => Ok(request),
        };
        let mut builder = Server::builder();
        if let Some(tls) = options.tls {
            builder = builder.tls_config(tls).unwrap();
        }
        let router = builder.add_service(InterceptedService::new(service, check_token));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            router
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            addr,
            collector,
            stop: Some(stop),
            task,
        }
    }

    fn http(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

/// An address nothing listens on: connections are refused. The port stays
/// bound to the socket returned, so no other test, running meanwhile, is
/// given it; listening on that socket brings a collector up there.
fn refused_addr() -> (TcpSocket, SocketAddr) {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, addr)
}

/// Small backoffs so retries happen within milliseconds.
fn config(endpoint: String) -> ExportConfig {
    ExportConfig {
        request_timeout: Duration::from_secs(5),
        initial_backoff: ms(10),
        max_backoff: ms(50),
        ..ExportConfig::new(endpoint)
    }
}

fn id_of(batch: &Batch) -> u8 {
    batch.batch_id[0]
}

/// What batch `n` takes in the queue by default: its push request, encoded
/// and compressed.
fn request_len(n: u8) -> usize {
    RequestEncoder::zstd(CollectorSupport::default())
        .unwrap()
        .encode(batch(n))
        .len()
}

/// A batch whose id is `[n; 16]`, with every kind of table filled, and the
/// same encoded size for every `n` below 100.
fn batch(n: u8) -> Batch {
    let base = 1_700_000_000_000_000_000i64 + i64::from(n) * 10_000_000_000;
    Batch {
        batch_id: vec![n; 16],
        node: Some(Node {
            name: 1,
            agent_version: 2,
        }),
        start_unix_nanos: base,
        end_unix_nanos: base + 10_000_000_000,
        sample_period_nanos: 10_101_010,
        strings: vec![
            String::new(),
            "node-a".into(),
            "0.1.0".into(),
            "4f2a9c0e".into(),
            "/usr/bin/app".into(),
            "main".into(),
            "app.c".into(),
            "comm".into(),
            format!("proc-{n:02}"),
        ],
        mappings: vec![Mapping {
            kind: MappingKind::User as i32,
            build_id: 3,
            path: 4,
            load_segments: Vec::new(),
        }],
        locations: vec![
            Location {
                mapping: 0,
                address: 0x1234,
                lines: vec![Line {
                    function: 5,
                    file: 6,
                    line: 42,
                }],
            },
            Location {
                mapping: 0,
                address: 0x5678,
                lines: vec![],
            },
        ],
        stacks: vec![Stack {
            locations: vec![0, 1],
        }],
        label_sets: vec![LabelSet {
            labels: vec![Label { name: 7, value: 8 }],
        }],
        samples: vec![Sample {
            stack: 0,
            label_set: 0,
            count: 10 + u64::from(n),
            sampling_divisor: 1,
        }],
        typed_samples: Vec::new(),
    }
}

fn ticks(batches: impl IntoIterator<Item = u8>) -> u64 {
    batches.into_iter().map(|n| 10 + u64::from(n)).sum()
}

async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(ms(5)).await;
    }
}

#[tokio::test]
async fn batches_arrive_in_order_with_identical_content() {
    let server = TestServer::start(ServerOptions::default()).await;
    let exporter = Exporter::start(config(server.http())).unwrap();
    let sent: Vec<Batch> = (0..5).map(batch).collect();
    for b in &sent {
        exporter.enqueue(b.clone());
    }
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    assert_eq!(server.collector.stored(), sent);
    assert_eq!(server.collector.seen_ids(), [0, 1, 2, 3, 4]);
    assert_eq!(stats.batches_sent, 5);
    assert_eq!(stats.samples_sent, ticks(0..5));
    assert_eq!(stats.queued_batches, 0);
    assert_eq!(stats.queued_bytes, 0);
    assert_eq!(stats.retries, 0);
    assert_eq!(stats.last_error, None);
    server.stop().await;
}

/// Batches large enough that compression shows: 200 strings of 40 bytes
/// that repeat, as a real batch's function and file names do.
fn compressible_batch(n: u8) -> Batch {
    let mut batch = batch(n);
    batch
        .strings
        .extend((0..200).map(|i| format!("crate::module::function_number_{:08}", i % 20)));
    batch
}

#[tokio::test]
async fn each_compression_is_used_on_the_wire() {
    let plain_len = PushRequest {
        batch: Some(compressible_batch(1)),
    }
    .encoded_len();
    for (compression, method, header) in [
        (Compression::Zstd, "PushCompressed", None),
        (Compression::Gzip, "Push", Some("gzip")),
        (Compression::None, "Push", None),
    ] {
        let server = TestServer::start(ServerOptions::default()).await;
        let exporter = Exporter::start(ExportConfig {
            compression,
            ..config(server.http())
        })
        .unwrap();
        // Nothing is sent before the test awaits (one thread): the batch
        // is still queued, at its encoding's size.
        exporter.enqueue(compressible_batch(1));
        let queued = exporter.stats().queued_bytes as usize;
        if compression == Compression::Zstd {
            assert!(queued * 4 < plain_len, "{queued} of {plain_len} bytes");
        } else {
            assert_eq!(queued, plain_len, "{compression}");
        }
        exporter.enqueue(compressible_batch(2));
        let stats = exporter.shutdown(Duration::from_secs(10)).await;
        assert_eq!(stats.batches_sent, 2, "{compression}");
        let seen = server.collector.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        for (n, seen) in seen.iter().enumerate() {
            assert_eq!(seen.method, method, "{compression}");
            assert_eq!(seen.encoding.as_deref(), header, "{compression}");
            assert_eq!(seen.batch, compressible_batch(n as u8 + 1));
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn a_collector_from_before_compressed_pushes_gets_them_as_grpc_zstd() {
    let server = TestServer::start(ServerOptions {
        before_push_compressed: true,
        ..ServerOptions::default()
    })
    .await;
    let exporter = Exporter::start(config(server.http())).unwrap();
    // Queued compressed, before the collector said anything.
    for n in 0..3 {
        exporter.enqueue(compressible_batch(n));
    }
    // The exporter's own count, not the collector's: the collector stores a
    // batch before its answer reaches the exporter, which until then still
    // holds that batch in the queue.
    wait_until("the three were acknowledged", || {
        exporter.stats().batches_sent == 3
    })
    .await;
    // Asked once: later batches are not compressed only to be
    // decompressed again, and wait in the queue as they are sent.
    exporter.enqueue(compressible_batch(3));
    let plain_len = PushRequest {
        batch: Some(compressible_batch(3)),
    }
    .encoded_len();
    assert_eq!(exporter.stats().queued_bytes, plain_len as u64);
    let stats = exporter.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.batches_sent, 4);
    assert_eq!((stats.batches_rejected, stats.retries), (0, 0));
    assert_eq!(*server.collector.push_compressed_calls.lock().unwrap(), 1);
    let seen = server.collector.seen.lock().unwrap().clone();
    let sent: Vec<_> = seen
        .iter()
        .map(|s| (s.method, s.encoding.as_deref(), s.batch.clone()))
        .collect();
    let expected: Vec<_> = (0..4)
        .map(|n| ("Push", Some("zstd"), compressible_batch(n)))
        .collect();
    assert_eq!(sent, expected);
    server.stop().await;
}

#[tokio::test]
async fn compression_the_collector_does_not_accept_is_rejected_not_retried() {
    let server = TestServer::start(ServerOptions {
        accept: vec![CompressionEncoding::Zstd],
        ..ServerOptions::default()
    })
    .await;
    let exporter = Exporter::start(ExportConfig {
        compression: Compression::Gzip,
        ..config(server.http())
    })
    .unwrap();
    exporter.enqueue(batch(1));
    let stats = exporter.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.batches_rejected, 1);
    assert_eq!(stats.samples_rejected, ticks([1]));
    assert_eq!(stats.retries, 0);
    assert_eq!(stats.batches_sent, 0);
    let error = stats.last_error.unwrap();
    assert!(error.starts_with("Unimplemented: "), "{error}");
    assert!(error.contains("gzip"), "{error}");
    assert!(server.collector.stored().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn transient_failures_retry_the_same_batch_id_and_deliver_once() {
    let server = TestServer::start(ServerOptions::default()).await;
    *server.collector.fail_next.lock().unwrap() = 3;
    let exporter = Exporter::start(config(server.http())).unwrap();
    exporter.enqueue(batch(0));
    exporter.enqueue(batch(1));
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    // Batch 1 waited behind batch 0: order holds across retries.
    assert_eq!(server.collector.seen_ids(), [0, 0, 0, 0, 1]);
    let seen = server.collector.seen.lock().unwrap().clone();
    assert!(seen[..4].iter().all(|s| s.batch == batch(0)));
    assert_eq!(server.collector.stored(), [batch(0), batch(1)]);
    assert_eq!(stats.retries, 3);
    assert_eq!(stats.batches_sent, 2);
    assert_eq!(stats.batches_rejected, 0);
    assert_eq!(
        stats.last_error.as_deref(),
        Some("Unavailable: test collector: try again")
    );
    server.stop().await;
}

#[tokio::test]
async fn a_full_disk_is_waited_out_and_a_batch_too_large_dropped() {
    let server = TestServer::start(ServerOptions::default()).await;
    *server.collector.disk_full_next.lock().unwrap() = 3;
    server
        .collector
        .too_large
        .lock()
        .unwrap()
        .insert(batch(1).batch_id);
    let exporter = Exporter::start(config(server.http())).unwrap();
    for n in 0..3 {
        exporter.enqueue(batch(n));
    }
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    // Batch 0 met the full disk three times and was kept; batch 1, too
    // large whatever the disk, was dropped after one try.
    assert_eq!(server.collector.seen_ids(), [0, 0, 0, 0, 1, 2]);
    assert_eq!(server.collector.stored_ids(), [0, 2]);
    assert_eq!(stats.retries, 3);
    assert_eq!(stats.batches_sent, 2);
    assert_eq!(stats.batches_rejected, 1);
    assert_eq!(stats.samples_rejected, ticks([1]));
    assert_eq!(stats.queued_batches, 0);
    assert_eq!(
        stats.last_error.as_deref(),
        Some("ResourceExhausted: test collector: batch too large")
    );
    server.stop().await;
}

#[tokio::test]
async fn lost_acknowledgement_is_retried_and_deduplicated_by_batch_id() {
    let server = TestServer::start(ServerOptions::default()).await;
    *server.collector.lose_ack_next.lock().unwrap() = 1;
    let exporter = Exporter::start(config(server.http())).unwrap();
    exporter.enqueue(batch(4));
    exporter.enqueue(batch(5));
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    assert_eq!(server.collector.seen_ids(), [4, 4, 5]);
    assert_eq!(server.collector.stored_ids(), [4, 5]);
    assert_eq!(stats.retries, 1);
    assert_eq!(stats.batches_sent, 2);
    assert_eq!(stats.batches_duplicate, 1);
    server.stop().await;
}

#[tokio::test]
async fn rejected_batch_is_dropped_and_the_next_delivered() {
    let server = TestServer::start(ServerOptions::default()).await;
    server
        .collector
        .reject
        .lock()
        .unwrap()
        .insert(batch(1).batch_id);
    let exporter = Exporter::start(config(server.http())).unwrap();
    for n in 0..3 {
        exporter.enqueue(batch(n));
    }
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    assert_eq!(server.collector.seen_ids(), [0, 1, 2], "no retry of 1");
    assert_eq!(server.collector.stored_ids(), [0, 2]);
    assert_eq!(stats.batches_sent, 2);
    assert_eq!(stats.samples_sent, ticks([0, 2]));
    assert_eq!(stats.batches_rejected, 1);
    assert_eq!(stats.samples_rejected, ticks([1]));
    assert_eq!(stats.retries, 0);
    assert_eq!(
        stats.last_error.as_deref(),
        Some("InvalidArgument: test collector: batch refused")
    );
    server.stop().await;
}

#[tokio::test]
async fn full_queue_drops_the_oldest_while_the_collector_is_down() {
    let (socket, addr) = refused_addr();
    let size = request_len(0);
    let exporter = Exporter::start(ExportConfig {
        max_queue_bytes: 3 * size + size / 2,
        ..config(format!("http://{addr}"))
    })
    .unwrap();
    // No await in between: the sending task has not run yet, so the bound
    // alone decides what stays.
    for n in 0..10 {
        exporter.enqueue(batch(n));
    }
    let stats = exporter.stats();
    assert_eq!(stats.batches_dropped_queue_full, 7);
    assert_eq!(stats.samples_dropped_queue_full, ticks(0..7));
    assert_eq!(stats.queued_batches, 3);
    assert_eq!(
        stats.queued_bytes,
        (7..10).map(request_len).sum::<usize>() as u64
    );
    assert_eq!(stats.queued_samples, ticks(7..10));

    wait_until("the exporter retried against the refused port", || {
        exporter.stats().retries >= 2
    })
    .await;
    let error = exporter.stats().last_error.unwrap();
    assert!(error.starts_with("Unavailable: "), "{error}");

    // The collector comes up on the address the exporter keeps trying.
    let listener = socket.listen(1024).unwrap();
    let server = TestServer::serve(listener, ServerOptions::default());
    wait_until("the queued batches arrived", || {
        server.collector.stored().len() == 3
    })
    .await;
    let stats = exporter.shutdown(Duration::from_secs(10)).await;

    assert_eq!(server.collector.stored_ids(), [7, 8, 9]);
    assert_eq!(stats.batches_sent, 3);
    assert_eq!(stats.batches_dropped_queue_full, 7);
    assert_eq!(stats.queued_batches, 0);
    server.stop().await;
}

#[tokio::test]
async fn queue_stays_bounded_while_batches_keep_coming() {
    let (_socket, addr) = refused_addr();
    let size = request_len(0);
    let max = 2 * size;
    let exporter = Exporter::start(ExportConfig {
        max_queue_bytes: max,
        ..config(format!("http://{addr}"))
    })
    .unwrap();
    for n in 0..50 {
        exporter.enqueue(batch(n));
        // Let the sender take batches out and put them back between
        // enqueues, so the in-flight path is exercised too.
        tokio::time::sleep(ms(2)).await;
        let stats = exporter.stats();
        // Waiting batches stay within the bound; the one on the wire
        // comes on top.
        assert!(
            stats.queued_bytes <= (max + size) as u64,
            "{} bytes queued after batch {n}",
            stats.queued_bytes
        );
    }
    let stats = exporter.shutdown(ms(200)).await;
    assert_eq!(stats.batches_sent, 0);
    assert_eq!(stats.batches_dropped_queue_full + stats.queued_batches, 50);
    assert!(stats.queued_batches <= 2, "{stats:?}");
}

#[tokio::test]
async fn a_batch_larger_than_the_whole_queue_is_dropped() {
    let server = TestServer::start(ServerOptions::default()).await;
    let size = request_len(0);
    let exporter = Exporter::start(ExportConfig {
        max_queue_bytes: size - 1,
        ..config(server.http())
    })
    .unwrap();
    exporter.enqueue(batch(0));
    let stats = exporter.stats();
    assert_eq!(stats.batches_dropped_queue_full, 1);
    assert_eq!(stats.samples_dropped_queue_full, ticks([0]));
    assert_eq!(stats.queued_batches, 0);
    let stats = exporter.shutdown(Duration::from_secs(5)).await;
    assert_eq!(stats.batches_sent, 0);
    assert!(server.collector.seen_ids().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn bearer_token_is_sent() {
    let server = TestServer::start(ServerOptions {
        token: Some("s3cret"),
        ..ServerOptions::default()
    })
    .await;
    let exporter = Exporter::start(ExportConfig {
        bearer_token: Some("s3cret".into()),
        ..config(server.http())
    })
    .unwrap();
    exporter.enqueue(batch(0));
    let stats = exporter.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.batches_sent, 1);
    let seen = server.collector.seen.lock().unwrap().clone();
    assert_eq!(seen[0].authorization.as_deref(), Some("Bearer s3cret"));
    server.stop().await;
}

#[tokio::test]
async fn wrong_or_missing_token_is_rejected_and_counted() {
    let server = TestServer::start(ServerOptions {
        token: Some("s3cret"),
        ..ServerOptions::default()
    })
    .await;
    for token in [Some("wrong"), None] {
        let exporter = Exporter::start(ExportConfig {
            bearer_token: token.map(str::to_owned),
            ..config(server.http())
        })
        .unwrap();
        exporter.enqueue(batch(0));
        exporter.enqueue(batch(1));
        let stats = exporter.shutdown(Duration::from_secs(10)).await;
        assert_eq!(stats.batches_rejected, 2, "{token:?}");
        assert_eq!(stats.batches_sent, 0);
        assert_eq!(stats.retries, 0);
        assert_eq!(
            stats.last_error.as_deref(),
            Some("Unauthenticated: missing or wrong bearer token for ingest")
        );
    }
    assert!(server.collector.seen_ids().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn shutdown_delivers_the_batch_just_enqueued() {
    let server = TestServer::start(ServerOptions::default()).await;
    let exporter = Exporter::start(config(server.http())).unwrap();
    exporter.enqueue(batch(9));
    let stats = exporter.shutdown(Duration::from_secs(10)).await;
    assert_eq!(server.collector.stored(), [batch(9)]);
    assert_eq!(stats.batches_sent, 1);
    assert_eq!(stats.queued_batches, 0);
    server.stop().await;
}

#[tokio::test]
async fn shutdown_cuts_a_long_backoff_short() {
    let server = TestServer::start(ServerOptions::default()).await;
    *server.collector.fail_next.lock().unwrap() = 1;
    let exporter = Exporter::start(ExportConfig {
        initial_backoff: Duration::from_secs(60),
        max_backoff: Duration::from_secs(60),
        ..config(server.http())
    })
    .unwrap();
    exporter.enqueue(batch(3));
    wait_until("the first push failed", || exporter.stats().retries == 1).await;
    // The exporter now sleeps up to a minute; shutdown must not wait that
    // out but try once more at once.
    let started = Instant::now();
    let stats = exporter.shutdown(Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(stats.batches_sent, 1);
    assert_eq!(server.collector.stored(), [batch(3)]);
    server.stop().await;
}

#[tokio::test]
async fn shutdown_gives_up_at_the_deadline_when_the_port_is_closed() {
    let (_socket, addr) = refused_addr();
    let exporter = Exporter::start(ExportConfig::new(format!("http://{addr}"))).unwrap();
    exporter.enqueue(batch(0));
    exporter.enqueue(batch(1));
    let started = Instant::now();
    let stats = exporter.shutdown(ms(300)).await;
    let elapsed = started.elapsed();
    assert!(elapsed >= ms(300), "{elapsed:?}");
    assert!(elapsed < ms(2300), "{elapsed:?}");
    assert_eq!(stats.batches_sent, 0);
    assert_eq!(stats.queued_batches, 2, "left unsent: {stats:?}");
    assert_eq!(stats.queued_samples, ticks([0, 1]));
    assert!(stats.last_error.is_some());
}

#[tokio::test]
async fn shutdown_gives_up_at_the_deadline_when_the_collector_never_answers() {
    // Bound but never accepted: the kernel completes the TCP handshake and
    // then nothing ever answers, the worst case for a hang.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let exporter = Exporter::start(ExportConfig::new(format!(
        "http://{}",
        silent.local_addr().unwrap()
    )))
    .unwrap();
    exporter.enqueue(batch(0));
    // Let the push start, so the deadline interrupts it mid-flight.
    tokio::time::sleep(ms(50)).await;
    let started = Instant::now();
    let stats = exporter.shutdown(ms(300)).await;
    let elapsed = started.elapsed();
    assert!(elapsed < ms(2300), "{elapsed:?}");
    assert_eq!(stats.batches_sent, 0);
    assert_eq!(stats.queued_batches, 1, "the batch on the wire is unsent");
    assert_eq!(stats.queued_bytes, request_len(0) as u64);
    drop(silent);
}

#[tokio::test]
async fn dropping_the_exporter_stops_its_task() {
    let server = TestServer::start(ServerOptions::default()).await;
    // Fails every push, so a task left running would keep pushing.
    *server.collector.fail_next.lock().unwrap() = u32::MAX;
    let exporter = Exporter::start(config(server.http())).unwrap();
    exporter.enqueue(batch(0));
    wait_until("a few retries", || server.collector.seen_ids().len() >= 3).await;
    drop(exporter);
    let pushes = server.collector.seen_ids().len();
    tokio::time::sleep(ms(200)).await;
    // One push may have been on the wire when the handle went; a task left
    // running would have pushed several more (backoff is at most 50 ms).
    let after = server.collector.seen_ids().len();
    assert!(after <= pushes + 1, "{pushes} pushes, then {after}");
    server.stop().await;
}

#[test]
fn start_reports_bad_configuration_clearly() {
    let err = |config: ExportConfig| Exporter::start(config).unwrap_err();

    let e = err(ExportConfig::new("foo"));
    assert!(
        matches!(e, ExportError::Connect(ConnectError::BadEndpoint { .. })),
        "{e:?}"
    );
    assert!(
        e.to_string().starts_with("collector endpoint \"foo\": "),
        "{e}"
    );

    let e = err(ExportConfig::new("http://exa mple:1"));
    assert!(
        matches!(e, ExportError::Connect(ConnectError::InvalidUri { .. })),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "collector endpoint \"http://exa mple:1\": invalid URI"
    );

    let missing = PathBuf::from("/nonexistent/stackscope/ca.pem");
    let e = err(ExportConfig {
        tls: Some(TlsConfig {
            ca_cert: Some(missing.clone()),
            ..TlsConfig::default()
        }),
        ..ExportConfig::new("https://127.0.0.1:7070")
    });
    assert_eq!(
        e.to_string(),
        "reading CA certificate /nonexistent/stackscope/ca.pem"
    );
    let source = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .expect("io error source");
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);

    let e = err(ExportConfig {
        tls: Some(TlsConfig::default()),
        ..ExportConfig::new("http://127.0.0.1:7070")
    });
    assert!(
        matches!(
            e,
            ExportError::Connect(ConnectError::TlsWithoutHttps { .. })
        ),
        "{e:?}"
    );

    let e = err(ExportConfig {
        tls: Some(TlsConfig {
            client_cert: Some(missing.clone()),
            ..TlsConfig::default()
        }),
        ..ExportConfig::new("https://127.0.0.1:7070")
    });
    assert!(
        matches!(
            e,
            ExportError::Connect(ConnectError::IncompleteClientIdentity {
                given: "certificate"
            })
        ),
        "{e:?}"
    );

    let e = err(ExportConfig {
        bearer_token: Some("two\nlines".into()),
        ..ExportConfig::new("http://127.0.0.1:7070")
    });
    assert!(
        matches!(e, ExportError::Connect(ConnectError::InvalidToken)),
        "{e:?}"
    );

    // Everything valid, but no tokio runtime to run on.
    let e = err(ExportConfig::new("http://127.0.0.1:7070"));
    assert!(matches!(e, ExportError::NoRuntime), "{e:?}");
}

#[tokio::test]
async fn https_without_tls_options_uses_default_roots() {
    // Only checks that the exporter starts: reaching a public collector is
    // beyond a test on loopback.
    let exporter = Exporter::start(ExportConfig::new("https://collector.example:443")).unwrap();
    let stats = exporter.shutdown(ms(10)).await;
    assert_eq!(stats.queued_batches, 0);
}

/// The test PKI (a CA, a server certificate for `localhost` and a client
/// certificate) with the adapters these tests need: tonic's server side and
/// the exporter's own options.
struct Pki(TestPki);

impl std::ops::Deref for Pki {
    type Target = TestPki;

    fn deref(&self) -> &TestPki {
        &self.0
    }
}

impl Pki {
    fn new() -> Self {
        Self(TestPki::new(&["localhost"]))
    }

    fn server_tls(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(
            &self.server_cert_pem,
            &self.server_key_pem,
        ))
    }

    /// Trust this CA; the certificate is for `localhost` while the endpoint
    /// is an IP address, so the domain is set explicitly.
    fn client_tls(&self) -> TlsConfig {
        TlsConfig {
            ca_cert: Some(self.path("ca.pem")),
            domain: Some("localhost".into()),
            ..TlsConfig::default()
        }
    }

    fn client_tls_with_identity(&self) -> TlsConfig {
        TlsConfig {
            client_cert: Some(self.path("client.pem")),
            client_key: Some(self.path("client.key")),
            ..self.client_tls()
        }
    }
}

fn https(server: &TestServer) -> String {
    format!("https://{}", server.addr)
}

async fn push_one_over_tls(server: &TestServer, tls: TlsConfig, deadline: Duration) -> u64 {
    let exporter = Exporter::start(ExportConfig {
        tls: Some(tls),
        ..config(https(server))
    })
    .unwrap();
    exporter.enqueue(batch(2));
    let stats = exporter.shutdown(deadline).await;
    if stats.batches_sent == 0 {
        assert!(stats.last_error.is_some(), "{stats:?}");
        assert_eq!(stats.queued_batches, 1, "{stats:?}");
    }
    stats.batches_sent
}

#[tokio::test]
async fn tls_with_a_private_ca() {
    let pki = Pki::new();
    let server = TestServer::start(ServerOptions {
        tls: Some(pki.server_tls()),
        ..ServerOptions::default()
    })
    .await;
    assert_eq!(
        push_one_over_tls(&server, pki.client_tls(), Duration::from_secs(10)).await,
        1
    );
    assert_eq!(server.collector.stored(), [batch(2)]);
    server.stop().await;
}

#[tokio::test]
async fn tls_refuses_a_server_signed_by_another_ca() {
    let pki = Pki::new();
    let other = Pki::new();
    let server = TestServer::start(ServerOptions {
        tls: Some(pki.server_tls()),
        ..ServerOptions::default()
    })
    .await;
    let exporter = Exporter::start(ExportConfig {
        tls: Some(other.client_tls()),
        ..config(https(&server))
    })
    .unwrap();
    exporter.enqueue(batch(2));
    wait_until("a handshake failed", || exporter.stats().retries >= 1).await;
    let stats = exporter.shutdown(ms(200)).await;
    assert_eq!(stats.batches_sent, 0);
    let error = stats.last_error.unwrap();
    assert!(error.contains("certificate"), "{error}");
    assert!(server.collector.seen_ids().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let pki = Pki::new();
    let server = TestServer::start(ServerOptions {
        tls: Some(
            pki.server_tls()
                .client_ca_root(Certificate::from_pem(&pki.ca_pem)),
        ),
        ..ServerOptions::default()
    })
    .await;
    assert_eq!(
        push_one_over_tls(
            &server,
            pki.client_tls_with_identity(),
            Duration::from_secs(10)
        )
        .await,
        1
    );
    assert_eq!(
        push_one_over_tls(&server, pki.client_tls(), ms(500)).await,
        0
    );
    assert_eq!(server.collector.stored(), [batch(2)]);
    server.stop().await;
}

#[test]
fn unreadable_or_wrong_pem_files_are_reported_at_start() {
    let pki = Pki::new();
    let not_a_key: &Path = &pki.path("ca.pem");
    let e = Exporter::start(ExportConfig {
        tls: Some(TlsConfig {
            client_key: Some(not_a_key.to_owned()),
            ..pki.client_tls_with_identity()
        }),
        ..ExportConfig::new("https://127.0.0.1:7070")
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "client key {}: no PEM PRIVATE KEY found",
            not_a_key.display()
        )
    );
}
