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
