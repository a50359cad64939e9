//! Names for stripped binaries end to end (root): a fixture built with `-g`
//! runs stripped, its debug file kept apart. The agent ships its frames
//! unnamed (build-id + file offset); the collector names the same stored
//! profile once the debug file is uploaded with the CLI, or when a real
//! `debuginfod` server (Debian's) serves it, with the inlined function as a
//! frame of its own, its file and line; a debuginfod that never answers
//! does not hold a query past the collector's wait.

use std::{
    net::TcpListener,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use stackscope_test_fixtures::{
    C_FLAGS, Fixture, RunningProcess,
    split_debug::{self, SplitDebug},
    workspace_binary,
};
use stackscope_tests::{Collector, free_port, http_get, run_agent_for};

/// The fixture, built with `-g`: the binary run (stripped), its debug
/// file alone in `debug/` (for debuginfod), and its build-id.
fn build_stripped() -> SplitDebug {
    SplitDebug::fixture("stripped_chain", C_FLAGS)
}

/// The fixture's folded stacks in a collector.
fn fixture_stacks(collector: &Collector) -> Vec<(String, u64)> {
    collector.folded_stacks("comm=\"stripped_chain\"")
}

/// Samples whose stack reads `chain` somewhere, and all samples.
fn share(stacks: &[(String, u64)], chain: &str) -> (u64, u64) {
    let total = stacks.iter().map(|(_, n)| n).sum();
    let matching = stacks
        .iter()
        .filter(|(stack, _)| stack.contains(chain))
        .map(|(_, n)| n)
        .sum();
    (matching, total)
}

/// Asserts at least 95% of the fixture's samples read the named chain,
/// at least half of them down to the inlined `mix` (the rest are in
/// middle's own loop instructions), and that `mix` comes with its file and
/// line.
fn assert_named(collector: &Collector, when: &str) {
    let stacks = fixture_stacks(collector);
    let (named, total) = share(
        &stacks,
        "_start;__libc_start_main_impl;__libc_start_call_main;main;outer;middle",
    );
    let (in_mix, _) = share(&stacks, "main;outer;middle;mix");
    assert!(
        total > 0 && named * 100 >= total * 95 && in_mix * 2 >= total,
        "{when}: of {total} samples, {named} read main;outer;middle and {in_mix} reach mix: \
         {stacks:#?}"
    );
    let json = collector.cli(&[
        "export",
        "--format",
        "json",
        "--since",
        "10m",
        "--match",
        "comm=\"stripped_chain\"",
    ]);
    let tree: serde_json::Value = serde_json::from_slice(&json).expect("JSON tree");
    let mut mix = Vec::new();
    find_named(&tree, "mix", &mut mix);
    assert!(!mix.is_empty(), "{when}: no mix frame");
    for frame in mix {
        assert_eq!(frame["inlined"], true, "{when}: {frame}");
        assert!(
            frame["file"]
                .as_str()
                .is_some_and(|file| file.ends_with("stripped_chain.c")),
            "{when}: {frame}"
        );
        // mix's body: lines 14 to 17 of the fixture.
        let line = frame["line"].as_u64().unwrap_or(0);
        assert!((14..=17).contains(&line), "{when}: {frame}");
    }
}

fn find_named<'a>(node: &'a serde_json::Value, name: &str, out: &mut Vec<&'a serde_json::Value>) {
    if node["name"] == name {
        out.push(node);
    }
    for child in node["children"].as_array().into_iter().flatten() {
        find_named(child, name, out);
    }
}

/// Copies a stopped collector's data directory.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("creating the copy");
    for entry in std::fs::read_dir(from).expect("reading the data dir") {
        let entry = entry.expect("entry");
        if entry.file_type().expect("file type").is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copying");
        }
    }
}

/// A real debuginfod (Debian's) serving `dir` on 127.0.0.1, stopped on drop.
struct Debuginfod {
    _process: RunningProcess,
    url: String,
    _db: tempfile::TempDir,
}

impl Debuginfod {
    fn serve(dir: &Path, build_id: &str) -> Self {
        let port = free_port();
        let db = tempfile::tempdir().expect("temp dir");
        let child = Command::new("debuginfod")
            .args(["-F"])
            .arg(dir)
            .args(["-p", &port.to_string()])
            .arg("-d")
            .arg(db.path().join("debuginfod.sqlite"))
            .args(["-t", "1", "-g", "0"])
            .env("HOME", db.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("`debuginfod` is missing: run `cargo xtask setup` (installs debuginfod)");
        let process = RunningProcess::adopt(child);
        let url = format!("http://127.0.0.1:{port}");
        // Its first scan of the directory takes a moment.
        let started = Instant::now();
        let path = format!("/buildid/{build_id}/debuginfo");
        while http_get(&format!("127.0.0.1:{port}"), &path).map(|(status, _)| status) != Some(200) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "debuginfod never served {path}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        Self {
            _process: process,
            url,
            _db: db,
        }
    }
}

#[test]
fn stripped_frames_are_named_from_uploads_and_debuginfod_at_query_time() {
    stackscope_tests::require_root();
    let _exclusive = stackscope_tests::exclusive();
    let fixture = build_stripped();
    let data = tempfile::tempdir().expect("temp dir");
    let [uploads, via_debuginfod, stalled] =
        ["uploads", "debuginfod", "stalled"].map(|name| data.path().join(name));

    // Profiled with no debuginfo anywhere: the fixture's frames are its
    // binary plus an offset.
    let collector = Collector::start(&uploads);
    let spinner = RunningProcess::start_ready(Command::new(&fixture.stripped).env_clear());
    run_agent_for(&collector, "4s", &["--pid", &spinner.pid().to_string()]);
    drop(spinner);
    let stacks = fixture_stacks(&collector);
    let (unknown, total) = share(&stacks, "[unknown] stripped_chain+0x");
    assert!(
        total > 300 && unknown * 100 >= total * 80,
        "{unknown} of {total} samples unnamed in the stripped binary: {stacks:#?}"
    );
    assert_eq!(share(&stacks, "middle").0, 0, "{stacks:#?}");
    collector.stop();
    copy_dir(&uploads, &via_debuginfod);
    copy_dir(&uploads, &stalled);

    // The debug file uploaded with the CLI: the same stored profile shows
    // the names; sent again, it is not stored twice.
    let collector = Collector::start(&uploads);
    let debug = fixture.debug.to_str().expect("UTF-8 path");
    let said = String::from_utf8(collector.cli(&["debuginfo", "upload", debug])).expect("UTF-8");
    assert!(
        said.contains(&format!("build-id {} uploaded", fixture.build_id)),
        "{said}"
    );
    assert_named(&collector, "after the upload");
    let said = String::from_utf8(collector.cli(&["debuginfo", "upload", debug])).expect("UTF-8");
    assert!(said.contains("already stored"), "{said}");
    // The collector serves debuginfod's API: elfutils' own client fetches
    // the file back, and finds no executable for a debug file.
    let cache = tempfile::tempdir().expect("temp dir");
    let find = |what: &str| {
        Command::new("debuginfod-find")
            .args([what, &fixture.build_id])
            .env("DEBUGINFOD_URLS", &collector.http)
            .env("DEBUGINFOD_CACHE_PATH", cache.path())
            .output()
            .expect("`debuginfod-find` is missing: run `cargo xtask setup` (installs debuginfod)")
    };
    let found = find("debuginfo");
    assert!(found.status.success(), "{found:?}");
    let fetched = String::from_utf8_lossy(&found.stdout).trim().to_owned();
    assert_eq!(
        std::fs::read(&fetched).expect("the fetched file"),
        std::fs::read(&fixture.debug).expect("the debug file")
    );
    assert!(!find("executable").status.success());
    // A stripped binary names nothing: refused before it is sent.
    let out = Command::new(workspace_binary("stackscope"))
        .args(["--collector", &collector.grpc, "debuginfo", "upload"])
        .arg(&fixture.stripped)
        .output()
        .expect("running stackscope");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no symbol table, DWARF or Go function table"),
        "{out:?}"
    );
    collector.stop();

    // Nothing uploaded, the debug file served by debuginfod only.
    let server = Debuginfod::serve(fixture.dir().join("debug").as_path(), &fixture.build_id);
    let collector = Collector::start_with(&via_debuginfod, &["--debuginfod-urls", &server.url]);
    assert_named(&collector, "from debuginfod");
    // Fetched once into the store: known to uploaders from now on.
    assert!(
        via_debuginfod
            .join("debuginfo")
            .join(&fixture.build_id)
            .is_file()
    );
    collector.stop();
    drop(server);

    // A debuginfod that accepts and never answers: the query waits its 1 s
    // and answers with the frames unnamed (the download would take up to
    // 5 minutes).
    let silent = TcpListener::bind("127.0.0.1:0").expect("binding");
    let silent_url = format!("http://{}", silent.local_addr().expect("address"));
    let collector = Collector::start_with(
        &stalled,
        &[
            "--debuginfod-urls",
            &silent_url,
            "--debuginfod-timeout",
            "1s",
        ],
    );
    let started = Instant::now();
    let stacks = fixture_stacks(&collector);
    let waited = started.elapsed();
    assert_eq!(share(&stacks, "middle").0, 0, "{stacks:#?}");
    assert!(share(&stacks, "[unknown] stripped_chain+0x").0 > 0);
    assert!(
        waited < Duration::from_secs(30),
        "a silent debuginfod held the query for {waited:?}"
    );
    collector.stop();
}

/// Profiles `call_chain` (which names itself) for 3 s with `--symbolize
/// collector` and `args`; returns it and the agent's report.
fn call_chain_left_to_the_collector(
    collector: &Collector,
    args: &[&str],
) -> (Fixture, serde_json::Value) {
    let fixture = Fixture::compile("call_chain", &["-Wl,--build-id"]);
    let spinner = fixture.start(&[]);
    let pid = spinner.pid().to_string();
    let report = run_agent_for(
        collector,
        "3s",
        &[&["--pid", &pid, "--symbolize", "collector"], args].concat(),
    );
    (fixture, report)
}

/// `--symbolize collector`: a binary that names itself ships unnamed, and
/// the collector names it once the binary is uploaded.
#[test]
fn frames_left_to_the_collector_are_named_from_the_uploaded_binary() {
    stackscope_tests::require_root();
    let _exclusive = stackscope_tests::exclusive();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let (fixture, report) = call_chain_left_to_the_collector(&collector, &[]);
    assert!(
        report["symbolization"]["counts"]["left_to_collector"].as_u64() > Some(0),
        "{report:#}"
    );
    let stacks = collector.folded_stacks("comm=\"call_chain\"");
    let (unknown, total) = share(&stacks, "[unknown] call_chain+0x");
    assert!(
        total > 200 && unknown * 100 >= total * 95,
        "{unknown} of {total} samples unnamed: {stacks:#?}"
    );
    assert_eq!(share(&stacks, "main;a;b;c").0, 0, "{stacks:#?}");

    let binary = fixture.path.to_str().expect("UTF-8 path");
    collector.cli(&["debuginfo", "upload", binary]);
    let stacks = collector.folded_stacks("comm=\"call_chain\"");
    let (named, total) = share(&stacks, "main;a;b;c");
    assert!(
        named * 100 >= total * 80,
        "{named} of {total} samples read main;a;b;c: {stacks:#?}"
    );
    collector.stop();
}

/// `--upload-debuginfo`: the agent sends the binary it profiled (it
/// carries symbols) once, and the collector names the frames the agent
/// left unnamed.
#[test]
fn the_agent_uploads_binaries_that_carry_symbols() {
    stackscope_tests::require_root();
    let _exclusive = stackscope_tests::exclusive();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let (fixture, report) = call_chain_left_to_the_collector(&collector, &["--upload-debuginfo"]);
    let build_id = split_debug::build_id(&fixture.path);
    let uploads = &report["debuginfo_upload"];
    assert_eq!(uploads["uploaded"], 1, "{uploads:#}");
    assert_eq!(uploads["failed"], 0, "{uploads:#}");
    // libc and the loader are stripped: nothing of theirs to send.
    assert!(
        uploads["without_symbols"].as_u64() >= Some(1),
        "{uploads:#}"
    );
    assert!(data.path().join("debuginfo").join(&build_id).is_file());
    let stacks = collector.folded_stacks("comm=\"call_chain\"");
    let (named, total) = share(&stacks, "main;a;b;c");
    assert!(
        total > 200 && named * 100 >= total * 80,
        "{named} of {total} samples read main;a;b;c: {stacks:#?}"
    );
    collector.stop();
}
