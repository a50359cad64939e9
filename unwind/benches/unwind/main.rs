//! `cargo bench -p stackscope-unwind` (run by `cargo xtask bench unwind`): a
//! report, not a test. It never asserts a time; it prints figures, ratios and
//! the targets next to them.
//!
//! This file owns what is timed and the summary:
//! 1. table compile time for libc and, when the nightly toolchain is
//!    installed, its `librustc_driver` and `libLLVM` (large, BOLT-split), next
//!    to the up-front work framehop 0.16 does on the same `.eh_frame`;
//! 2. unwinding cost per stack on samples recorded from a running deep-stack
//!    program (`recording.rs`), ours against framehop on the very same
//!    inputs, after checking that both return identical frames;
//! 3. heap bytes per compiled table.
//!
//! Inputs are read and prepared outside the timed loops; criterion's group
//! settings keep the whole run within a few minutes.

#[path = "../../tests/common/mod.rs"]
mod common;
mod recording;
mod report;

use std::{
    collections::BTreeMap,
    hint::black_box,
    path::PathBuf,
    process::Command,
    time::{Duration, SystemTime},
};

use criterion::{BatchSize, Criterion, SamplingMode, Throughput};
use framehop::{
    FrameAddress, Module, Unwinder as _,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};
use object::{Object as _, ObjectSection as _};
use recording::{OurModules, Recording, framehop_unwinder, section_info, walk_framehop, walk_ours};
use report::{Estimates, Report, duration};
use stackscope_unwind::{DEFAULT_MAX_DEPTH, RuleCache, UnwindRule, UnwindTable, unwind_cached};

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
/// Snapshots of the running fixture.
const SAMPLES: usize = 200;
/// The sampler's default stack copy.
const STACK_BYTES: usize = 32 * 1024;
/// Target from the design: the largest common binary compiles within this
/// on one core, so a cold agent has its table in well under a second.
const RUSTC_DRIVER_TARGET_MS: f64 = 300.0;
/// Target: unwinding at least this many times faster than framehop.
const SPEEDUP_TARGET: f64 = 2.0;
/// Files above this size take hundreds of milliseconds per compile: fewer,
/// flat samples keep their groups to a few seconds.
const LARGE_FILE: usize = 50 << 20;

/// A binary whose table compile is measured.
struct Binary {
    /// Short name for criterion's group id and the summary.
    label: &'static str,
    path: PathBuf,
}

/// What one compile (outside the timed loop) says about a table.
struct TableFacts {
    label: &'static str,
    file: String,
    eh_frame_bytes: u64,
    rows: usize,
    rules: usize,
    heap_bytes: usize,
    /// Whether framehop's module built without `.eh_frame_hdr` found CFI,
    /// i.e. its FDE index was really built (it silently falls back to frame
    /// pointers when the index fails).
    framehop_indexed: bool,
}

fn main() {
    let started = SystemTime::now();
    let dir = report::criterion_dir();
    let mut criterion = Criterion::default()
        .output_directory(&dir)
        .without_plots()
        // criterion's default (100 000) spends seconds per benchmark on
        // resampling; 20 000 still gives stable confidence intervals.
        .nresamples(20_000)
        .configure_from_args();
    let mut report = Report::default();
    report.line("== stackscope-unwind benchmark (cargo xtask bench unwind) ==");

    // Recorded first: a fixture that cannot be built or traced fails the run
    // before minutes of compile benchmarks.
    let recording = recording::record(SAMPLES, STACK_BYTES);
    let ours = OurModules::new(&recording.files);
    let framehop = framehop_unwinder(&recording.files);
    let check = compare(&recording, &ours, &framehop);

    let mut notes = Vec::new();
    let mut tables = Vec::new();
    for binary in binaries(&mut notes) {
        let data = match std::fs::read(&binary.path) {
            Ok(data) => data,
            Err(error) => {
                notes.push(format!("skipped {}: {error}", binary.path.display()));
                continue;
            }
        };
        match bench_compile(&mut criterion, &binary, &data) {
            Ok(facts) => tables.push(facts),
            Err(error) => notes.push(format!("skipped {}: {error}", binary.path.display())),
        }
    }

    bench_walks(&mut criterion, &recording, &ours, &framehop);
    criterion.final_summary();

    let estimates = Estimates::new(dir, started);
    report_tables(&mut report, &estimates, &tables, &notes);
    report_walks(&mut report, &estimates, &recording, &check);
    report_memory(&mut report, &tables);
    report.finish();
}

/// libc always; the nightly toolchain's two largest libraries when
/// `rustc +nightly` answers (a note otherwise).
fn binaries(notes: &mut Vec<String>) -> Vec<Binary> {
    let mut binaries = vec![Binary {
        label: "libc",
        path: PathBuf::from(LIBC),
    }];
    let sysroot = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let Some(sysroot) = sysroot else {
        notes.push(
            "skipped librustc_driver and libLLVM: `rustc +nightly --print sysroot` failed"
                .to_owned(),
        );
        return binaries;
    };
    let lib = sysroot.join("lib");
    let entries: Vec<PathBuf> = std::fs::read_dir(&lib)
        .map(|dir| dir.filter_map(|entry| Some(entry.ok()?.path())).collect())
        .unwrap_or_default();
    let find = |prefix: &str, suffix: &str| {
        entries.iter().find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(prefix) && name.ends_with(suffix))
        })
    };
    // `libLLVM-<N>-rust-*.so` is a one-line linker script; the library is
    // `libLLVM.so.<version>`.
    for (label, prefix, suffix) in [
        ("librustc_driver", "librustc_driver-", ".so"),
        ("libLLVM", "libLLVM.so.", ""),
    ] {
        match find(prefix, suffix) {
            Some(path) => binaries.push(Binary {
                label,
                path: path.clone(),
            }),
            None => notes.push(format!(
                "skipped {label}: no {prefix}*{suffix} in {}",
                lib.display()
            )),
        }
    }
    binaries
}

/// Times our compile and framehop's module construction on one file, then
/// compiles once more, untimed, for the table's figures.
fn bench_compile(
    criterion: &mut Criterion,
    binary: &Binary,
    data: &[u8],
) -> Result<TableFacts, String> {
    let table = UnwindTable::from_elf(data).map_err(|error| error.to_string())?;
    let file = object::File::parse(data).map_err(|error| error.to_string())?;
    let eh_frame_bytes = file
        .section_by_name(".eh_frame")
        .map_or(0, |section| section.size());
    let with_hdr = section_info(data, true);
    let without_hdr = section_info(data, false);
    let avma = 0..data.len() as u64;

    let mut group = criterion.benchmark_group(format!("compile_{}", binary.label));
    // Flat: the same iteration count per sample. Linear sampling would run
    // 55 iterations at least, over 10 s for a 200 ms compile.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(if data.len() > LARGE_FILE {
            4
        } else {
            2
        }));
    group.bench_function("stackscope", |b| {
        b.iter(|| UnwindTable::from_elf(black_box(data)));
    });
    group.bench_function("framehop_index", |b| {
        b.iter(|| {
            Module::new(
                String::new(),
                avma.clone(),
                0,
                black_box(without_hdr.clone()),
            )
        });
    });
    group.bench_function("framehop_hdr", |b| {
        b.iter(|| Module::new(String::new(), avma.clone(), 0, black_box(with_hdr.clone())));
    });
    group.finish();

    let framehop_indexed = framehop_finds_cfi(
        Module::new(String::new(), avma.clone(), 0, without_hdr),
        &table,
    );
    Ok(TableFacts {
        label: binary.label,
        file: binary
            .path
            .file_name()
            .map_or_else(String::new, |name| name.to_string_lossy().into_owned()),
        eh_frame_bytes,
        rows: table.len(),
        rules: table.rule_count(),
        heap_bytes: table.heap_bytes(),
        framehop_indexed,
    })
}

/// Unwinds one frame at a function entry (cfa = rsp + 8 by every ABI) with
/// `module`: with CFI, framehop reads the return address at rsp; its
/// frame-pointer fallback would read it at rbp + 8 instead.
fn framehop_finds_cfi(module: Module<&[u8]>, table: &UnwindTable) -> bool {
    let Some((entry, _)) = table
        .rows()
        .find(|&(_, rule)| rule == Some(UnwindRule::Rsp { cfa_off: 8 }))
    else {
        return false;
    };
    let mut unwinder = UnwinderX86_64::new();
    unwinder.add_module(module);
    let (rsp, rbp) = (0x10_0000, 0x20_0000);
    // Every word reads as its own address, so the result says where it was read.
    let mut read_stack = |address: u64| Ok(address);
    let mut regs = UnwindRegsX86_64::new(entry, rsp, rbp);
    let result = unwinder.unwind_frame(
        FrameAddress::from_instruction_pointer(entry),
        &mut regs,
        &mut CacheX86_64::new(),
        &mut read_stack,
    );
    result == Ok(Some(rsp))
}

/// The outcome of walking every sample with both unwinders, untimed.
struct Check {
    mismatches: usize,
    first_mismatch: Option<String>,
    frames: usize,
    min_depth: usize,
    max_depth: usize,
    distinct_rips: usize,
    /// How our walks ended, by `UnwindEnd`.
    ends: BTreeMap<String, usize>,
    /// Which file frame 0 was in.
    frame0_files: BTreeMap<String, usize>,
    /// How our walks ended in the samples whose frames differ.
    mismatch_ends: BTreeMap<String, usize>,
}

fn compare(recording: &Recording, ours: &OurModules, framehop: &UnwinderX86_64<&[u8]>) -> Check {
    let mut cache = CacheX86_64::new();
    let (mut our_frames, mut their_frames) = (Vec::new(), Vec::new());
    let mut check = Check {
        mismatches: 0,
        first_mismatch: None,
        frames: 0,
        min_depth: usize::MAX,
        max_depth: 0,
        distinct_rips: 0,
        ends: BTreeMap::new(),
        frame0_files: BTreeMap::new(),
        mismatch_ends: BTreeMap::new(),
    };
    let mut rips = Vec::new();
    for (index, sample) in recording.samples.iter().enumerate() {
        let end = walk_ours(sample, ours, DEFAULT_MAX_DEPTH, &mut our_frames);
        let error = walk_framehop(
            sample,
            framehop,
            &mut cache,
            DEFAULT_MAX_DEPTH,
            &mut their_frames,
        );
        *check.ends.entry(format!("{end:?}")).or_default() += 1;
        let file = recording
            .files
            .iter()
            .find(|file| file.avma.contains(&sample.regs.rip))
            .and_then(|file| file.path.file_name())
            .map_or_else(
                || "unmapped".to_owned(),
                |name| name.to_string_lossy().into_owned(),
            );
        *check.frame0_files.entry(file).or_default() += 1;
        rips.push(sample.regs.rip);
        check.frames += our_frames.len();
        check.min_depth = check.min_depth.min(our_frames.len());
        check.max_depth = check.max_depth.max(our_frames.len());
        if our_frames != their_frames {
            check.mismatches += 1;
            *check.mismatch_ends.entry(format!("{end:?}")).or_default() += 1;
            check.first_mismatch.get_or_insert_with(|| {
                mismatch(
                    index,
                    &our_frames,
                    &their_frames,
                    &format!("{end:?}"),
                    error,
                )
            });
        }
    }
    rips.sort_unstable();
    rips.dedup();
    check.distinct_rips = rips.len();
    check
}

/// Both frame lists of one sample side by side, differing rows marked, up
/// to a few rows past the first difference.
fn mismatch(
    index: usize,
    ours: &[u64],
    theirs: &[u64],
    our_end: &str,
    their_error: Option<framehop::Error>,
) -> String {
    let mut text = format!(
        "  first mismatch: sample {index}; ours: {} frames, ended {our_end}; framehop: {} frames, ended {}\n",
        ours.len(),
        theirs.len(),
        their_error.map_or_else(|| "at the outermost frame".to_owned(), |e| e.to_string())
    );
    text.push_str("         #  ours                framehop\n");
    let show = |frame: Option<&u64>| frame.map_or_else(|| "-".to_owned(), |f| format!("{f:#x}"));
    let rows = ours.len().max(theirs.len());
    let first = (0..rows)
        .find(|&i| ours.get(i) != theirs.get(i))
        .unwrap_or(0);
    let shown = rows.min(first + 4);
    for i in 0..shown {
        let (a, b) = (ours.get(i), theirs.get(i));
        let mark = if a == b { ' ' } else { '*' };
        text.push_str(&format!(
            "    {mark} {i:>4}  {:>18}  {:>18}\n",
            show(a),
            show(b)
        ));
    }
    if shown < rows {
        text.push_str(&format!("      ... {} more rows\n", rows - shown));
    }
    text.trim_end().to_owned()
}

/// Both unwinders over all samples per iteration; the summary divides by the
/// sample count. framehop keeps one rule cache across iterations, as a
/// profiler does, so it runs warm: its best case, since these stacks repeat
/// a few dozen return addresses. The cold-cache run shows the other end.
fn bench_walks(
    criterion: &mut Criterion,
    recording: &Recording,
    ours: &OurModules,
    framehop: &UnwinderX86_64<&[u8]>,
) {
    let samples = &recording.samples;
    let mut group = criterion.benchmark_group("walk");
    group
        .throughput(Throughput::Elements(samples.len() as u64))
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    group.bench_function("stackscope", |b| {
        let mut frames = Vec::new();
        b.iter(|| {
            for sample in samples {
                black_box(walk_ours(
                    black_box(sample),
                    ours,
                    DEFAULT_MAX_DEPTH,
                    &mut frames,
                ));
                black_box(frames.len());
            }
        });
    });
    // As the agent walks: a rule cache kept across stacks (warm, like
    // framehop's below), all samples in one address space.
    group.bench_function("stackscope_rule_cache", |b| {
        let mut frames = Vec::new();
        let mut cache = RuleCache::default();
        b.iter(|| {
            for sample in samples {
                black_box(unwind_cached(
                    black_box(sample).regs,
                    &sample.stack,
                    ours,
                    &mut cache,
                    1,
                    DEFAULT_MAX_DEPTH,
                    &mut frames,
                ));
                black_box(frames.len());
            }
        });
    });
    group.bench_function("framehop", |b| {
        let mut frames = Vec::new();
        let mut cache = CacheX86_64::new();
        b.iter(|| {
            for sample in samples {
                black_box(walk_framehop(
                    black_box(sample),
                    framehop,
                    &mut cache,
                    DEFAULT_MAX_DEPTH,
                    &mut frames,
                ));
                black_box(frames.len());
            }
        });
    });
    // A fresh cache per stack (made outside the timing): framehop's lazy
    // path, evaluating each FDE's CFI with gimli on first use, as after a
    // cache eviction or for a process not seen before.
    group.bench_function("framehop_cold_cache", |b| {
        let mut frames = Vec::new();
        b.iter_batched_ref(
            || {
                (0..samples.len())
                    .map(|_| CacheX86_64::new())
                    .collect::<Vec<_>>()
            },
            |caches| {
                for (sample, cache) in samples.iter().zip(caches.iter_mut()) {
                    black_box(walk_framehop(
                        black_box(sample),
                        framehop,
                        cache,
                        DEFAULT_MAX_DEPTH,
                        &mut frames,
                    ));
                    black_box(frames.len());
                }
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

fn report_tables(
    report: &mut Report,
    estimates: &Estimates,
    tables: &[TableFacts],
    notes: &[String],
) {
    report.line("");
    report.line("1. Table compile time, one core (our compiler is single-threaded)");
    report.line(format!(
        "  {:<38} {:>10} {:>9} {:>6} {:>12}",
        "file", ".eh_frame", "rows", "rules", "compile"
    ));
    for table in tables {
        let group = format!("compile_{}", table.label);
        report.line(format!(
            "  {:<38} {:>6} KiB {:>9} {:>6} {:>12}",
            table.file,
            table.eh_frame_bytes / 1024,
            table.rows,
            table.rules,
            duration(estimates.ns(&group, "stackscope")),
        ));
    }
    report.line(
        "  framehop 0.16 builds no table: it evaluates an FDE's CFI when an address is first \
         unwound and caches the rule (509 slots). Only its up-front Module::new is comparable: \
         with .eh_frame_hdr it stores the slices (no work); without it, it indexes FDE starts \
         (parses every FDE header, evaluates no CFI).",
    );
    report.line(format!(
        "  {:<38} {:>12} {:>22} {:>20}",
        "file", "ours", "framehop FDE index", "framehop with hdr"
    ));
    for table in tables {
        let group = format!("compile_{}", table.label);
        let index = duration(estimates.ns(&group, "framehop_index"));
        report.line(format!(
            "  {:<38} {:>12} {:>22} {:>20}",
            table.file,
            duration(estimates.ns(&group, "stackscope")),
            if table.framehop_indexed {
                index
            } else {
                format!("{index} (no CFI found!)")
            },
            duration(estimates.ns(&group, "framehop_hdr")),
        ));
    }
    if let Some(driver) = tables.iter().find(|t| t.label == "librustc_driver") {
        let ns = estimates.ns(&format!("compile_{}", driver.label), "stackscope");
        report.line(format!(
            "  target: librustc_driver compiled in at most {RUSTC_DRIVER_TARGET_MS:.0} ms on one core: {} ({})",
            duration(ns),
            verdict(ns.map(|ns| ns / 1e6 <= RUSTC_DRIVER_TARGET_MS)),
        ));
    }
    for note in notes {
        report.line(format!("  note: {note}"));
    }
    let compiled: Vec<String> = tables
        .iter()
        .map(|table| {
            let ns = estimates.ns(&format!("compile_{}", table.label), "stackscope");
            let mut text = format!("{} {}", table.label, duration(ns));
            if table.label == "librustc_driver" {
                let met = verdict(ns.map(|ns| ns / 1e6 <= RUSTC_DRIVER_TARGET_MS));
                text.push_str(&format!(
                    " (target <= {RUSTC_DRIVER_TARGET_MS:.0} ms: {met})"
                ));
            }
            text
        })
        .collect();
    report.headline(format!("table compile, one core: {}", compiled.join(", ")));
    for note in notes {
        report.headline(format!("note: {note}"));
    }
}

fn report_walks(report: &mut Report, estimates: &Estimates, recording: &Recording, check: &Check) {
    let samples = recording.samples.len();
    let mean_depth = check.frames as f64 / samples.max(1) as f64;
    report.line("");
    report.line(format!(
        "2. Unwinding {samples} samples of tests/fixtures/busy.c (gcc -O2 -fomit-frame-pointer), \
         {} KiB stack copies, same bytes and files for both unwinders",
        STACK_BYTES / 1024
    ));
    report.line(format!(
        "  depth {}..{} frames (mean {mean_depth:.1}); {} distinct rips; frame 0 in {}; our walks ended {}",
        check.min_depth,
        check.max_depth,
        check.distinct_rips,
        counts(&check.frame0_files),
        counts(&check.ends),
    ));
    if recording.maps_changed > 0 {
        report.line(format!(
            "  note: the mappings changed under {} samples; all were replayed with the first sample's",
            recording.maps_changed
        ));
    }
    report.line(format!(
        "  frames identical in {}/{samples} samples; mismatches: {}",
        samples - check.mismatches,
        check.mismatches
    ));
    if check.mismatches > 0 {
        report.line(format!(
            "  mismatched samples by how our walk ended: {}",
            counts(&check.mismatch_ends)
        ));
    }
    if let Some(first) = &check.first_mismatch {
        report.line(first.clone());
    }
    let per_stack = |id| {
        estimates
            .ns("walk", id)
            .map(|ns| ns / samples.max(1) as f64)
    };
    let (ours, theirs) = (per_stack("stackscope_rule_cache"), per_stack("framehop"));
    let (ours_cold, cold) = (per_stack("stackscope"), per_stack("framehop_cold_cache"));
    let per_frame = |ns: Option<f64>| match ns {
        Some(ns) => format!("{:.1} ns/frame", ns / mean_depth.max(1.0)),
        None => String::new(),
    };
    report.line(format!(
        "  stackscope:    {:>12} per stack  {}  (warm rule cache, shared by all stacks)",
        duration(ours),
        per_frame(ours)
    ));
    report.line(format!(
        "  stackscope:    {:>12} per stack  {}  (no rule cache: module and row search every frame)",
        duration(ours_cold),
        per_frame(ours_cold)
    ));
    report.line(format!(
        "  framehop 0.16: {:>12} per stack  {}  (warm rule cache, shared by all stacks)",
        duration(theirs),
        per_frame(theirs)
    ));
    report.line(format!(
        "  framehop 0.16: {:>12} per stack  {}  (a fresh cache per stack)",
        duration(cold),
        per_frame(cold)
    ));
    let ratio_of = |ours: Option<f64>, theirs: Option<f64>| {
        ours.zip(theirs).map(|(ours, theirs)| theirs / ours)
    };
    let ratio = |theirs: Option<f64>| ratio_of(ours, theirs);
    let show = |ratio: Option<f64>| {
        ratio.map_or_else(|| "not measured".to_owned(), |r| format!("{r:.2}x"))
    };
    report.line(format!(
        "  ratio framehop/stackscope: {} warm against warm, {} cold against cold",
        show(ratio(theirs)),
        show(ratio_of(ours_cold, cold)),
    ));
    let target = verdict(ratio(theirs).map(|r| r >= SPEEDUP_TARGET && check.mismatches == 0));
    report.line(format!(
        "  target: at least {SPEEDUP_TARGET:.0}x faster than framehop (warm) with identical frames: {target}"
    ));
    report.headline(format!(
        "unwind {samples} recorded stacks (mean {mean_depth:.0} frames): stackscope {} vs framehop 0.16 {} \
         warm / {} cold per stack; ratio {} warm (target >= {SPEEDUP_TARGET:.0}x with identical frames: {target}); \
         mismatched frames in {} of {samples}",
        duration(ours),
        duration(theirs),
        duration(cold),
        show(ratio(theirs)),
        check.mismatches,
    ));
}

fn report_memory(report: &mut Report, tables: &[TableFacts]) {
    report.line("");
    report.line("3. Memory per cached table (heap_bytes: 8-byte rows + the deduplicated rules)");
    report.line(format!(
        "  {:<38} {:>9} {:>12} {:>10}",
        "file", "rows", "heap bytes", "bytes/row"
    ));
    for table in tables {
        report.line(format!(
            "  {:<38} {:>9} {:>12} {:>10.2}",
            table.file,
            table.rows,
            table.heap_bytes,
            table.heap_bytes as f64 / table.rows.max(1) as f64,
        ));
    }
    let memory: Vec<String> = tables
        .iter()
        .map(|table| {
            format!(
                "{} {} B for {} rows ({:.2} B/row)",
                table.label,
                table.heap_bytes,
                table.rows,
                table.heap_bytes as f64 / table.rows.max(1) as f64
            )
        })
        .collect();
    report.headline(format!("table heap bytes: {}", memory.join(", ")));
}

fn counts(counts: &BTreeMap<String, usize>) -> String {
    counts
        .iter()
        .map(|(name, count)| format!("{name} {count}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    }
}
