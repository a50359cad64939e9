//! Compiles the `.proto` files with protox (pure Rust, no system protoc) and
//! generates prost messages plus tonic clients and servers; with the
//! `pyroscope` feature, also Pyroscope's API messages (no services: the
//! collector serves them over the Connect protocol itself) and their
//! descriptors, which the JSON encoding of those messages is read from.

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let files = [
        "stackscope/v1/ingest.proto",
        "stackscope/v1/query.proto",
        "stackscope/v1/debuginfo.proto",
        "pprof/profile.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."]).context("parsing the .proto files")?;
    tonic_prost_build::configure()
        // The collector decompresses it in place rather than copy it out.
        .bytes(".stackscope.v1.CompressedPushRequest.zstd_push_request")
        .compile_fds(descriptors)
        .context("generating Rust code from the .proto files")?;

    if std::env::var_os("CARGO_FEATURE_PYROSCOPE").is_some() {
        // Pyroscope's files import each other from their API's root.
        let files = [
            "types/v1/types.proto",
            "querier/v1/querier.proto",
            "push/v1/push.proto",
            "google/v1/profile.proto",
        ];
        println!("cargo:rerun-if-changed=pyroscope");
        let descriptors =
            protox::compile(files, ["pyroscope"]).context("parsing Pyroscope's .proto files")?;
        let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
        std::fs::write(
            out.join("pyroscope_descriptors.bin"),
            prost::Message::encode_to_vec(&descriptors),
        )
        .context("writing Pyroscope's descriptors")?;
        tonic_prost_build::configure()
            .build_client(false)
            .build_server(false)
            .compile_fds(descriptors)
            .context("generating Rust code from Pyroscope's .proto files")?;
    }
    Ok(())
}
