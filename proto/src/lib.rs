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

/// Grafana Pyroscope's API, as its own `.proto` files have it (packages,
/// names and field numbers unchanged, so Grafana and the SDKs read and
/// write them as Pyroscope's).
#[cfg(feature = "pyroscope")]
pub mod pyroscope {
    /// `types.v1`: label pairs, series, profile types.
    pub mod types {
        pub mod v1 {
            tonic::include_proto!("types.v1");
        }
    }
    /// `querier.v1`: the query messages Grafana's data source sends.
    pub mod querier {
        pub mod v1 {
            tonic::include_proto!("querier.v1");
        }
    }
    /// `push.v1`: the SDKs' pushes.
    pub mod push {
        pub mod v1 {
            tonic::include_proto!("push.v1");
        }
    }
    /// `google.v1`: pprof's profile under Pyroscope's package name.
    pub mod google {
        pub mod v1 {
            tonic::include_proto!("google.v1");
        }
    }

    /// The files' `FileDescriptorSet`: what their JSON encoding is read from.
    pub const DESCRIPTORS: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/pyroscope_descriptors.bin"));
}

/// The metadata key of a refusal worth retrying later: the least number of
/// milliseconds to wait first, as a decimal integer. It is gRPC's own server
/// pushback (gRFC A6). The collector sends it with `RESOURCE_EXHAUSTED` when
/// its disk is full, so agents tell that (keep the batch, retry) from a
/// batch too large to take (drop it), which carries none.
pub const RETRY_PUSHBACK_KEY: &str = "grpc-retry-pushback-ms";
