//! Hostile processes (root, real BPF, real podman): what any container on a
//! node can hand the agent, on purpose or by accident, all at once.
//!
//! - a "JIT" with a 2 GiB perf map, and four with 32 MiB ones;
//! - a program that replaces itself with a new image every millisecond;
//! - a program whose stacks are mapped and unmapped while it runs on them;
//! - a binary whose `.eh_frame` is a chain of entries pointing at each
//!   other instead of at a CIE, with an `.eh_frame_hdr` claiming 2^31 FDEs,
//!   and whose build-id is the well-formed program's beside it;
//! - a container whose program's directory became a symlink loop.
//!
//! The agent must stay within its memory limit (set low), keep working (a well-formed
//! program beside them unwinds and is named as usual), name what it can and
//! count what it refuses.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use stackscope_test_fixtures::{
    Fixture,
    containers::{Container, Image},
    workspace_binary,
};
use stackscope_tests::{Collector, exclusive, free_port, http_get, require_root, wait_success};

/// Size of the hostile perf map.
const PERF_MAP_MIB: &str = "2048";

/// JITs beside the hostile one, each with a perf map of this many MiB:
/// more names than one process may keep (a quarter of the perf maps'
/// share), together more than the budget gives them all.
const MORE_JITS: usize = 4;
const MORE_PERF_MAP_MIB: &str = "32";

/// The agent's memory limit here, besides its ring buffer's pages (which
/// grow with the CPUs: 24 MiB here): low, so that its budget bites (the
/// JITs' names alone would take 64 MiB at the perf maps' full size). Its
/// peak RSS must stay within it.
const MEMORY_LIMIT_MIB: u64 = 120;

#[test]
fn hostile_processes_leave_the_agent_bounded_and_still_naming() {
    require_root();
    let _serial = exclusive();
    let bpf_before = stackscope_tests::bpf_ids_loaded("prog");

    let jit = Fixture::compile("hostile_jit", &[]);
    let jit_run = jit.start(&[PERF_MAP_MIB]);
    let _perf_map = RemoveOnDrop(PathBuf::from(format!("/tmp/perf-{}.map", jit_run.pid())));
    let more_jits: Vec<_> = (0..MORE_JITS)
        .map(|_| {
            let run = jit.start(&[MORE_PERF_MAP_MIB]);
            let map = RemoveOnDrop(PathBuf::from(format!("/tmp/perf-{}.map", run.pid())));
            (run, map)
        })
        .collect();
    let exec_loop = Fixture::compile("exec_loop", &[]);
    let exec_run = exec_loop.start(&[]);
    let remap = Fixture::compile("stack_remap", &[]);
    let remap_run = remap.start(&[]);
    // A copy of the control's program: the crafted binary claims the
    // control's build-id, so a table or a name filed under the build-id
    // alone would go from one to the other.
    let control = Fixture::compile("call_chain", &[]);
    let crafted_path = control.dir().join("crafted_chain");
    std::fs::copy(&control.path, &crafted_path).expect("copying call_chain");
    rewrite_eh_frame(&crafted_path);
    let crafted_run = stackscope_test_fixtures::RunningProcess::start_ready(
        Command::new(&crafted_path).env_clear(),
    );
    let control_run = control.start(&[]);

    // The container's program runs from /app/dir, which then becomes a
    // relative symlink to itself: every path through it loops, from the
    // host too (an absolute one would resolve against the host's root).
    let looped = Fixture::compile("call_chain", &["-static"]);
    let image = Image::build("hostile", &[(looped.path.as_path(), "/app/dir/looped")]);
    let container = Container::run(
        &image,
        "looped",
        &[
            "/bin/sh",
            "-c",
            "/app/dir/looped & B=/bin/busybox; $B sleep 1; $B mv /app/dir /app/old; \
             $B ln -s dir /app/dir; wait",
        ],
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        std::fs::metadata(container.proc_dir().join("root/app/dir/looped"))
            .is_err_and(|err| err.raw_os_error() == Some(libc::ELOOP)),
        "the container's /app/dir is not a symlink loop"
    );

    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    // Only these processes: what else runs on the machine (other tests'
    // builds) must not decide whether a debug build keeps up.
    let looped_pid = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", container.pid))
        .ok()
        .and_then(|children| children.split_whitespace().next()?.parse::<u32>().ok())
        .expect("the container's shell runs the looped program");
    let pids: Vec<String> = [
        jit_run.pid(),
        exec_run.pid(),
        remap_run.pid(),
        crafted_run.pid(),
        control_run.pid(),
        looped_pid,
    ]
    .into_iter()
    .chain(more_jits.iter().map(|(run, _)| run.pid()))
    .map(|pid| pid.to_string())
    .collect();
    let metrics = format!("127.0.0.1:{}", free_port());
    let images_before = exec_images(exec_run.pid());
    let memory_limit = (MEMORY_LIMIT_MIB << 20)
        + stackscope_sampler::ring_buffer_rss(agent_common::MAX_DEEP_STACK_BYTES)
            .expect("the CPUs listed");
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(pids.iter().flat_map(|pid| ["--pid", pid.as_str()]))
        .args(["--frequency", "199", "--interval", "2s", "--json"])
        .args(["--no-table-cache", "--metrics-address", &metrics])
        .args(["--memory-limit", &memory_limit.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    std::thread::sleep(Duration::from_secs(15));
    let peak_rss = peak_resident_bytes(agent.id());
    // Answered at once, however busy the run loop is: the endpoints have a
    // thread of their own.
    let scraped = http_get(&metrics, "/metrics");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let report = wait_success(agent);
    let images = exec_images(exec_run.pid()) - images_before;
    let (status, text) = scraped.expect("the agent's metrics answered");
    assert_eq!(status, 200, "{text}");

    eprintln!(
        "hostile: the agent's peak RSS {} MiB, limit {} MiB",
        peak_rss >> 20,
        memory_limit >> 20
    );
    assert!(
        peak_rss <= memory_limit,
        "the agent's peak resident memory was {} MiB, over its limit",
        peak_rss >> 20
    );
    let memory = &report["memory"];
    assert_eq!(
        memory["limit_bytes"].as_u64(),
        Some(memory_limit),
        "{memory}"
    );

    // The perf map: read up to its bound, the rest counted, the real code
    // named.
    let perf_map_bytes = gauge(&text, "stackscope_agent_state_bytes{state=\"perf_maps\"}");
    let perf_map_bound = gauge(
        &text,
        "stackscope_agent_state_max_bytes{state=\"perf_maps\"}",
    );
    assert!(
        perf_map_bytes <= perf_map_bound && perf_map_bound > 0.0,
        "perf maps hold {perf_map_bytes} bytes, bound {perf_map_bound}"
    );
    // The perf maps' bound is their share of the budget, as served.
    assert_eq!(
        perf_map_bound,
        gauge(
            &text,
            "stackscope_agent_memory_share_bytes{state=\"perf_maps\"}"
        )
    );
    let jit_names = &report["jit_names"];
    assert!(
        jit_names["over_budget"].as_u64().unwrap_or(0) > 0,
        "the 2 GiB perf map never reached the bound: {jit_names}"
    );
    let spins = collector.folded_stacks("comm=\"hostile_jit\"");
    assert!(
        spins
            .iter()
            .any(|(stack, _)| stack.contains("hostile_spin")),
        "the JIT's code was not named from its perf map: {spins:?}"
    );

    // The crafted table is refused (walked by frame pointers instead) and
    // said so; nothing else of the walker suffered.
    let unwinding = &report["unwinding"];
    assert!(
        unwinding["tables_failed"].as_u64().unwrap_or(0) >= 1,
        "no table refused: {unwinding}"
    );
    assert!(
        unwinding["early_ends"].is_object(),
        "the report says why walks stopped early: {unwinding}"
    );
    let (crafted_walks, _) = binary_ends(unwinding, "crafted_chain");
    assert!(
        crafted_walks > 0,
        "crafted_chain was not walked: {unwinding}"
    );

    // Beside all this, a well-formed program unwinds as usual, and is
    // named (what the naming budget of a batch leaves unnamed on a machine
    // this busy is named in later batches, or by the collector), although
    // the crafted binary claims its build-id: whichever was compiled first,
    // neither got the other's table.
    let (control_walks, control_roots) = binary_ends(unwinding, "call_chain");
    assert!(
        control_walks > 100 && control_roots * 100 >= control_walks * 95,
        "the control program: {control_roots} of {control_walks} walks reached the root"
    );
    let control_stacks = collector.folded_stacks("comm=\"call_chain\"");
    assert!(
        control_stacks.iter().any(|(stack, _)| stack
            .contains("_start;__libc_start_main_impl;__libc_start_call_main;main;a;b;c")),
        "the control program was never named: {control_stacks:?}"
    );

    // The exec loop and the remapped stacks are sampled and named.
    // How fast the loop runs depends on the machine's load; what it did
    // while the agent ran (its start-up included) is the measure.
    let execs = report["mapping_feed"]["execs"].as_u64().unwrap_or(0);
    eprintln!("hostile: the agent saw {execs} execs; the exec loop did {images} while it ran");
    assert!(
        images >= 100 && execs * 2 >= images,
        "the agent saw {execs} execs while the exec loop did {images}"
    );
    let exec_stacks = collector.folded_stacks("comm=\"exec_loop\"");
    assert!(
        exec_stacks.iter().any(|(stack, _)| stack.contains("main")),
        "no exec_loop sample named main: {exec_stacks:?}"
    );
    let remap_stacks = collector.folded_stacks("comm=\"stack_remap\"");
    assert!(
        remap_stacks
            .iter()
            .any(|(stack, _)| stack.contains("descend")),
        "no stack_remap sample named descend: {remap_stacks:?}"
    );

    // The looped container's program is still sampled, under its container.
    let looped = Command::new(workspace_binary("stackscope"))
        .args([
            "--collector",
            &collector.grpc,
            "export",
            "--format",
            "folded",
        ])
        .args(["--since", "10m", "--match"])
        .arg(format!("comm=\"looped\",container_id=\"{}\"", container.id))
        .output()
        .expect("running stackscope");
    assert!(
        looped.status.success() && !looped.stdout.is_empty(),
        "no sample of the program behind the symlink loop under container {} ({}); the \
         container ids the collector has: {}; comm values: {}; the agent's labelling: {}",
        container.id,
        String::from_utf8_lossy(&looped.stderr),
        String::from_utf8_lossy(&collector.cli(&["labels", "container_id"])),
        String::from_utf8_lossy(&collector.cli(&["labels", "comm"])),
        report["aggregation"]
    );

    let bpf_after = stackscope_tests::bpf_ids_loaded("prog");
    assert!(
        bpf_after.is_subset(&bpf_before),
        "BPF programs left loaded: {:?}",
        bpf_after.difference(&bpf_before).collect::<Vec<_>>()
    );
}

/// Rewrites `.eh_frame` in place (same size) as a chain of 12-byte entries
/// each naming the one before it as its CIE (the first names itself): no
/// CIE anywhere, a cycle at the start. And makes `.eh_frame_hdr` claim
/// 2^31 - 1 FDEs in a table of a few.
fn rewrite_eh_frame(path: &Path) {
    use object::{Object as _, ObjectSection as _};
    let mut bytes = std::fs::read(path).expect("reading the binary");
    let section = |bytes: &[u8], name: &str| -> (usize, usize) {
        let file = object::File::parse(bytes).expect("an ELF file");
        let section = file.section_by_name(name).expect("the section");
        let (offset, size) = section.file_range().expect("a section in the file");
        (offset as usize, size as usize)
    };
    let (offset, size) = section(&bytes, ".eh_frame");
    let entries = (size - 4) / 12;
    for i in 0..entries {
        let at = offset + i * 12;
        let pointer_field = (i * 12 + 4) as u32;
        let previous = (i.saturating_sub(1) * 12) as u32;
        bytes[at..at + 4].copy_from_slice(&8u32.to_le_bytes());
        bytes[at + 4..at + 8].copy_from_slice(&(pointer_field - previous).to_le_bytes());
        bytes[at + 8..at + 12].copy_from_slice(&0u32.to_le_bytes());
    }
    let end = offset + entries * 12;
    bytes[end..end + 4].copy_from_slice(&0u32.to_le_bytes());
    let (hdr, _) = section(&bytes, ".eh_frame_hdr");
    // version, eh_frame_ptr_enc, fde_count_enc (udata4), table_enc, then
    // the 4-byte eh_frame pointer: the count is at 8.
    assert_eq!(bytes[hdr + 2], 0x03, "fde_count is not udata4");
    bytes[hdr + 8..hdr + 12].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
    std::fs::write(path, bytes).expect("writing the crafted binary");
}

/// Walks whose frame 0 was in `binary`, and of those, walks that reached
/// the root.
fn binary_ends(unwinding: &serde_json::Value, binary: &str) -> (u64, u64) {
    unwinding["by_binary"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|entry| {
            entry["binary"]
                .as_str()
                .is_some_and(|b| b.ends_with(binary))
        })
        .fold((0, 0), |(walks, roots), entry| {
            (
                walks + entry["walks"].as_u64().unwrap_or(0),
                roots + entry["outermost"].as_u64().unwrap_or(0),
            )
        })
}

/// A gauge's value in Prometheus text, 0 when absent.
fn gauge(text: &str, series: &str) -> f64 {
    stackscope_test_fixtures::metric_value(text, series).unwrap_or(0.0)
}

/// VmHWM of `pid`, in bytes (0 if it is gone: the agent's own exit
/// status says why).
fn peak_resident_bytes(pid: u32) -> u64 {
    stackscope_test_fixtures::peak_rss_kib(pid).unwrap_or(0) * 1024
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How many execs the exec loop (process `pid`) has done: its current
/// image's `EXEC_LOOP_IMAGES`. Read again while an exec replaces the
/// image (its environment briefly unreadable).
fn exec_images(pid: u32) -> u64 {
    for _ in 0..100 {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let images = environ
            .split(|&byte| byte == 0)
            .find_map(|entry| entry.strip_prefix(b"EXEC_LOOP_IMAGES="))
            .and_then(|value| std::str::from_utf8(value).ok()?.parse().ok());
        if let Some(images) = images {
            return images;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the exec loop's EXEC_LOOP_IMAGES could not be read");
}
