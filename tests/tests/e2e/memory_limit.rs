//! The agent's memory limit (root, a real memory cgroup): without
//! `--memory-limit` the agent takes 3/4 of its cgroup's limit (cgroup2's
//! `memory.max` where the memory controller is there, else cgroup v1's
//! `memory.limit_in_bytes`), as a DaemonSet's container limit sets it; a
//! limit below what the agent needs at the least is refused, saying what
//! it needs. (That the agent keeps within its limit under load is the
//! hostile test's part.)

use std::{
    path::Path,
    process::{Command, Stdio},
};

use stackscope_test_fixtures::workspace_binary;
use stackscope_tests::{TempCgroup, exclusive, require_root, wait_success};

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
