//! `cargo xtask bench symbolize`: how fast the collector names stored
//! frames at query time (a report, not a test: it prints figures and never
//! fails on them), against elfutils' `eu-addr2line` and binutils'
//! `addr2line` on the same addresses in the same run.
//!
//! The debuginfo is the nightly toolchain's `librustc_driver` (158 MB,
//! 120k functions in its symbol table, BOLT-split text), given a build-id
//! note (it ships without one) in a temporary copy. The profile:
//! `STACKS` distinct stacks (default 10,000) of depth 30 over `ADDRESSES`
//! distinct code addresses (default 20,000), all unnamed, as storage hands
//! them to the query engine. Measured: naming alone, cold (a new
//! symbolizer: the file is parsed) and warm (names cached), and a whole
//! flamegraph (naming, merging the tree, rendering the SVG), cold and warm.
//! Every frame must come out named with its symbol's own name.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use stackscope_collector::debuginfo::{
    DebuginfoError, DebuginfoStore, StagedFile, symbolize::Symbolizer,
};
use stackscope_profile::{
    model::{CodeAddress, Frame, StackSamples, WeightedStack},
    render::{self, SvgOptions},
    tree::CallTree,
};
use stackscope_symbolize::demangle;

const DEPTH: usize = 30;
const BUILD_ID: &str = "5374616b73636f70652062656e636821";

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A store holding one file, for one build-id.
struct OneFile(PathBuf);

impl DebuginfoStore for OneFile {
    fn get(&self, build_id: &str) -> Option<PathBuf> {
        (build_id == BUILD_ID).then(|| self.0.clone())
    }

    fn stage(&self) -> Result<StagedFile, DebuginfoError> {
        unreachable!("the bench stores nothing")
    }

    fn commit(&self, _: &str, _: StagedFile) -> Result<bool, DebuginfoError> {
        unreachable!("the bench stores nothing")
    }
}

/// `librustc_driver` with a build-id note, in `dir`.
fn driver_with_build_id(dir: &Path) -> PathBuf {
    let sysroot = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .expect("rustc +nightly");
    let lib = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim()).join("lib");
    let driver = std::fs::read_dir(&lib)
        .expect("the nightly toolchain's lib")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("librustc_driver-") && name.ends_with(".so"))
        })
        .expect("librustc_driver in the nightly toolchain");
    let mut note = Vec::new();
    let desc = hex(BUILD_ID);
    for word in [4u32, desc.len() as u32, 3] {
        note.extend_from_slice(&word.to_le_bytes());
    }
    note.extend_from_slice(b"GNU\0");
    note.extend_from_slice(&desc);
    let note_path = dir.join("build-id.note");
    std::fs::write(&note_path, note).expect("writing the note");
    let out = dir.join("librustc_driver.so");
    let status = Command::new("objcopy")
        .arg(format!(
            "--add-section=.note.gnu.build-id={}",
            note_path.display()
        ))
        .arg(&driver)
        .arg(&out)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("objcopy");
    assert!(status.success(), "objcopy failed on {}", driver.display());
    out
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// `count` distinct function addresses (one byte into the function) with
/// their file offsets and the demangled names of every symbol there
/// (aliases: any of them is the right answer).
fn addresses(path: &Path, count: usize, rng: &mut StdRng) -> Vec<(u64, u64, Vec<String>)> {
    let data = std::fs::read(path).expect("reading the library");
    let elf = object::File::parse(&*data).expect("ELF");
    let mut by_address: HashMap<u64, Vec<String>> = HashMap::new();
    for symbol in elf.symbols() {
        if symbol.kind() == object::SymbolKind::Text
            && symbol.size() > 16
            && let Ok(name) = symbol.name()
        {
            by_address
                .entry(symbol.address())
                .or_default()
                .push(demangle(name));
        }
    }
    let mut functions: Vec<(u64, Vec<String>)> = by_address.into_iter().collect();
    functions.sort_unstable();
    let segments: Vec<(u64, u64, u64)> = elf
        .segments()
        .map(|s| (s.address(), s.size(), s.file_range().0))
        .collect();
    let mut chosen = Vec::with_capacity(count);
    while chosen.len() < count.min(functions.len()) {
        let (vaddr, name) = functions.swap_remove(rng.random_range(0..functions.len()));
        let vaddr = vaddr + 1;
        let Some(&(start, _, offset)) = segments
            .iter()
            .find(|(start, size, _)| (*start..start + size).contains(&vaddr))
        else {
            continue;
        };
        chosen.push((vaddr, vaddr - start + offset, name));
    }
    chosen
}

fn profile(addresses: &[(u64, u64, Vec<String>)], stacks: usize, rng: &mut StdRng) -> StackSamples {
    let frames: Vec<Arc<Frame>> = addresses
        .iter()
        .map(|&(vaddr, file_offset, _)| {
            Arc::new(Frame {
                build_id: BUILD_ID.into(),
                unnamed_code: Some(CodeAddress {
                    file_offset,
                    vaddr: Some(vaddr),
                }),
                ..Frame::synthetic(
                    Frame::unknown_function("librustc_driver.so", file_offset),
                    "librustc_driver.so",
                )
            })
        })
        .collect();
    StackSamples {
        stacks: (0..stacks)
            .map(|i| WeightedStack {
                // The first frame distinct per stack: every stack differs.
                frames: std::iter::once(Arc::clone(&frames[i % frames.len()]))
                    .chain(
                        (1..DEPTH).map(|_| Arc::clone(&frames[rng.random_range(0..frames.len())])),
                    )
                    .collect(),
                weight: 1 + (i as u64 % 7),
            })
            .collect(),
        sample_period_nanos: 10_000_000,
    }
}

/// Seconds a peer took to name `addresses` (ELF virtual addresses).
fn peer(
    program: &str,
    args: &[&str],
    library: &Path,
    addresses: &[(u64, u64, Vec<String>)],
) -> Option<Duration> {
    let started = Instant::now();
    let out = Command::new(program)
        .args(args)
        .arg("-e")
        .arg(library)
        .args(addresses.iter().map(|(vaddr, _, _)| format!("{vaddr:#x}")))
        .output()
        .ok()?;
    let took = started.elapsed();
    out.status.success().then_some(took)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --bench symbolize` (run by
    // `cargo xtask test`) does not: one small round then, checking that
    // every frame is named right.
    let full = std::env::args().any(|arg| arg == "--bench");
    let stacks = env_or("STACKSCOPE_BENCH_STACKS", if full { 10_000 } else { 200 });
    let distinct = env_or(
        "STACKSCOPE_BENCH_ADDRESSES",
        if full { 20_000 } else { 500 },
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let library = driver_with_build_id(dir.path());
    let mut rng = StdRng::seed_from_u64(7);
    let addresses = addresses(&library, distinct, &mut rng);
    let samples = profile(&addresses, stacks, &mut rng);
    let expected: HashMap<u64, &[String]> = addresses
        .iter()
        .map(|(_, offset, names)| (*offset, names.as_slice()))
        .collect();
    println!(
        "symbolize bench: {stacks} stacks of depth {DEPTH} over {} distinct addresses of {} \
         ({} MB)",
        addresses.len(),
        library.display(),
        std::fs::metadata(&library).map_or(0, |m| m.len() >> 20)
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let symbolizer =
        Symbolizer::start(Arc::new(OneFile(library.clone())), None).expect("symbolizer");
    let mut timings = Vec::new();
    for round in ["cold", "warm"] {
        let started = Instant::now();
        let named = runtime
            .block_on(symbolizer.name(samples.clone()))
            .expect("naming");
        let naming = started.elapsed();
        let tree = CallTree::from_stacks(&named);
        let svg = render::svg(&tree, &SvgOptions::default()).expect("rendering");
        let whole = started.elapsed();
        // Every frame named, with its own symbol's name.
        for (stack, original) in named.stacks.iter().zip(&samples.stacks) {
            assert_eq!(
                stack.frames.len(),
                original.frames.len(),
                "no inlined frames here"
            );
            for (frame, unnamed) in stack.frames.iter().zip(&original.frames) {
                let offset = unnamed.unnamed_code.expect("unnamed").file_offset;
                assert!(
                    expected[&offset].contains(&frame.function),
                    "{round}: the frame at {offset:#x} is {}, not one of {:?}",
                    frame.function,
                    expected[&offset]
                );
            }
        }
        println!(
            "  {round}: named {} frames in {:.1} ms ({:.0} frames/s); flamegraph (naming, tree, \
             {} KB SVG) in {:.1} ms",
            addresses.len(),
            naming.as_secs_f64() * 1e3,
            addresses.len() as f64 / naming.as_secs_f64(),
            svg.len() >> 10,
            whole.as_secs_f64() * 1e3
        );
        timings.push(naming);
    }
    for (name, program, args) in [
        ("eu-addr2line (elfutils)", "eu-addr2line", &["-f", "-C"][..]),
        ("addr2line (binutils)", "addr2line", &["-f", "-C"][..]),
    ] {
        match peer(program, args, &library, &addresses) {
            Some(took) => println!(
                "  {name}: {} addresses in {:.1} ms ({:.0} frames/s): stackscope cold is {:.1}x \
                 its speed",
                addresses.len(),
                took.as_secs_f64() * 1e3,
                addresses.len() as f64 / took.as_secs_f64(),
                took.as_secs_f64() / timings[0].as_secs_f64()
            ),
            None => println!("  {name}: not available"),
        }
    }
}
