//! The Connect protocol's unary calls (connectrpc.com/docs/protocol), which
//! is how Grafana's Pyroscope data source and Pyroscope's SDKs call a
//! server: `POST /<package>.<Service>/<Method>` over HTTP/1.1 or HTTP/2,
//! a body in protobuf (`application/proto`) or JSON (`application/json`,
//! proto3's JSON mapping), optionally gzipped (`Content-Encoding`), the
//! answer in the request's encoding, and an error as a JSON
//! `{"code", "message"}` with the code's HTTP status.
//!
//! Owns the protocol only: decoding requests, encoding answers and errors.
//! JSON is read and written through the messages' descriptors
//! (prost-reflect), so field names and 64-bit integers follow the mapping
//! exactly, as Grafana's and the SDKs' protojson expect. The
//! `Connect-Protocol-Version` header is not required: the SDKs and
//! Grafana's Profiles Drilldown do not send it.

use std::{io::Read as _, sync::OnceLock};

use axum::{
    body::Bytes,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, SerializeOptions};

/// How a request's body was encoded; its answer is encoded the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Proto,
    Json,
}

/// A Connect error code (the ones this server answers with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    ResourceExhausted,
    Unimplemented,
    Internal,
    Unavailable,
}

impl Code {
    fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::ResourceExhausted => "resource_exhausted",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
        }
    }

    /// The HTTP status the protocol gives the code.
    fn status(self) -> StatusCode {
        match self {
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// An error as a Connect client reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
    /// The HTTP status when the protocol's own is not the one to send (415
    /// for a content type the server does not speak, 404 for no method).
    status: Option<StatusCode>,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            status: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// No procedure at this path.
    pub fn no_procedure(path: &str) -> Self {
        Self {
            status: Some(StatusCode::NOT_FOUND),
            ..Self::new(Code::Unimplemented, format!("no procedure {path}"))
        }
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.code.name(), "message": self.message });
        (
            self.status.unwrap_or_else(|| self.code.status()),
            [(header::CONTENT_TYPE, HeaderValue::from_static(JSON))],
            body.to_string(),
        )
            .into_response()
    }
}

const PROTO: &str = "application/proto";
const JSON: &str = "application/json";

/// The descriptors of Pyroscope's messages, read once.
fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(stackscope_proto::pyroscope::DESCRIPTORS)
            .expect("the descriptors built with the crate decode")
    })
}

/// The encoding a request's `Content-Type` names.
fn encoding(headers: &HeaderMap) -> Result<Encoding, ConnectError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        PROTO | "application/protobuf" | "application/x-protobuf" => Ok(Encoding::Proto),
        JSON => Ok(Encoding::Json),
        _ => Err(ConnectError {
            status: Some(StatusCode::UNSUPPORTED_MEDIA_TYPE),
            ..ConnectError::new(
                Code::Unimplemented,
                format!(
                    "content type {content_type:?} is not one this server speaks: send \
                     {PROTO} or {JSON}"
                ),
            )
        }),
    }
}

/// The body with its `Content-Encoding` undone, at most `limit` bytes.
pub fn decompressed(headers: &HeaderMap, body: Bytes, limit: usize) -> Result<Bytes, ConnectError> {
    let too_large = || {
        ConnectError::new(
            Code::ResourceExhausted,
            format!("the request is larger than {limit} bytes"),
        )
    };
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    let plain = match encoding.as_str() {
        "identity" | "" => body,
        "gzip" => {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&body[..])
                .take(limit as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|err| ConnectError::invalid(format!("the gzipped body: {err}")))?;
            Bytes::from(out)
        }
        other => {
            return Err(ConnectError::new(
                Code::Unimplemented,
                format!("content encoding {other:?} is not one this server takes (gzip, identity)"),
            ));
        }
    };
    if plain.len() > limit {
        return Err(too_large());
    }
    Ok(plain)
}

/// Decodes a request body into `T`, the message Pyroscope's API names
/// `full_name`.
pub fn decode<T: prost::Message + Default>(
    headers: &HeaderMap,
    body: Bytes,
    full_name: &str,
    limit: usize,
) -> Result<(T, Encoding), ConnectError> {
    let encoding = encoding(headers)?;
    let body = decompressed(headers, body, limit)?;
    let bytes = match encoding {
        Encoding::Proto => body,
        Encoding::Json => {
            let descriptor = pool()
                .get_message_by_name(full_name)
                .unwrap_or_else(|| panic!("{full_name} is one of the descriptors' messages"));
            let mut json = serde_json::Deserializer::from_slice(&body);
            // Unknown fields are ignored, as protojson does for Connect.
            let message = DynamicMessage::deserialize_with_options(
                descriptor,
                &mut json,
                &DeserializeOptions::new().deny_unknown_fields(false),
            )
            .and_then(|message| json.end().map(|()| message))
            .map_err(|err| ConnectError::invalid(format!("the JSON body: {err}")))?;
            Bytes::from(prost::Message::encode_to_vec(&message))
        }
    };
    let message = T::decode(bytes)
        .map_err(|err| ConnectError::invalid(format!("the protobuf body: {err}")))?;
    Ok((message, encoding))
}

/// The answer `message` (Pyroscope's `full_name`) in `encoding`.
pub fn respond<T: prost::Message>(message: &T, full_name: &str, encoding: Encoding) -> Response {
    let bytes = message.encode_to_vec();
    match encoding {
        Encoding::Proto => (
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROTO))],
            bytes,
        )
            .into_response(),
        Encoding::Json => {
            let descriptor = pool()
                .get_message_by_name(full_name)
                .unwrap_or_else(|| panic!("{full_name} is one of the descriptors' messages"));
            let json = DynamicMessage::decode(descriptor, &bytes[..])
                .map_err(|err| err.to_string())
                .and_then(|message| {
                    let mut out = serde_json::Serializer::new(Vec::new());
                    message
                        .serialize_with_options(&mut out, &SerializeOptions::new())
                        .map(|()| out.into_inner())
                        .map_err(|err| err.to_string())
                });
            match json {
                Ok(json) => (
                    [(header::CONTENT_TYPE, HeaderValue::from_static(JSON))],
                    json,
                )
                    .into_response(),
                Err(err) => ConnectError::new(
                    Code::Internal,
                    format!("encoding the answer as JSON: {err}"),
                )
                .into_response(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use stackscope_proto::pyroscope::querier::v1::{ProfileTypesRequest, SelectSeriesRequest};

    use super::*;

    fn headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
        headers
    }

    #[test]
    fn json_follows_protojson_names_and_64_bit_integers() {
        // Field names as written and as protojson's camelCase, int64 as a
        // number and as a string, an unknown field ignored.
        let body = r#"{"profile_typeID":"process_cpu:cpu:nanoseconds:cpu:nanoseconds",
            "labelSelector":"{}","start":"1000","end":4000,"step":15,"unknown":1}"#;
        let (request, encoding): (SelectSeriesRequest, _) = decode(
            &headers("application/json; charset=utf-8"),
            Bytes::from(body),
            "querier.v1.SelectSeriesRequest",
            1 << 20,
        )
        .unwrap();
        assert_eq!(encoding, Encoding::Json);
        assert_eq!(
            (request.start, request.end, request.step),
            (1000, 4000, 15.0)
        );
        assert_eq!(request.label_selector, "{}");

        let response = respond(
            &ProfileTypesRequest { start: 5, end: 0 },
            "querier.v1.ProfileTypesRequest",
            Encoding::Json,
        );
        assert_eq!(response.status(), StatusCode::OK);
        // int64 as a string, a default value left out.
        assert_eq!(body_of(response), r#"{"start":"5"}"#);
    }

    /// A response's body (`respond` builds it whole, in memory).
    fn body_of(response: Response) -> String {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let bytes = runtime
            .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
            .expect("the body");
        String::from_utf8(bytes.to_vec()).expect("UTF-8")
    }

    #[test]
    fn bad_requests_get_connect_errors() {
        let decode_with = |headers: HeaderMap, body: &'static [u8]| {
            decode::<ProfileTypesRequest>(
                &headers,
                Bytes::from_static(body),
                "querier.v1.ProfileTypesRequest",
                64,
            )
            .unwrap_err()
        };
        let err = decode_with(headers("text/plain"), b"");
        assert_eq!(
            err.into_response().status(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        let err = decode_with(headers("application/json"), b"{\"start\": \"x\"}");
        assert_eq!(err.code, Code::InvalidArgument, "{}", err.message);
        let err = decode_with(headers("application/proto"), b"\x08");
        assert_eq!(err.code, Code::InvalidArgument, "{}", err.message);
        let mut gzipped = headers("application/proto");
        gzipped.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let err = decode_with(gzipped, b"not gzip");
        assert_eq!(err.code, Code::InvalidArgument, "{}", err.message);
        let err = decode_with(headers("application/proto"), &[0u8; 65]);
        assert_eq!(err.code, Code::ResourceExhausted);
        let mut brotli = headers("application/proto");
        brotli.insert(header::CONTENT_ENCODING, "br".parse().unwrap());
        assert_eq!(decode_with(brotli, b"").code, Code::Unimplemented);
    }
}
