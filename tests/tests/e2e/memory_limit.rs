//! The agent's memory limit (root, a real memory cgroup): without
//! `--memory-limit` the agent takes 3/4 of its cgroup's limit (cgroup2's
//! `memory.max` where the memory controller is there, else cgroup v1's
//! `memory.limit_in_bytes`), as a DaemonSet's container limit sets it; a
//! limit below what the agent needs at the least is refused, saying what
//! it needs; under a build machine's load the agent keeps within its
//! limit. (Under hostile processes too: the hostile test's part.)

use std::{
    path::Path,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use stackscope_test_fixtures::{fixture_source, workspace_binary};
use stackscope_tests::{Collector, TempCgroup, exclusive, require_root, wait_success};

/// A memory cgroup made for the test (cgroup2 with the memory controller,
/// else cgroup v1's memory hierarchy) with a limit of `bytes`.
fn memory_cgroup(bytes: u64) -> TempCgroup {
    let v2 = stackscope_metadata::cgroups::cgroup2_mount()
        .ok()
        .filter(|mount| {
            std::fs::read_to_string(mount.join("cgroup.subtree_control"))
                .is_ok_and(|controllers| controllers.split_whitespace().any(|c| c == "memory"))
        });
    let (cgroup, limit_file) = match v2 {
        Some(mount) => (TempCgroup::create_in(&mount, "memory"), "memory.max"),
        None => (
            TempCgroup::create_in(Path::new("/sys/fs/cgroup/memory"), "memory"),
            "memory.limit_in_bytes",
        ),
    };
    std::fs::write(cgroup.path.join(limit_file), bytes.to_string())
        .expect("setting the cgroup's memory limit");
    cgroup
}

#[test]
fn without_a_limit_of_its_own_the_agent_takes_three_quarters_of_its_cgroups() {
    require_root();
    let _serial = exclusive();
    let cgroup = memory_cgroup(256 << 20);
    // The shell moves itself into the cgroup, then becomes the agent: the
    // agent reads its cgroup as it starts.
    let agent = Command::new("sh")
        .arg("-c")
        .arg(r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#)
        .arg("sh")
        .arg(&cgroup.path)
        .arg(workspace_binary("stackscope-agent"))
        .args([
            "--pid",
            &std::process::id().to_string(),
            "--duration",
            "1s",
            "--json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let report = wait_success(agent);
    let memory = &report["memory"];
    assert_eq!(memory["limit_bytes"].as_u64(), Some(192 << 20), "{memory}");
    let name = cgroup
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        memory["source"]
            .as_str()
            .is_some_and(|source| source.contains(&name)),
        "{memory}"
    );
    // What gives way first is cut first: what only costs re-reads is at
    // its floor, the two queues share what is left beside the unused
    // unwind tables, which give way last and are whole.
    let shares: Vec<(String, u64)> = memory["shares"]
        .as_array()
        .expect("shares")
        .iter()
        .map(|share| {
            (
                share["consumer"].as_str().unwrap_or_default().to_owned(),
                share["bytes"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    let names: Vec<&str> = shares.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "symbolizer_files",
            "perf_maps",
            "python_code_objects",
            "jvm_code",
            "go_tables",
            "export_queue",
            "samples_waiting",
            "unwind_tables_unused"
        ],
        "{memory}"
    );
    let bytes: Vec<u64> = shares.iter().map(|(_, bytes)| *bytes).collect();
    assert_eq!(
        bytes[..5],
        [8 << 20, 4 << 20, 4 << 20, 4 << 20, 4 << 20],
        "{memory}"
    );
    assert_eq!(bytes[5], bytes[6], "the queues share: {memory}");
    assert!(bytes[5] > 4 << 20 && bytes[5] < 64 << 20, "{memory}");
    assert_eq!(bytes[7], 64 << 20, "{memory}");
}

#[test]
fn a_limit_below_what_the_agent_needs_is_refused_saying_what_it_needs() {
    let out = Command::new(workspace_binary("stackscope-agent"))
        .args(["--memory-limit", "40MiB", "--duration", "1s"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running the agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr
            .contains("memory limit 40.0 MiB (from --memory-limit) is below what the agent needs"),
        "{stderr}"
    );
    let out = Command::new(workspace_binary("stackscope-agent"))
        .args(["--memory-limit", "96 parsecs"])
        .output()
        .expect("running the agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("unknown unit"),
        "{stderr}"
    );
}

/// The limit of the build-machine test besides the ring buffer's pages
/// (24 MiB on a 2-CPU host): issue 39's 96 MiB, low enough to bite (every
/// cache but the unused tables at its floor). With the ring inside it,
/// the agent's own peak (81-88 MiB in two runs) came too close to it for a
/// loaded host: what a large table's compile holds while it runs (up to
/// 38 MB for libLLVM's) is outside the budget.
const BUILD_LOAD_LIMIT_MIB: u64 = 96;

/// The most a process's memory reached, sampled every 20 ms: what it owns
/// (anonymous and shared memory) and the pages of files it maps.
#[derive(Debug, Default, Clone, Copy)]
struct PeakMemory {
    owned_kib: u64,
    file_kib: u64,
}

/// Samples `/proc/<pid>/status` until told to stop.
struct MemoryWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<PeakMemory>,
}

impl MemoryWatch {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut peak = PeakMemory::default();
            while !stopping.load(Ordering::Relaxed) {
                let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                    break;
                };
                let field = |name| stackscope_telemetry::status_kib(&status, name).unwrap_or(0);
                peak.owned_kib = peak.owned_kib.max(field("RssAnon:") + field("RssShmem:"));
                peak.file_kib = peak.file_kib.max(field("RssFile:"));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        Self { stop, thread }
    }

    fn stop(self) -> PeakMemory {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the memory watch")
    }
}

/// A build machine's load for `$4` seconds, in cgroup `$1`: two loops of
/// `gcc -O2` over C fixtures (`$2`) and two of `rustc -O` (the largest
/// unwind and symbol tables a node meets: librustc_driver's and libLLVM's),
/// their outputs in `$3`. A compile that fails ends the load with an error.
const BUILD_LOAD: &str = r#"
echo $$ > "$1/cgroup.procs" || exit 1
fixtures=$2 out=$3 end=$(( $(date +%s) + $4 ))
c_loop() {
    while [ "$(date +%s)" -lt "$end" ]; do
        for f in call_chain deep many_functions threads; do
            gcc -O2 -c -o "$out/$f.$1.o" "$fixtures/$f.c" || exit 1
        done
    done
}
rust_loop() {
    # A directory per loop: rustc's intermediate files are named after
    # the crate.
    mkdir -p "$out/$1" || exit 1
    while [ "$(date +%s)" -lt "$end" ]; do
        for f in rust_chain deep_rust; do
            rustc -O -o "$out/$1/$f" "$fixtures/$f.rs" || exit 1
        done
    done
}
c_loop 1 & c_loop 2 & rust_loop 1 & rust_loop 2 &
failed=0
for job in 1 2 3 4; do wait %$job || failed=1; done
exit $failed
"#;

#[test]
fn a_build_machines_compiles_keep_the_agent_within_its_limit() {
    require_root();
    let _serial = exclusive();
    let cgroup = TempCgroup::create("build-load");
    let data = tempfile::tempdir().expect("temp dir");
    let outputs = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let ring = stackscope_sampler::ring_buffer_rss(agent_common::MAX_DEEP_STACK_BYTES)
        .expect("the CPUs listed");
    let limit = (BUILD_LOAD_LIMIT_MIB << 20) + ring;
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(["--frequency", "99", "--interval", "2s", "--json"])
        .args(["--symbolize", "both", "--no-table-cache"])
        .args(["--cgroup", &cgroup.relative_path()])
        .args(["--memory-limit", &limit.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let watch = MemoryWatch::start(agent.id());
    let fixtures = fixture_source("");
    let load = Command::new("sh")
        .arg("-c")
        .arg(BUILD_LOAD)
        .arg("sh")
        .arg(&cgroup.path)
        .arg(&fixtures)
        .arg(outputs.path())
        .arg("20")
        .status()
        .expect("running the build load");
    // Before the stop: the last batch's naming is part of the run.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let peak_rss = stackscope_test_fixtures::peak_rss_kib(agent.id()).unwrap_or(0) << 10;
    let peak = watch.stop();
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let report = wait_success(agent);
    assert!(load.success(), "a compile of the load failed");
    let cc1 = collector.folded_stacks("comm=\"cc1\"");
    let rustc = collector.folded_stacks("comm=\"rustc\"");
    collector.stop();
    // What the limit bounds is the memory the agent owns (anonymous, and
    // the ring buffer's pages): the pages of the files it maps (its own
    // code, the compilers' libraries it reads tables and symbols from) are
    // the page cache, shared with the programs that run them, charged to
    // whichever cgroup read them first and taken back under pressure. They
    // are shown, not judged: with large folios a whole-file mapping brings
    // in up to 2 MiB per page touched (30-110 MiB here).
    let owned = (peak.owned_kib << 10) + ring;
    eprintln!(
        "build load: the agent's peak memory {} MiB of its own ({} MiB anonymous, the ring \
         {} MiB), limit {} MiB; file pages mapped at most {} MiB, peak RSS {} MiB; \
         batches {}; evicted: symbolizer files {}, unused tables {}",
        owned >> 20,
        peak.owned_kib >> 10,
        ring >> 20,
        limit >> 20,
        peak.file_kib >> 10,
        peak_rss >> 20,
        report["batches"],
        report["symbolization"]["counts"]["objects_evicted"],
        report["unwinding"]["tables_evicted"],
    );
    assert!(
        peak.owned_kib > 0 && owned <= limit,
        "the agent's peak memory of its own was {} MiB, limit {} MiB",
        owned >> 20,
        limit >> 20
    );
    // Both compilers' profiles came through, their own functions named.
    let named = |stacks: &[(String, u64)], function: &str| -> u64 {
        stacks
            .iter()
            .filter(|(stack, _)| stack.split(';').any(|frame| frame.contains(function)))
            .map(|(_, n)| n)
            .sum()
    };
    let (cc1_named, rustc_named) = (named(&cc1, "toplev::main"), named(&rustc, "rustc_driver"));
    let heaviest = |stacks: &[(String, u64)]| stacks.iter().max_by_key(|(_, n)| *n).cloned();
    assert!(
        cc1_named >= 50,
        "{cc1_named} cc1 samples name toplev::main; the heaviest stack: {:?}",
        heaviest(&cc1)
    );
    assert!(
        rustc_named >= 50,
        "{rustc_named} rustc samples name rustc_driver; the heaviest stack: {:?}",
        heaviest(&rustc)
    );
    // The symbolizer's share is at its floor here: the compilers' large
    // files take turns in it, and each turn is counted.
    let evicted = report["symbolization"]["counts"]["objects_evicted"]
        .as_u64()
        .unwrap_or(0);
    assert!(evicted > 0, "no file evicted: {}", report["symbolization"]);
}
