//! The stackscope wire format, generated from the `.proto` files next to this
//! crate: `v1` (ingest and query services) and `pprof` (the profile format
//! `go tool pprof` reads). Owns no logic beyond small helpers on the
//! generated types.

/// `stackscope.v1`: messages plus tonic clients (`*_client`) and servers
/// (`*_server`).
pub mod v1 {
    tonic::include_proto!("stackscope.v1");
}

/// `perftools.profiles`: pprof's `profile.proto`.
pub mod pprof {
    tonic::include_proto!("perftools.profiles");
}

/// The metadata key of a refusal worth retrying later: the least number of
/// milliseconds to wait first, as a decimal integer. It is gRPC's own server
/// pushback (gRFC A6). The collector sends it with `RESOURCE_EXHAUSTED` when
/// its disk is full, so agents tell that (keep the batch, retry) from a
/// batch too large to take (drop it), which carries none.
pub const RETRY_PUSHBACK_KEY: &str = "grpc-retry-pushback-ms";
