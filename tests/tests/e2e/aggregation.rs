//! End to end: samples of fixtures built without frame pointers, walked,
//! aggregated and turned into `stackscope.v1.Batch`es by the agent's library
//! (the whole run loop for C, the pipeline pieces for C++ and Rust), then
//! read back from the batches as the collector would: the chain of names
//! root first, the labels, the build-ids and the kernel names. Needs root.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use agent_common::sample_flags;
use stackscope_agent::{
    aggregate::{Aggregator, AggregatorConfig, BatchOptions, LabelRecords, build_batch},
    run::{AgentConfig, RunSummary, run},
};
use stackscope_process_table::ProcessTable;
use stackscope_process_table::{ObjectId, object_id::identify};
use stackscope_proto::v1;
use stackscope_sampler::{SamplerConfig, record::OwnedSample};
use stackscope_symbolize::node::{Symbolizer, SymbolizerConfig};
use stackscope_tests::{
    Fixture, exclusive, kernel_symbol, kernel_symbols, require_root, sample_for,
};
use stackscope_unwind::walker::{ProcessState, StackWalker, WalkerConfig};

const NODE: &str = "aggregation-test-node";

/// Share of a fixture's samples that must show its exact chain: the rest
/// may have been taken while the process was elsewhere (in the kernel on
/// the way to its loop, or in the one instruction a walk cannot leave).
const MIN_EXACT_SHARE: f64 = 0.8;

/// One frame of a sample as read back from a batch.
#[derive(Debug, Clone)]
struct Frame {
    kind: i32,
    build_id: String,
    path: String,
    address: u64,
    /// Innermost (inlined) first, as in the batch.
    functions: Vec<String>,
}

impl Frame {
    fn is_kernel(&self) -> bool {
        self.kind == v1::MappingKind::Kernel as i32
    }

    /// The names as a flame graph shows them, root first: the function
    /// holding the code, then the functions inlined into it; a frame
    /// without names as the collector shows it.
    fn names_root_first(&self) -> Vec<String> {
        if self.functions.is_empty() {
            let binary = Path::new(&self.path)
                .file_name()
                .map_or_else(|| self.path.clone(), |n| n.to_string_lossy().into_owned());
            return vec![format!("[unknown] {binary}+{:#x}", self.address)];
        }
        self.functions.iter().rev().cloned().collect()
    }
}

/// One sample of a batch, resolved.
#[derive(Debug, Clone)]
struct Sample {
    labels: BTreeMap<String, String>,
    /// Leaf first.
    frames: Vec<Frame>,
    count: u64,
}

impl Sample {
    /// The user part's names, root first.
    fn user_chain(&self) -> Vec<String> {
        self.frames
            .iter()
            .rev()
            .filter(|f| !f.is_kernel())
            .flat_map(Frame::names_root_first)
            .collect()
    }
}

/// Checks the batch's rules (what the collector checks) and resolves every
/// sample.
fn read_batch(batch: &v1::Batch) -> Vec<Sample> {
    assert_eq!(batch.batch_id.len(), 16);
    assert_eq!(batch.strings.first().map(String::as_str), Some(""));
    assert!(batch.end_unix_nanos > batch.start_unix_nanos);
    assert_eq!(batch.sample_period_nanos, 1_000_000_000 / 99);
    let node = batch.node.as_ref().expect("node");
    let string = |index: u32| -> &str {
        batch
            .strings
            .get(index as usize)
            .unwrap_or_else(|| panic!("string index {index} out of range"))
    };
    assert_eq!(string(node.name), NODE);
    let unique = |what: &str, len: usize, distinct: usize| assert_eq!(len, distinct, "{what}");
    unique(
        "strings",
        batch.strings.len(),
        batch.strings.iter().collect::<HashSet<_>>().len(),
    );
    unique(
        "stacks",
        batch.stacks.len(),
        batch
            .stacks
            .iter()
            .map(|s| &s.locations)
            .collect::<HashSet<_>>()
            .len(),
    );
    batch
        .samples
        .iter()
        .map(|sample| {
            assert!(sample.count > 0);
            let stack = batch
                .stacks
                .get(sample.stack as usize)
                .expect("stack index");
            assert!(!stack.locations.is_empty());
            let frames = stack
                .locations
                .iter()
                .map(|&index| {
                    let location = batch.locations.get(index as usize).expect("location index");
                    let mapping = batch
                        .mappings
                        .get(location.mapping as usize)
                        .expect("mapping");
                    Frame {
                        kind: mapping.kind,
                        build_id: string(mapping.build_id).to_owned(),
                        path: string(mapping.path).to_owned(),
                        address: location.address,
                        functions: location
                            .lines
                            .iter()
                            .map(|line| string(line.function).to_owned())
                            .collect(),
                    }
                })
                .collect();
            let set = batch
                .label_sets
                .get(sample.label_set as usize)
                .expect("label set");
            let labels = set
                .labels
                .iter()
                .map(|l| (string(l.name).to_owned(), string(l.value).to_owned()))
                .collect();
            Sample {
                labels,
                frames,
                count: sample.count,
            }
        })
        .collect()
}

/// The GNU build-id of the file at `path`, as lower-case hex.
fn build_id(path: &Path) -> String {
    let file = std::fs::File::open(path).expect("opening the fixture");
    let metadata = file.metadata().expect("fstat");
    match identify(&file, &metadata)
        .expect("identifying the fixture")
        .id
    {
        ObjectId::BuildId(id, _) => id.to_string(),
        other => panic!("{} has no build-id: {other}", path.display()),
    }
}

/// Runs the agent's whole loop on `pid` for `duration` with 1 s intervals
/// and returns the batches its sink got.
fn run_agent(pid: u32, duration: Duration) -> (Vec<v1::Batch>, RunSummary) {
    let mut config = AgentConfig::new(SamplerConfig {
        frequency_hz: 99,
        pids: vec![pid],
        ..SamplerConfig::default()
    });
    config.duration = Some(duration);
    config.status_interval = Duration::from_secs(60);
    config.interval = Duration::from_secs(1);
    config.aggregation.node_name = NODE.into();
    let batches = Arc::new(Mutex::new(Vec::new()));
    let sink = {
        let batches = Arc::clone(&batches);
        move |batch| batches.lock().expect("batches").push(batch)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let summary = runtime
        .block_on(run(&config, Some(Box::new(sink))))
        .expect("running the agent");
    let batches = std::mem::take(&mut *batches.lock().expect("batches"));
    (batches, summary)
}

/// Walks and aggregates recorded samples with the library's pieces, and
/// builds one batch.
fn aggregate(samples: &[OwnedSample]) -> v1::Batch {
    let mut walker = StackWalker::default();
    let mut table: ProcessTable<ProcessState> =
        StackWalker::process_table(&WalkerConfig::default());
    let mut aggregator = Aggregator::new(AggregatorConfig {
        node_name: NODE.into(),
        ..AggregatorConfig::default()
    });
    // The labels records, kept apart from the walker's table here.
    let mut records = HashMap::new();
    for sample in samples {
        if sample.header.flags & sample_flags::USER_REGS == 0 {
            let labels = records.labels_of(sample.header.tgid);
            aggregator.add(&sample.header, &sample.kernel_frames, None, labels);
            continue;
        }
        walker.push(
            &mut table,
            &sample.header,
            &sample.kernel_frames,
            sample.stack(),
            |w| {
                let labels = records.labels_of(w.header.tgid);
                aggregator.add(w.header, w.kernel_frames, Some(&w.walk), labels)
            },
        );
    }
    let started = Instant::now();
    while walker.waiting() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "tables never compiled"
        );
        std::thread::sleep(Duration::from_millis(20));
        walker.poll(&mut table, |w| {
            let labels = records.labels_of(w.header.tgid);
            aggregator.add(w.header, w.kernel_frames, Some(&w.walk), labels)
        });
    }
    walker.flush(&mut table, |w| {
        let labels = records.labels_of(w.header.tgid);
        aggregator.add(w.header, w.kernel_frames, Some(&w.walk), labels)
    });
    // What the agent's metadata worker does: the processes met are
    // described (their label sets filled in) and their files opened.
    let config = AggregatorConfig::default();
    let (mut describer, mut perf_maps) = (config.describer(), config.perf_map_reader());
    aggregator.serve_metadata(&mut describer, &mut perf_maps, &mut records);
    assert_eq!(aggregator.stats().samples, samples.len() as u64);
    let interval = aggregator.finish_interval(SystemTime::now());
    // The name cache is tested by the aggregator's unit tests; this builds
    // the batch once, as the agent does.
    let mut symbolizer = Symbolizer::new(SymbolizerConfig::default());
    build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(99))
}

/// The share of `samples`' count whose user chain (root first) satisfies
/// `exact`.
fn exact_share(samples: &[Sample], exact: impl Fn(&[String]) -> bool) -> f64 {
    let total: u64 = samples.iter().map(|s| s.count).sum();
    let matching: u64 = samples
        .iter()
        .filter(|s| exact(&s.user_chain()))
        .map(|s| s.count)
        .sum();
    matching as f64 / total.max(1) as f64
}

/// Asserts that at least [`MIN_EXACT_SHARE`] of the samples show `what`.
fn assert_share(what: &str, share: f64, samples: &[Sample]) {
    eprintln!("{:.1}% of samples with {what}", 100.0 * share);
    assert!(
        share >= MIN_EXACT_SHARE,
        "{:.1}% of samples with {what}:\n{}",
        100.0 * share,
        folded(samples)
    );
}

/// Prints the folded stacks, most samples first, for a failing assertion.
fn folded(samples: &[Sample]) -> String {
    let mut lines: Vec<(u64, String)> = samples
        .iter()
        .map(|s| {
            let names: Vec<String> = s
                .frames
                .iter()
                .rev()
                .flat_map(Frame::names_root_first)
                .collect();
            (s.count, names.join(";"))
        })
        .collect();
    lines.sort_unstable_by(|a, b| b.cmp(a));
    lines
        .iter()
        .take(20)
        .map(|(count, stack)| format!("{count:>5} {stack}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether kallsyms shows addresses (root, and `kptr_restrict` below 2).
fn kallsyms_readable() -> bool {
    std::fs::read_to_string("/proc/kallsyms")
        .map(|text| {
            text.lines()
                .take(100)
                .any(|line| !line.starts_with("0000000000000000"))
        })
        .unwrap_or(false)
}

/// Every kernel frame is named after the kallsyms symbol at or below the
/// address it is looked up at (one byte before a return address).
fn assert_kernel_frames_named(samples: &[Sample]) {
    let symbols = kernel_symbols();
    let mut by_address: HashMap<u64, HashSet<&str>> = HashMap::new();
    for (address, name) in &symbols {
        by_address.entry(*address).or_default().insert(name);
    }
    for sample in samples {
        for (i, frame) in sample
            .frames
            .iter()
            .enumerate()
            .filter(|(_, f)| f.is_kernel())
        {
            let lookup = if i == 0 {
                frame.address
            } else {
                frame.address - 1
            };
            let expected = kernel_symbol(&symbols, lookup).expect("a kernel symbol");
            let start = symbols
                .iter()
                .rev()
                .find(|(address, _)| *address <= lookup)
                .map(|(address, _)| *address)
                .expect("a symbol address");
            assert_eq!(frame.functions.len(), 1, "kernel frame {frame:?}");
            assert!(
                by_address[&start].contains(frame.functions[0].as_str()),
                "{:#x} named {:?}, kallsyms says {expected}",
                frame.address,
                frame.functions
            );
            assert!(
                frame.path == "[kernel.kallsyms]"
                    || (frame.path.starts_with('[') && frame.path.ends_with(']')),
                "{frame:?}"
            );
        }
    }
}

#[test]
fn the_run_loop_ships_named_chains_with_labels_and_build_ids() {
    require_root();
    let fixture = Fixture::compile("call_chain", &[]);
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let (batches, summary) = run_agent(process.pid(), Duration::from_secs(3));

    // 1 s intervals on second boundaries, plus the last partial one.
    assert!(batches.len() >= 3, "{} batches", batches.len());
    assert_eq!(summary.batches.batches_built, batches.len() as u64);
    for pair in batches.windows(2) {
        assert_eq!(
            pair[0].end_unix_nanos, pair[1].start_unix_nanos,
            "intervals are contiguous"
        );
    }
    assert!(
        batches[1..batches.len() - 1]
            .iter()
            .all(|b| b.start_unix_nanos % 1_000_000_000 == 0),
        "intervals end on second boundaries"
    );

    let samples: Vec<Sample> = batches.iter().flat_map(read_batch).collect();
    let total: u64 = samples.iter().map(|s| s.count).sum();
    assert!(total >= 150, "only {total} samples");
    // Every sample read made it into a batch.
    assert_eq!(total, summary.aggregation.samples);
    assert_eq!(summary.aggregation.samples, summary.tally.total());

    let exe = std::fs::canonicalize(&fixture.path).expect("fixture path");
    for sample in &samples {
        let labels: Vec<(&str, &str)> = sample
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            labels,
            [
                ("comm", "call_chain"),
                ("exe", exe.to_str().expect("UTF-8 path")),
                ("node", NODE),
                // A host process's service is its executable's name.
                ("service_name", "call_chain"),
            ]
        );
    }

    let share = exact_share(&samples, |chain| {
        chain.first().is_some_and(|root| root == "_start")
            && chain.ends_with(&["main", "a", "b", "c"].map(String::from))
    });
    assert_share("_start ... main;a;b;c", share, &samples);

    // The fixture's frames: user mapping at its path with its build-id,
    // addresses are file offsets.
    let fixture_build_id = build_id(&fixture.path);
    let size = std::fs::metadata(&fixture.path).expect("stat").len();
    let fixture_frames: Vec<&Frame> = samples
        .iter()
        .flat_map(|s| &s.frames)
        .filter(|f| f.path == exe.to_str().expect("UTF-8 path"))
        .collect();
    assert!(!fixture_frames.is_empty());
    for frame in fixture_frames {
        assert_eq!(frame.kind, v1::MappingKind::User as i32);
        assert_eq!(frame.build_id, fixture_build_id);
        assert!(frame.address < size, "{frame:?} is not a file offset");
    }
    if kallsyms_readable() {
        assert_kernel_frames_named(&samples);
    }
    let naming = summary.batches.symbolize;
    eprintln!(
        "naming: {:.1}% cache hits, {:?}; build {} us last, {} us max",
        naming.cache_hit_percent(),
        naming,
        summary.batches.build_micros_last,
        summary.batches.build_micros_max
    );
}

#[test]
fn kernel_frames_come_first_and_are_named_from_kallsyms() {
    require_root();
    let fixture = Fixture::compile("syscall_loop", &[]);
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let (batches, _) = run_agent(process.pid(), Duration::from_secs(2));
    let samples: Vec<Sample> = batches.iter().flat_map(read_batch).collect();
    let total: u64 = samples.iter().map(|s| s.count).sum();
    let in_kernel: u64 = samples
        .iter()
        .filter(|s| s.frames.first().is_some_and(Frame::is_kernel))
        .map(|s| s.count)
        .sum();
    assert!(
        in_kernel * 2 > total,
        "{in_kernel} of {total} samples in the kernel"
    );
    for sample in &samples {
        // Leaf first overall: the kernel part, then the user part.
        let first_user = sample
            .frames
            .iter()
            .position(|f| !f.is_kernel())
            .unwrap_or(sample.frames.len());
        assert!(
            sample.frames[first_user..].iter().all(|f| !f.is_kernel()),
            "kernel frames below user frames: {sample:?}"
        );
    }
    let share = exact_share(&samples, |chain| {
        chain.first().is_some_and(|root| root == "_start")
            && chain.iter().any(|name| name == "main")
    });
    assert_share("_start ... main", share, &samples);
    if kallsyms_readable() {
        assert_kernel_frames_named(&samples);
        let unknown = samples
            .iter()
            .flat_map(|s| &s.frames)
            .filter(|f| f.is_kernel() && f.functions.is_empty())
            .count();
        assert_eq!(unknown, 0, "unnamed kernel frames");
    }
}

/// Samples `fixture` alone for 2 s and aggregates the samples into a batch.
fn sample_and_aggregate(fixture: &Fixture) -> (Vec<Sample>, PathBuf) {
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: vec![process.pid()],
        ..SamplerConfig::default()
    };
    let recorded = sample_for(&config, Duration::from_secs(2));
    assert!(
        recorded.samples.len() >= 100,
        "{} samples",
        recorded.samples.len()
    );
    // Walked and named while the process runs (its files are opened then).
    let batch = aggregate(&recorded.samples);
    let exe = std::fs::canonicalize(&fixture.path).expect("fixture path");
    (read_batch(&batch), exe)
}

#[test]
fn cpp_frames_are_demangled() {
    require_root();
    let fixture = Fixture::cpp_template_chain();
    let (samples, exe) = sample_and_aggregate(&fixture);
    let share = exact_share(&samples, |chain| {
        chain.ends_with(&["main", "dispatch<Worker<int> >", "Worker<int>::run"].map(String::from))
    });
    assert_share(
        "main;dispatch<Worker<int> >;Worker<int>::run",
        share,
        &samples,
    );
    let exe = exe.to_str().expect("UTF-8 path");
    for frame in samples.iter().flat_map(|s| &s.frames) {
        if frame.path == exe {
            assert!(
                frame.functions.iter().all(|name| !name.starts_with("_Z")),
                "mangled name in {frame:?}"
            );
        }
    }
}

#[test]
fn rust_frames_are_demangled_without_hashes() {
    require_root();
    let fixture = Fixture::rust_chain();
    let (samples, _) = sample_and_aggregate(&fixture);
    let chain = [
        "rust_chain::main",
        "rust_chain::a",
        "rust_chain::b",
        "rust_chain::c",
    ]
    .map(String::from);
    let share = exact_share(&samples, |names| {
        names.ends_with(&chain) && names.iter().any(|n| n == "std::rt::lang_start_internal")
    });
    assert_share(
        "lang_start_internal ... rust_chain::main;a;b;c",
        share,
        &samples,
    );
}
