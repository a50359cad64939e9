//! Builds `agent-ebpf` for the BPF target with the nightly toolchain and puts
//! the object in `OUT_DIR`, where `lib.rs` embeds it with
//! `include_bytes_aligned!`. Needs nightly `rust-src` and `bpf-linker`:
//! `cargo xtask setup` installs both.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    // Read when the script runs, not baked in when it is compiled: cargo
    // shares a build script's binary between checkouts that use one target
    // directory, and a baked-in path built the other checkout's programs.
    let manifest_dir =
        std::env::var("CARGO_MANIFEST_DIR").context("cargo sets CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir)
        .parent()
        .ok_or_else(|| anyhow!("sampler crate has no parent directory"))?
        .join("agent-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non UTF-8 path {}", ebpf_dir.display()))?;
    aya_build::build_ebpf(
        [Package {
            name: "agent-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::Nightly,
    )
    .context("building the BPF programs failed; `cargo xtask setup` installs nightly rust-src and bpf-linker")
}
