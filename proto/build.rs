//! Compiles the `.proto` files with protox (pure Rust, no system protoc) and
//! generates prost messages plus tonic clients and servers.

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
        .compile_fds(descriptors)
        .context("generating Rust code from the .proto files")?;
    Ok(())
}
