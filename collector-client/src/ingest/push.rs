//! The push of one batch, encoded (and compressed, with zstd) once when it
//! is queued.
//!
//! The generated client takes a `PushRequest` message and encodes it on
//! every attempt; tonic's zstd then makes a new compression stream for every
//! message, sized for input of unknown length (level 3: a 2 MiB window and
//! about 768 KiB of tables, faulted in and freed each time), which cost the
//! agent a tenth of its CPU at 99 Hz. A batch is instead encoded into a
//! buffer kept between batches and compressed by a compressor kept likewise,
//! which knows the input's size; the result is the whole request as it goes
//! on the wire, sent as is by every attempt: `Ingest.PushCompressed` for a
//! compressed batch, `Ingest.Push` otherwise (with the gRPC compression
//! asked for). A collector from before `PushCompressed` (or a proxy that
//! does not route it) answers it UNIMPLEMENTED; the pusher then sends that
//! batch by `Push` with gRPC's zstd, and the encoder stops compressing, for
//! [`ASK_AGAIN_AFTER`]: the collector may be upgraded meanwhile.
//!
//! Owns: the ingest service's push path, the request encoding and the
//! codec. Does not own the queue or the connection (the agent's exporter
//! does).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use prost::{
    Message as _,
    bytes::{BufMut as _, Bytes},
};
use stackscope_proto::v1::{Batch, CompressedPushRequest, PushRequest, PushResponse};
use tonic::{
    Code, Request, Status,
    codec::{Codec, CompressionEncoding, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::http::uri::PathAndQuery,
    metadata::{Ascii, MetadataValue},
    transport::Channel,
};

/// The method the generated client calls for `Ingest.Push`.
const PUSH_PATH: &str = "/stackscope.v1.Ingest/Push";
/// And for `Ingest.PushCompressed`.
const PUSH_COMPRESSED_PATH: &str = "/stackscope.v1.Ingest/PushCompressed";

/// zstd's default level, what tonic's zstd used: batches compress several
/// times at it (string tables, similar stacks).
const ZSTD_LEVEL: i32 = 3;

/// Encoding buffers larger than this are released after the batch rather
/// than kept for the next: one unusually large batch must not pin its size
/// for the agent's lifetime.
const MAX_KEPT_BUFFER_BYTES: usize = 4 << 20;

/// How long a collector that answered `PushCompressed` UNIMPLEMENTED is
/// taken at its word: one request in this long is spent asking again.
pub const ASK_AGAIN_AFTER: Duration = Duration::from_secs(600);

/// Whether the collector takes `PushCompressed`, as far as is known: learnt
/// by the pusher, read by the encoder (which does not compress what would
/// only be decompressed again). Clones share it.
#[derive(Debug, Clone)]
pub struct CollectorSupport(Arc<Support>);

#[derive(Debug)]
struct Support {
    since: Instant,
    /// Milliseconds after `since` before which `PushCompressed` is not
    /// tried: 0 until the collector refuses it.
    refused_until_ms: AtomicU64,
}

impl Default for CollectorSupport {
    fn default() -> Self {
        Self(Arc::new(Support {
            since: Instant::now(),
            refused_until_ms: AtomicU64::new(0),
        }))
    }
}

impl CollectorSupport {
    pub fn takes_compressed(&self) -> bool {
        self.now_ms() >= self.0.refused_until_ms.load(Ordering::Relaxed)
    }

    fn refused_compressed(&self) {
        let until = self
            .now_ms()
            .saturating_add(ASK_AGAIN_AFTER.as_millis() as u64);
        self.0.refused_until_ms.store(until, Ordering::Relaxed);
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.0.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A push request as it goes on the wire, ready to be sent as many times as
/// retries need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodedRequest {
    /// A `PushRequest`, for `Ingest.Push`.
    Plain(Bytes),
    /// A `CompressedPushRequest`, for `Ingest.PushCompressed`.
    Zstd(Bytes),
}

impl EncodedRequest {
    /// Bytes held in memory (and sent, before gRPC's own compression).
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    fn bytes(&self) -> &Bytes {
        match self {
            EncodedRequest::Plain(bytes) | EncodedRequest::Zstd(bytes) => bytes,
        }
    }

    /// The `PushRequest` inside, decompressed if need be; an error for
    /// bytes that are not one (only a defect here could make them).
    pub fn push_request(&self) -> Result<Bytes, Status> {
        match self {
            EncodedRequest::Plain(bytes) => Ok(bytes.clone()),
            EncodedRequest::Zstd(bytes) => decompress(bytes).map_err(|err| {
                Status::data_loss(format!("the queued batch does not decompress: {err}"))
            }),
        }
    }
}

/// Encodes batches as push requests, compressing them with zstd when
/// asked (and the collector takes them so); keeps its buffers and
/// compressor from one batch to the next.
pub struct RequestEncoder {
    zstd: Option<ZstdState>,
}

struct ZstdState {
    support: CollectorSupport,
    compressor: zstd::bulk::Compressor<'static>,
    encoded: Vec<u8>,
    compressed: Vec<u8>,
}

impl std::fmt::Debug for RequestEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestEncoder")
            .field("zstd", &self.zstd.is_some())
            .finish_non_exhaustive()
    }
}

impl RequestEncoder {
    /// An encoder of plain requests (gRPC compresses them, if at all).
    pub fn plain() -> Self {
        Self { zstd: None }
    }

    /// An encoder of zstd-compressed requests while `support` says the
    /// collector takes them. Fails only when zstd cannot allocate its
    /// context.
    pub fn zstd(support: CollectorSupport) -> std::io::Result<Self> {
        Ok(Self {
            zstd: Some(ZstdState {
                support,
                compressor: zstd::bulk::Compressor::new(ZSTD_LEVEL)?,
                encoded: Vec::new(),
                compressed: Vec::new(),
            }),
        })
    }

    /// `PushRequest { batch }`, encoded, then compressed if this encoder
    /// compresses. A batch zstd fails to compress (it cannot, short of
    /// memory) goes plain rather than be lost.
    pub fn encode(&mut self, batch: Batch) -> EncodedRequest {
        if let Some(zstd) = &mut self.zstd
            && zstd.support.takes_compressed()
            && let Ok(compressed) = zstd.compress(&batch)
        {
            return EncodedRequest::Zstd(compressed);
        }
        let request = PushRequest { batch: Some(batch) };
        EncodedRequest::Plain(request.encode_to_vec().into())
    }
}

impl ZstdState {
    /// `CompressedPushRequest` around `PushRequest { batch }` compressed:
    /// the field's key and length, then the frame, in one allocation of
    /// the exact size.
    fn compress(&mut self, batch: &Batch) -> std::io::Result<Bytes> {
        use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
        // The request's one field (`batch` is field 1) written here: the
        // batch is measured once (a pass over every stack's locations),
        // where `encode` measures it three times and `encode_raw` twice.
        let batch_len = batch.encoded_len() as u64;
        self.encoded.clear();
        self.encoded
            .reserve(key_len(1) + encoded_len_varint(batch_len) + batch_len as usize);
        encode_key(1, WireType::LengthDelimited, &mut self.encoded);
        encode_varint(batch_len, &mut self.encoded);
        batch.encode_raw(&mut self.encoded);
        self.compressed.clear();
        self.compressed
            .reserve(zstd::zstd_safe::compress_bound(self.encoded.len()));
        let result = self
            .compressor
            .compress_to_buffer(&self.encoded[..], &mut self.compressed);
        let wrapped = result.map(|_| {
            let frame = &self.compressed[..];
            let length = frame.len() as u64;
            // `zstd_push_request` is field 1.
            let mut out = Vec::with_capacity(1 + encoded_len_varint(length) + frame.len());
            encode_key(1, WireType::LengthDelimited, &mut out);
            encode_varint(length, &mut out);
            out.put_slice(frame);
            Bytes::from(out)
        });
        release_if_large(&mut self.encoded);
        release_if_large(&mut self.compressed);
        wrapped
    }
}

fn release_if_large(buffer: &mut Vec<u8>) {
    if buffer.capacity() > MAX_KEPT_BUFFER_BYTES {
        *buffer = Vec::new();
    }
}

/// The `PushRequest` a `CompressedPushRequest` carries, encoded.
fn decompress(request: &Bytes) -> std::io::Result<Bytes> {
    let wrapper = CompressedPushRequest::decode(request.clone())?;
    let frame = &wrapper.zstd_push_request;
    let size = zstd::zstd_safe::get_frame_content_size(frame)
        .ok()
        .flatten()
        .ok_or_else(|| std::io::Error::other("the zstd frame does not state its size"))?;
    let size = usize::try_from(size).map_err(std::io::Error::other)?;
    zstd::bulk::decompress(frame, size).map(Bytes::from)
}

/// What every push carries besides the batch.
#[derive(Debug, Clone, Default)]
pub struct PushOptions {
    /// Sent as the gRPC timeout, so the collector gives up on its side too.
    pub timeout: Option<Duration>,
    /// The `authorization` header.
    pub authorization: Option<MetadataValue<Ascii>>,
}

/// A client of the ingest service that pushes encoded requests.
#[derive(Debug, Clone)]
pub struct IngestPusher {
    /// For `PushCompressed`: its request is compressed already.
    uncompressed: tonic::client::Grpc<Channel>,
    /// For `Push`, with the configured gRPC compression.
    compressing: tonic::client::Grpc<Channel>,
    support: CollectorSupport,
    /// The collector's last refusal of `PushCompressed`, until taken.
    refusal: Option<Status>,
}

impl IngestPusher {
    /// `compression` is what `Push` uses on the wire: for batches encoded
    /// plain, and for compressed ones when the collector does not take
    /// them as they are (zstd is the right choice then). `support` is
    /// shared with the encoder.
    pub fn new(
        channel: Channel,
        compression: Option<CompressionEncoding>,
        support: CollectorSupport,
    ) -> Self {
        let uncompressed = tonic::client::Grpc::new(channel);
        let mut compressing = uncompressed.clone();
        if let Some(encoding) = compression {
            compressing = compressing.send_compressed(encoding);
        }
        Self {
            uncompressed,
            compressing,
            support,
            refusal: None,
        }
    }

    /// The collector's answer when it last refused `PushCompressed` (the
    /// batch then went by `Push`), once.
    pub fn take_compressed_refusal(&mut self) -> Option<Status> {
        self.refusal.take()
    }

    /// Pushes `request`, by the method its encoding calls for (see the
    /// module documentation).
    pub async fn push(
        &mut self,
        request: &EncodedRequest,
        options: &PushOptions,
    ) -> Result<PushResponse, Status> {
        if let EncodedRequest::Zstd(bytes) = request
            && self.support.takes_compressed()
        {
            let path = PathAndQuery::from_static(PUSH_COMPRESSED_PATH);
            match unary(&mut self.uncompressed, path, bytes.clone(), options).await {
                // Sent without gRPC compression, so not a refused encoding:
                // the method is unknown.
                Err(status) if status.code() == Code::Unimplemented => {
                    self.support.refused_compressed();
                    self.refusal = Some(status);
                }
                answer => return answer,
            }
        }
        let path = PathAndQuery::from_static(PUSH_PATH);
        unary(
            &mut self.compressing,
            path,
            request.push_request()?,
            options,
        )
        .await
    }
}

async fn unary(
    grpc: &mut tonic::client::Grpc<Channel>,
    path: PathAndQuery,
    body: Bytes,
    options: &PushOptions,
) -> Result<PushResponse, Status> {
    let mut request = Request::new(body);
    if let Some(timeout) = options.timeout {
        request.set_timeout(timeout);
    }
    if let Some(authorization) = &options.authorization {
        request
            .metadata_mut()
            .insert("authorization", authorization.clone());
    }
    grpc.ready()
        .await
        .map_err(|err| Status::unknown(format!("the channel was not ready: {err}")))?;
    grpc.unary(request, path, PushCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Encodes bytes as they are; decodes the answer with prost.
#[derive(Debug, Clone, Copy, Default)]
struct PushCodec;

impl Codec for PushCodec {
    type Encode = Bytes;
    type Decode = PushResponse;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl Encoder for PushCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for PushCodec {
    type Item = PushResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<PushResponse>, Status> {
        PushResponse::decode(src)
            .map(Some)
            .map_err(|err| Status::internal(format!("decoding the collector's answer: {err}")))
    }
}

#[cfg(test)]
mod tests {
    use stackscope_proto::v1::Sample;

    use super::*;

    /// What goes on the wire is shown by the exporter's tests against a
    /// real tonic server (the agent's `tests/export.rs`), compression
    /// included; these, that the queued bytes are a whole request.
    fn batch(strings: usize) -> Batch {
        Batch {
            batch_id: vec![7; 16],
            strings: (0..strings)
                .map(|i| format!("function_{}", i % 50))
                .collect(),
            samples: vec![Sample {
                stack: 0,
                label_set: 0,
                count: 3,
                sampling_divisor: 1,
            }],
            ..Batch::default()
        }
    }

    #[test]
    fn plain_bytes_decode_as_the_request_with_its_batch() {
        let encoded = RequestEncoder::plain().encode(batch(10));
        let EncodedRequest::Plain(bytes) = &encoded else {
            panic!("{encoded:?}")
        };
        let decoded = PushRequest::decode(bytes.clone()).expect("decodes");
        assert_eq!(decoded.batch, Some(batch(10)));
        assert_eq!(encoded.push_request().unwrap(), *bytes);
    }

    #[test]
    fn compressed_bytes_are_a_smaller_frame_that_states_its_size() {
        let mut encoder = RequestEncoder::zstd(CollectorSupport::default()).unwrap();
        let plain_len = PushRequest {
            batch: Some(batch(2000)),
        }
        .encoded_len();
        // The same encoder twice: what it keeps between batches must not
        // leak into the next.
        for strings in [2000, 30] {
            let encoded = encoder.encode(batch(strings));
            let EncodedRequest::Zstd(bytes) = &encoded else {
                panic!("{encoded:?}")
            };
            let wrapper = CompressedPushRequest::decode(bytes.clone()).expect("decodes");
            let frame = &wrapper.zstd_push_request;
            let request = PushRequest::decode(encoded.push_request().unwrap()).unwrap();
            assert_eq!(request.batch, Some(batch(strings)));
            assert_eq!(
                zstd::zstd_safe::get_frame_content_size(frame).ok(),
                Some(Some(request.encoded_len() as u64))
            );
            if strings == 2000 {
                assert!(
                    encoded.len() * 5 < plain_len,
                    "{} bytes compressed, {plain_len} plain",
                    encoded.len()
                );
            }
        }
    }

    #[test]
    fn while_the_collector_refuses_compressed_pushes_batches_are_encoded_plain() {
        let support = CollectorSupport::default();
        let mut encoder = RequestEncoder::zstd(support.clone()).unwrap();
        assert!(matches!(encoder.encode(batch(10)), EncodedRequest::Zstd(_)));
        support.refused_compressed();
        assert!(!support.takes_compressed());
        let encoded = encoder.encode(batch(10));
        assert_eq!(
            encoded,
            EncodedRequest::Plain(
                PushRequest {
                    batch: Some(batch(10))
                }
                .encode_to_vec()
                .into()
            )
        );
    }

    #[test]
    fn bytes_that_are_not_a_compressed_request_are_data_loss_not_a_panic() {
        for bytes in [
            Bytes::from_static(b"\x0a\x03abc"),
            Bytes::from_static(b"\xff\xff"),
        ] {
            let status = EncodedRequest::Zstd(bytes).push_request().unwrap_err();
            assert_eq!(status.code(), Code::DataLoss, "{status:?}");
        }
    }
}
