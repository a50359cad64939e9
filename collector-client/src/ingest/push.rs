//! The push of one batch, sent as bytes encoded once when it was queued.
//!
//! The generated client takes a `PushRequest` message and encodes it on
//! every attempt, into tonic's buffer a varint at a time; keeping the
//! message queued for retries also meant a deep copy of it per attempt. A
//! batch is instead encoded into one buffer when it is queued, and every
//! attempt hands those bytes to tonic as they are (tonic still compresses
//! and frames them). The bytes on the wire are the same.
//!
//! Owns: the ingest service's push path and the codec. Does not own
//! the queue or the connection (the agent's exporter does).

use prost::{
    Message as _,
    bytes::{BufMut as _, Bytes},
};
use stackscope_proto::v1::{Batch, PushRequest, PushResponse};
use tonic::{
    Request, Response, Status,
    codec::{Codec, CompressionEncoding, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::http::uri::PathAndQuery,
    transport::Channel,
};

/// The method the generated client calls for `Ingest.Push`.
const PUSH_PATH: &str = "/stackscope.v1.Ingest/Push";

/// `PushRequest { batch }`, encoded.
pub fn encode(batch: Batch) -> Bytes {
    PushRequest { batch: Some(batch) }.encode_to_vec().into()
}

/// A client of the ingest service that pushes encoded requests.
#[derive(Debug, Clone)]
pub struct IngestPusher {
    grpc: tonic::client::Grpc<Channel>,
}

impl IngestPusher {
    pub fn new(channel: Channel, compression: Option<CompressionEncoding>) -> Self {
        let mut grpc = tonic::client::Grpc::new(channel);
        if let Some(encoding) = compression {
            grpc = grpc.send_compressed(encoding);
        }
        Self { grpc }
    }

    /// Pushes `request`: a `PushRequest` from [`encode`].
    pub async fn push(
        &mut self,
        request: Request<Bytes>,
    ) -> Result<Response<PushResponse>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|err| Status::unknown(format!("the channel was not ready: {err}")))?;
        self.grpc
            .unary(request, PathAndQuery::from_static(PUSH_PATH), PushCodec)
            .await
    }
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
    use super::*;

    /// What goes on the wire is shown by the exporter's tests against a
    /// real tonic server (the agent's `tests/export.rs`), compression included;
    /// this one, that the queued bytes are a whole request.
    #[test]
    fn queued_bytes_decode_as_the_request_with_its_batch() {
        let batch = Batch {
            batch_id: vec![7; 16],
            strings: vec![String::new(), "main".into()],
            ..Batch::default()
        };
        let bytes = encode(batch.clone());
        let decoded = PushRequest::decode(bytes).expect("decodes");
        assert_eq!(decoded.batch, Some(batch));
    }
}
