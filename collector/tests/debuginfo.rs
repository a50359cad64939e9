//! Debuginfo uploads over gRPC on 127.0.0.1: a debug file is stored once
//! per build-id; corrupt, truncated, mismatched, oversized and malformed
//! uploads are each refused and store nothing; the ingest token guards
//! uploads too.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use sha2::{Digest as _, Sha256};
use stackscope_collector::{
    debuginfo::{Debuginfo, DebuginfoStore, DiskStore, symbolize::Symbolizer},
    server::{self, RunningCollector, ServerConfig},
    storage::sqlite::{SqliteOptions, SqliteStorage},
};
use stackscope_proto::v1::{
    DebuginfoExistsRequest, DebuginfoUploadHeader, DebuginfoUploadRequest,
    debuginfo_client::DebuginfoClient, debuginfo_upload_request::Part,
};
use stackscope_test_fixtures::split_debug::SplitDebug;
use tonic::{Code, transport::Channel};

/// Largest upload the test collector takes.
const MAX_UPLOAD: u64 = 1 << 20;

struct Fixture {
    collector: RunningCollector,
    store: Arc<dyn DebuginfoStore>,
    data: tempfile::TempDir,
}

async fn start(token: Option<&str>) -> Fixture {
    let data = tempfile::tempdir().expect("temp dir");
    let storage = SqliteStorage::open(&data.path().join("stackscope.db"), SqliteOptions::default())
        .expect("opening the database");
    let store: Arc<dyn DebuginfoStore> =
        Arc::new(DiskStore::open(&data.path().join("debuginfo"), u64::MAX).expect("store"));
    let symbolizer = Symbolizer::start(Arc::clone(&store), None).expect("symbolizer");
    let config = ServerConfig {
        grpc_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        http_listen: None,
        ingest_token: token.map(str::to_string),
        debuginfo: Some(Debuginfo {
            store: Arc::clone(&store),
            symbolizer: Arc::new(symbolizer),
            max_upload_bytes: MAX_UPLOAD,
        }),
        ..ServerConfig::default()
    };
    let collector = server::start(config, Arc::new(storage))
        .await
        .expect("starting the collector");
    Fixture {
        collector,
        store,
        data,
    }
}

impl Fixture {
    async fn client(&self) -> DebuginfoClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.collector.grpc_addr))
            .expect("uri")
            .connect()
            .await
            .expect("connecting");
        DebuginfoClient::new(channel)
    }

    /// Nothing stored for `build_id`, and no staged file left.
    fn assert_nothing_stored(&self, build_id: &str, what: &str) {
        assert_eq!(self.store.get(build_id), None, "{what}");
        let incoming = self.data.path().join("debuginfo/.incoming");
        let left = std::fs::read_dir(incoming).expect("incoming").count();
        assert_eq!(left, 0, "{what}: staged files left behind");
    }
}

/// A debug file made with `objcopy --only-keep-debug`, and its build-id.
fn debug_file() -> (Vec<u8>, String) {
    let built = SplitDebug::from_source("prog", "int main(void) { return 0; }\n", &["-O1"]);
    (
        std::fs::read(&built.debug).expect("reading"),
        built.build_id,
    )
}

fn header(build_id: &str, size: u64, sha256: Vec<u8>) -> DebuginfoUploadRequest {
    DebuginfoUploadRequest {
        part: Some(Part::Header(DebuginfoUploadHeader {
            build_id: build_id.to_owned(),
            size,
            sha256,
            file_name: "prog.debug".into(),
        })),
    }
}

fn chunks(bytes: &[u8]) -> impl Iterator<Item = DebuginfoUploadRequest> + '_ {
    bytes.chunks(4096).map(|chunk| DebuginfoUploadRequest {
        part: Some(Part::Chunk(chunk.to_vec())),
    })
}

fn sha256(bytes: &[u8]) -> Vec<u8> {
    Sha256::digest(bytes).to_vec()
}

async fn upload(
    client: &mut DebuginfoClient<Channel>,
    messages: Vec<DebuginfoUploadRequest>,
) -> Result<bool, tonic::Status> {
    client
        .upload(tokio_stream::iter(messages))
        .await
        .map(|response| response.into_inner().already_stored)
}

#[tokio::test]
async fn refused_uploads_store_nothing_and_a_good_one_is_stored_once() {
    let fixture = start(None).await;
    let (bytes, build_id) = debug_file();
    let size = bytes.len() as u64;
    let mut client = fixture.client().await;
    let exists = |client: &mut DebuginfoClient<Channel>| {
        let mut client = client.clone();
        let build_id = build_id.clone();
        async move {
            client
                .exists(DebuginfoExistsRequest { build_id })
                .await
                .expect("exists")
                .into_inner()
                .exists
        }
    };
    assert!(!exists(&mut client).await);

    let other_id = "00".repeat(20);
    let mismatch = format!("the file's build-id is {build_id}, not the {other_id} it was sent as");
    let mut flipped = bytes.clone();
    flipped[100] ^= 0xff;
    let cases: Vec<(&str, Vec<DebuginfoUploadRequest>, &str, Code, &str)> = vec![
        (
            "corrupt",
            [header(&build_id, size, sha256(&bytes))]
                .into_iter()
                .chain(chunks(&flipped))
                .collect(),
            &build_id,
            Code::InvalidArgument,
            "the bytes do not match the header's sha256",
        ),
        (
            "truncated",
            [header(&build_id, size, sha256(&bytes))]
                .into_iter()
                .chain(chunks(&bytes[..bytes.len() / 2]))
                .collect(),
            &build_id,
            Code::InvalidArgument,
            "truncated",
        ),
        (
            "longer than announced",
            [header(&build_id, size - 1, sha256(&bytes))]
                .into_iter()
                .chain(chunks(&bytes))
                .collect(),
            &build_id,
            Code::InvalidArgument,
            "more bytes than",
        ),
        (
            "mismatched",
            [header(&other_id, size, sha256(&bytes))]
                .into_iter()
                .chain(chunks(&bytes))
                .collect(),
            &other_id,
            Code::InvalidArgument,
            &mismatch,
        ),
        (
            "too large",
            vec![header(&build_id, MAX_UPLOAD + 1, sha256(&bytes))],
            &build_id,
            Code::ResourceExhausted,
            "more than the 1048576 this collector accepts",
        ),
        (
            "no header",
            chunks(&bytes).collect(),
            &build_id,
            Code::InvalidArgument,
            "the first message must be the header",
        ),
        (
            "not a build-id",
            vec![header("../../etc", size, sha256(&bytes))],
            "../../etc",
            Code::InvalidArgument,
            "is not a build-id",
        ),
    ];
    for (what, messages, claimed, code, message) in cases {
        let status = upload(&mut client, messages).await.expect_err(what);
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(status.message().contains(message), "{what}: {status:?}");
        fixture.assert_nothing_stored(claimed, what);
    }
    assert!(!exists(&mut client).await);

    let good: Vec<DebuginfoUploadRequest> = [header(&build_id, size, sha256(&bytes))]
        .into_iter()
        .chain(chunks(&bytes))
        .collect();
    assert!(!upload(&mut client, good.clone()).await.expect("stored"));
    assert!(exists(&mut client).await);
    let stored: PathBuf = fixture.store.get(&build_id).expect("the stored file");
    assert_eq!(std::fs::read(stored).expect("reading"), bytes);
    assert!(
        upload(&mut client, good).await.expect("known"),
        "sent twice"
    );
    fixture.collector.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn uploads_need_the_ingest_token() {
    let fixture = start(Some("s3cret")).await;
    let mut client = fixture.client().await;
    let status = client
        .exists(DebuginfoExistsRequest {
            build_id: "abcd".into(),
        })
        .await
        .expect_err("no token");
    assert_eq!(status.code(), Code::Unauthenticated);
    fixture.collector.shutdown().await.expect("shutdown");
}
